"""Every bad value of every flag of every ``ooc`` command: one line, exit 2, before any work.

The table below has bad values for each flag that takes a value, and ``test_the_table_covers
every_flag`` fails when a command grows a flag the table does not cover. Each case runs
``ooc.cli.main`` in-process with the expensive steps (tracing, planning, simulating, the
fragmentation replay, the demo's runs) replaced by a tripwire that is not an error ``main``
turns into exit 2: a value checked only after the work started fails the test instead of
costing the user the work.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import stat

import pytest
import torch

import ooc
from ooc.cli import build_parser, main
from scheduler.ir import Cost, Kind, Variable, build_sequence
from scheduler.planner import plan

MiB = 1 << 20

SIZE = ["sixteen", "0", "-5", "1.5", "16 GBs", ""]
POSITIVE_INT = ["0", "-3", "x", "1.5"]
OUTPUT = ["{dir}", "{dir}/missing/out.json", "{file}/out.json", "{readonly}/out.json"]
PNG = ["{dir}", "{dir}/missing/out.png", "{file}/out.png", "{readonly}/out.png", "{dir}/no-suffix"]
INPUT = ["{dir}/missing.json", "{dir}", "{file}"]
NAME = ["magic", ""]

# command -> (cheap valid arguments, {flag: bad values}). "INPUT"/"MODEL" stand for the
# positional argument: its bad values replace the valid one.
TABLE: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "demo": ([], {
        "--model": ["resnet5", ""], "--batch": POSITIVE_INT, "--steps": POSITIVE_INT,
        "--budget": SIZE, "--fraction": ["0", "-1", "nan", "inf", "x"],
        "--manage": ["foo", "", "activations,foo"], "--optimizer": NAME,
        "--storage": ["{dir}/missing", "{file}", "{world_writable}"], "--chunk": SIZE,
    }),
    "trace": (["MODEL", "small_cnn", "--batch", "2"], {
        "MODEL": ["resnet5", ""], "--batch": POSITIVE_INT,
        "--device": ["gpu", "xla:0"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]),
        "--optimizer": NAME, "--image-size": POSITIVE_INT, "--seq-len": POSITIVE_INT,
        "--depth": POSITIVE_INT, "--width": POSITIVE_INT, "--heads": POSITIVE_INT,
        "--vocab": POSITIVE_INT, "--num-classes": POSITIVE_INT, "--base": POSITIVE_INT,
        "--output": OUTPUT,
    }),
    "plan": (["INPUT", "{trace}", "--budget", "64MiB"], {
        "INPUT": INPUT, "--budget": SIZE, "--window": SIZE, "--policy": NAME, "--output": OUTPUT,
        "--data-parallel": POSITIVE_INT, "--recompute": NAME + ["always"],
        "--manage": ["weights", ",", "activations,bogus"],
    }),
    "simulate": (["INPUT", "{plan}"], {
        "INPUT": INPUT, "--hardware": NAME + ["h200"], "--device-memory": SIZE,
        "--host-us": ["80,-1", "x", "1,2,3", "inf", ""],
        "--allocator": NAME + ["buddy"], "--chunk": SIZE, "--timeline": OUTPUT, "--budget": SIZE,
        "--window": SIZE, "--policy": NAME, "--data-parallel": POSITIVE_INT,
        "--recompute": NAME + ["always"], "--manage": ["weights", ",", "activations,bogus"],
    }),
    "fit": (["INPUT", "{trace}", "--device-memory", "1GiB"], {
        "INPUT": INPUT, "--device-memory": SIZE, "--margin": [v for v in SIZE if v != "0"],
        "--arena": NAME + ["cuda"], "--budgets": POSITIVE_INT, "--manage": ["weights", ",", "activations,bogus"],
        "--recompute": NAME + ["always"], "--hardware": NAME + ["h200"],
        "--host-us": ["80,-1", "x", "1,2,3", "inf", ""], "--plot": PNG,
    }),
    "frag": (["INPUT", "{trace}"], {
        "INPUT": INPUT, "--chunks": ["3MiB", "lots", ",", "0"], "--device-memory": SIZE,
        "--device": ["-1", "x"], "--plot": PNG, "--export-snapshot": OUTPUT,
        "--export-allocator": ["3MiB", "buddy", "2MiB,4MiB"],
        "--alloc-conf": ["expandable_segments:maybe", "max_split_size_mb:-1", "nonsense:1",
                         "roundup_power2_divisions:3", ";"],
    }),
    "report": (["INPUT", "{plan}"], {
        "INPUT": INPUT, "--output": PNG, "--budget": SIZE, "--policy": NAME,
    }),
}

# Values each fine alone that do not go together: still one line, still before the work.
COMBINATIONS = [
    ["trace", "tiny_transformer", "--batch", "2", "--width", "7", "--heads", "3"],
    ["trace", "resnet50", "--batch", "2", "--seq-len", "8"],
    ["trace", "gpt2", "--batch", "2", "--image-size", "32"],
    ["trace", "small_cnn", "--batch", "2", "--measure"],
    ["demo", "--budget", "64MiB", "--fraction", "8"],
    ["simulate", "{plan}", "--chunk", "2MiB"],
    ["simulate", "{trace}"],
    ["simulate", "{trace}", "--policy", "lms"],
    ["simulate", "{plan}", "--budget", "16GiB"],
    ["report", "{trace}"],
    ["report", "{plan}", "--budget", "16GiB"],
    ["plan", "{trace}", "--budget", "16GiB", "--bogus"],
    ["plan", "{trace}", "--budget", "16GiB", "--policy", "lms", "--recompute", "prefer"],
    ["simulate", "{trace}", "--recompute", "never"],
    ["simulate", "{trace}", "--budget", "16GiB", "--policy", "vdnn", "--recompute", "prefer"],
    ["simulate", "{plan}", "--budget", "16GiB", "--recompute", "never"],
    ["frag", "{trace}", "--device-memory", "1MiB"],
    ["fit", "{plan}", "--device-memory", "1GiB"],
    ["fit", "{trace}", "--device-memory", "1GiB", "--margin", "1GiB"],
    ["fit", "{trace}"],
]


def _cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for cmd, (base, flags) in TABLE.items():
        for flag, values in flags.items():
            for value in values:
                if flag in ("INPUT", "MODEL"):
                    argv = [value if a == base[base.index(flag) + 1] else a for a in base
                            if a != flag]
                else:
                    argv = [a for a in base if a not in ("INPUT", "MODEL")] + [flag, value]
                cases.append((cmd, flag, [cmd, *argv]))
    return cases


CASES = _cases()


def _step():
    """Three functions: a parameter read at the start and written at the end, two
    activations; in-core peak 10 MiB, 8 MiB when the parameter leaves during f1."""
    variables = [Variable(0, 2 * MiB, Kind.PARAM, name="w", live_in=True, live_out=True),
                 Variable(1, 4 * MiB, Kind.ACTIVATION, name="a"),
                 Variable(2, 4 * MiB, Kind.ACTIVATION, name="b")]
    return build_sequence([("f0", [(0, "r"), (1, "w")], Cost()), ("f1", [(1, "r"), (2, "w")], Cost()),
                           ("f2", [(2, "r"), (0, "w")], Cost())], variables, {"model": "tiny"})


class WorkStarted(BaseException):
    """Raised by the tripwires; not an Exception, so main cannot turn it into exit 2."""


@pytest.fixture()
def files(tmp_path, monkeypatch):
    """A tiny trace and plan on disk, the odd paths the table names, and tripwires on work."""
    seq = _step()
    seq.to_json(tmp_path / "trace.json")
    plan(seq, budget=64 * MiB).to_json(tmp_path / "plan.json")
    (tmp_path / "file").write_text("not json, not a directory\n")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o500)
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)  # writable by anyone, no sticky bit: the engine refuses it
    root = os.geteuid() == 0
    if root and not os.path.isdir("/sys"):
        pytest.skip("as root, a directory no one may write in is /sys, and there is none")
    paths = {"dir": str(tmp_path), "file": str(tmp_path / "file"),
             # root writes into a 0500 directory; no one creates files in /sys
             "readonly": "/sys" if root else str(readonly),
             "world_writable": str(world), "trace": str(tmp_path / "trace.json"),
             "plan": str(tmp_path / "plan.json")}

    def tripwire(*_a, **_k):
        raise WorkStarted("the command started its work before rejecting the input")

    for owner, name in (("ooc.cli.cmd_demo", "run_case"), ("ooc.cli.cmd_demo", "managed_peak"),
                        ("ooc", "trace"), ("ooc.cli.cmd_plan", "plan_and_summarize"),
                        ("scheduler.planner", "plan"), ("scheduler.simulate", "simulate"),
                        ("ooc.frag", "analyze"), ("scheduler.device_fit", "fit_device")):
        # modules by name: ``scheduler.simulate`` the attribute is the function of that name
        monkeypatch.setattr(importlib.import_module(owner), name, tripwire)
    monkeypatch.chdir(tmp_path)  # report's default output is checked in the working directory
    yield paths
    readonly.chmod(0o700)


def _check_one_line(argv, paths, capsys, *, names: str | None = None) -> str:
    args = [a.format(**paths) for a in argv]
    code = main(args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, f"{args}: exit {code}\n{err}"
    assert captured.out == "", f"{args}: printed on stdout before failing: {captured.out!r}"
    assert err.endswith("\n") and err.count("\n") == 1, f"{args}: not one line: {err!r}"
    assert err.startswith(f"ooc {argv[0]}: error: "), err
    assert "Traceback" not in err
    if names:
        assert names in err, f"{args}: the message does not name {names}: {err}"
    return err


@pytest.mark.parametrize("cmd, flag, argv", CASES, ids=[" ".join(c[2][1:]) for c in CASES])
def test_a_bad_value_is_one_line_and_exit_2_before_any_work(cmd, flag, argv, files, capsys):
    named = None if flag in ("INPUT", "MODEL") else flag
    _check_one_line(argv, files, capsys, names=named)


@pytest.mark.parametrize("argv", COMBINATIONS, ids=[" ".join(a) for a in COMBINATIONS])
def test_values_that_do_not_go_together_are_one_line_and_exit_2(argv, files, capsys):
    _check_one_line(argv, files, capsys)


def test_the_table_covers_every_flag():
    """A new flag that takes a value needs bad values in TABLE (or it is not tested)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(TABLE)
    for cmd, p in sub.choices.items():
        flags = TABLE[cmd][1]
        for action in p._actions:
            if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue  # store_true flags take no value
            if not action.option_strings:
                key = "MODEL" if cmd == "trace" else "INPUT"
                assert key in flags, f"ooc {cmd}: positional {action.metavar} has no bad values"
                continue
            assert any(o in flags for o in action.option_strings), \
                f"ooc {cmd} {'/'.join(action.option_strings)}: add bad values to TABLE"


def test_a_world_writable_swap_directory_is_refused_like_the_engine_does(files, capsys):
    mode = stat.S_IMODE(os.stat(files["world_writable"]).st_mode)
    assert mode & stat.S_IWOTH and not mode & stat.S_ISVTX
    err = _check_one_line(["demo", "--storage", "{world_writable}"], files, capsys, names="--storage")
    assert "sticky" in err


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ooc {ooc.__version__}"


def test_help_of_plan_lists_every_policy_and_says_what_units_mean(capsys):
    from scheduler.planner import POLICIES

    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in POLICIES:
        assert name in text.replace("on- demand", "on-demand"), name
    assert "16G = 16GB = 16*10^9 bytes" in text and "16GiB = 16*2^30 bytes" in text


def test_an_output_directory_is_refused_rather_than_written_beside(files, capsys):
    """``report -o DIR`` wrote DIR.png (matplotlib adds the suffix) and said it wrote DIR."""
    err = _check_one_line(["report", "{plan}", "-o", "{dir}"], files, capsys, names="--output")
    assert "is a directory" in err
    assert not os.path.exists(files["dir"] + ".png")


def test_report_json_prints_the_figures_of_what_it_drew(tmp_path, capsys):
    seq = _step()
    seq.to_json(tmp_path / "t.json")
    png = tmp_path / "r.png"
    budget = seq.in_core_peak_bytes - 2 * MiB
    assert main(["report", str(tmp_path / "t.json"), "--budget", str(budget), "-o", str(png),
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    info = json.loads(out)
    expected = plan(seq, budget=budget).summary()
    assert info == {**expected, "output": str(png)} and info["bytes_out"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "t.json"), "--budget", str(budget), "-o", str(png)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"wrote {png}: policy window") and line.count("\n") == 1
