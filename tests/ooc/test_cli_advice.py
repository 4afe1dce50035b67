"""What ``ooc simulate`` and ``ooc frag`` tell a user whose step does not fit: a next step
decided by the figures, that ends somewhere. (simulate said "lower the budget, or try
--allocator vmm" whatever the cause; frag, for live bytes over the device, said "plan
swapping with `ooc plan`", for a plan too.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ooc.cli import main
from ooc.cli.cmd_simulate import _what_to_do
from scheduler.ir import Cost, Kind, Variable, build_sequence
from scheduler.planner import plan

MiB = 1 << 20


@pytest.fixture()
def step_files(tmp_path):
    """A trace (in-core peak 10 MiB) and its plan at 8 MiB (the parameter leaves in f1)."""
    variables = [Variable(0, 2 * MiB, Kind.PARAM, name="w", live_in=True, live_out=True),
                 Variable(1, 4 * MiB, Kind.ACTIVATION, name="a"),
                 Variable(2, 4 * MiB, Kind.ACTIVATION, name="b")]
    seq = build_sequence([("f0", [(0, "r"), (1, "w")], Cost()), ("f1", [(1, "r"), (2, "w")], Cost()),
                          ("f2", [(2, "r"), (0, "w")], Cost())], variables)
    seq.to_json(tmp_path / "trace.json")
    schedule = plan(seq, budget=8 * MiB)
    assert schedule.bytes_out > 0
    schedule.to_json(tmp_path / "plan.json")
    return tmp_path / "trace.json", tmp_path / "plan.json"


def _advice(out: str) -> str:
    lines = out.splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("fits"))
    return " ".join(lines[k:])


def test_simulate_sends_a_plan_over_the_device_to_a_lower_budget_not_to_an_allocator(step_files, capsys):
    _, plan_file = step_files
    for allocator in ([], ["--allocator", "caching"], ["--allocator", "vmm"]):
        assert main(["simulate", str(plan_file), "--device-memory", "4MiB", *allocator]) == 0
        advice = _advice(capsys.readouterr().out)
        assert "NO" in advice and "re-plan" in advice and "below 4 MiB" in advice
        assert "try --allocator" not in advice and "ooc frag" not in advice


def test_simulate_sends_chunk_rounding_to_smaller_chunks(step_files, capsys):
    _, plan_file = step_files
    assert main(["simulate", str(plan_file), "--device-memory", "8MiB", "--allocator", "vmm",
                 "--chunk", "6MiB"]) == 0
    advice = _advice(capsys.readouterr().out)
    assert "8 MiB live fit in 8 MiB" in advice and "smaller --chunk" in advice


def test_simulate_sends_fragmentation_to_virtual_addressing():
    hw = SimpleNamespace(device_bytes=16 * MiB)
    r = SimpleNamespace(hardware=hw, peak_bytes=12 * MiB, reserved_peak_bytes=16 * MiB,
                        allocator="caching", chunk_bytes=None)
    assert "try --allocator vmm" in _what_to_do(r)
    r.peak_bytes = 17 * MiB  # the plan alone is over: no allocator helps
    assert "try --allocator" not in _what_to_do(r) and "below 16 MiB" in _what_to_do(r)


@pytest.mark.parametrize("which, expected", [("trace", "plan this trace with `ooc plan trace.json"),
                                             ("plan", "re-plan the step with a lower budget")])
def test_frag_says_which_budget_when_the_live_bytes_exceed_the_device(step_files, capsys, which, expected):
    path = step_files[0] if which == "trace" else step_files[1]
    assert main(["frag", str(path), "--device-memory", "6MiB", "--chunks", "2MiB"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    recommendation = text[text.index("Recommendation:"):]
    assert expected in recommendation and "below 6 MiB" in recommendation
    assert "ooc simulate" not in recommendation
