"""The documentation builds and every example in it runs, so that none goes stale.

- ``mkdocs build --strict`` of ``mkdocs.yml``: docs/, GUARANTEES.md through a snippet,
  benchmarks/results/ through docs/hooks.py, the API reference from the docstrings
  (mkdocstrings). Any warning (a broken link or anchor, a page missing from the nav, a
  docstring griffe cannot read) fails the build.
- Every ```python block of docs/ and of the README runs: CPU only, on one
  compute thread, in a fresh process forked from one that imported torch and ooc
  (``tests/docs_zygote.py``), in its own temporary directory, under a timeout; identical
  blocks run once. One thread: on a 2-core machine that other jobs share, two OpenMP threads
  spinning for a core made an example 5x slower. Every ```bash block whose commands are all
  ``ooc ...`` runs the same way, its commands in order, through ``ooc.cli.main``.
- A block runs some other way only when the line before its fence says so:
  ``<!-- no-run: why -->`` (a case that skips with that reason, so ``pytest -ra`` lists it;
  ``OPT_OUTS`` must name every one, so that a new one is a visible change; a Python block
  opts out only where it needs a GPU) or ``<!-- torchrun: N -->`` (the block runs on N ranks
  at once, each forked with the environment torchrun gives its workers). A bash block with
  other commands (an install, torchrun, a benchmark) and no marker fails.
- The README links only to files that exist from the repository root, where it stands, and
  every ``path/to/file`` the docs cite in backticks exists (with ``::test_x``, that test too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TIMEOUT_S = 90   # one example; the slowest (Lightning, the Trainer) take ~10 s on a loaded 2-core machine
PARALLEL = 2     # examples at once (a DDP example's ranks count each)

# Every block that does not run, by page, with the reason its marker gives.
OPT_OUTS = {
    ("README", "installs packages"),
    ("README", "installs packages, then runs the whole test suite"),
    ("getting-started.md", "installs packages"),
    ("getting-started.md", "installs packages, then runs the whole test suite"),
    ("getting-started.md", "ooc demo trains 24 steps in fresh processes: tests/ooc/test_cli_demo.py runs it"),
    ("guide/gpu.md", "needs a GPU"),
    ("guide/gpu.md", "installs packages"),
    ("guide/gpu.md", "needs a GPU: benchmarks/bench_gpu.py's dry run is tests/test_bench_gpu_dry.py"),
    ("guide/fragmentation.md", "needs a GPU"),
    ("guide/distributed.md", "the command for the block above, which the docs test runs on 2 forked ranks"),
    ("benchmarks.md", "runs a benchmark for minutes: tests/test_benchmarks_smoke.py runs each with --quick"),
}


@dataclass(frozen=True)
class Block:
    page: str          # relative to docs/
    line: int          # of the opening fence
    lang: str          # python or bash
    code: str
    marker: tuple[str, str] | None   # ("no-run", why) or ("torchrun", ranks)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def ooc_commands(self) -> list[list[str]] | None:
        """The block's commands as ``ooc`` argument lists; None if any is something else."""
        lines = re.sub(r"\\\n", " ", self.code).splitlines()   # continued lines joined
        argvs = [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]
        return [a[1:] for a in argvs] if argvs and all(a[0] == "ooc" for a in argvs) else None


def _pages() -> dict[str, Path]:
    """The pages whose examples run, by name: docs/'s relative to docs/, and "README"."""
    pages = {str(p.relative_to(DOCS)): p for p in sorted(DOCS.rglob("*.md"))}
    return {"README": ROOT / "README.md", **pages}


def _blocks() -> list[Block]:
    out = []
    fence = re.compile(r"^(\s*)```(\w+)\s*$")
    marker = re.compile(r"^\s*<!--\s*(no-run|torchrun):\s*(.*?)\s*-->\s*$")
    for page, path in _pages().items():
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = fence.match(lines[i])
            if not m:
                i += 1
                continue
            indent, lang = m.groups()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"
                       and lines[j].startswith(indent))
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mk = marker.match(prev)
            if lang in ("python", "bash"):
                out.append(Block(page, i + 1, lang,
                                 textwrap.dedent("\n".join(lines[i + 1:end])) + "\n",
                                 mk.groups() if mk else None))
            i = end + 1
    return out


BLOCKS = _blocks()


def _runnable() -> list[Block]:
    """One block per distinct code (the README repeats the guide's first examples)."""
    seen: dict[str, Block] = {}
    for b in BLOCKS:
        seen.setdefault(hashlib.sha256(f"{b.lang}\n{b.code}".encode()).hexdigest(), b)
    return list(seen.values())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["CUDA_VISIBLE_DEVICES"] = ""        # CPU only, also on a machine with a GPU
    env["NO_MKDOCS_2_WARNING"] = "1"        # mkdocs-material's banner about its end of life
    env["OMP_NUM_THREADS"] = "1"
    return env


def _request(block: Block, cwd: Path) -> dict | None:
    """What the example runner is asked to run for ``block`` in ``cwd`` (None: nothing)."""
    kind, arg = block.marker or (None, None)
    if kind == "no-run":
        return None
    request = {"id": block.id, "cwd": str(cwd), "timeout": TIMEOUT_S}
    if block.lang == "python":
        return request | {"code": block.code, "ranks": int(arg) if kind == "torchrun" else 1}
    commands = block.ooc_commands()
    if commands is None:
        return None   # test_example_runs fails it, saying why
    (cwd / "benchmarks").symlink_to(ROOT / "benchmarks")   # the profiles the examples name
    return request | {"ooc": commands}


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Every example, run once, two at a time (two cores; each on one compute thread): by
    block id, the runner's answer and the directory the example ran in."""
    requests = {}
    for n, block in enumerate(_runnable()):
        cwd = tmp_path_factory.mktemp(f"example{n}")
        if (request := _request(block, cwd)) is not None:
            requests[block.id] = (request, cwd)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "docs_zygote.py"), str(PARALLEL)], cwd=ROOT,
                            env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate("".join(json.dumps(r) + "\n" for r, _ in requests.values()),
                              timeout=TIMEOUT_S * len(requests))
    answers = {a["id"]: a for a in map(json.loads, out.splitlines())}
    return {i: (answers.get(i, {"status": f"no answer: the runner exited {proc.returncode}", "seconds": 0}), cwd)
            for i, (_, cwd) in requests.items()}


def test_mkdocs_builds_strict(tmp_path):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    # GUARANTEES.md through the snippet, the results and their plots through the hook, the API
    # reference from the docstrings: each there, none a copy.
    assert "What ooc guarantees" in (site / "guarantees" / "index.html").read_text()
    for path in (ROOT / "benchmarks" / "results").iterdir():
        if path.suffix == ".png":
            assert (site / "benchmarks" / "results" / path.name).read_bytes() == path.read_bytes()
        elif path.suffix == ".md" and not path.stem.endswith("-quick"):
            assert (site / "benchmarks" / "results" / path.stem / "index.html").exists(), path.name
    assert "Run training steps under a memory budget" in (site / "api" / "engine" / "index.html").read_text()
    print(f"mkdocs build --strict: {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.id)
def test_example_runs(block: Block, ran):
    kind, arg = block.marker or (None, None)
    if kind == "no-run":
        pytest.skip(f"{block.id}: {arg}")
    assert block.lang == "python" or block.ooc_commands() is not None, (
        f"{block.id}: a bash block runs only if all its commands are `ooc ...`; "
        "mark it <!-- no-run: why --> (and add it to OPT_OUTS) otherwise")
    answer, cwd = ran[block.id]
    output = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(cwd.glob("output*.txt")))
    assert answer["status"] == 0, f"{block.id} exited {answer['status']} after {answer['seconds']:.1f} s:\n{output}"


def test_opt_outs_are_the_listed_ones():
    found = {(b.page, b.marker[1]) for b in BLOCKS if b.marker and b.marker[0] == "no-run"}
    assert found == OPT_OUTS
    assert all(b.lang == "bash" or b.marker[1].startswith("needs a GPU") for b in BLOCKS
               if b.marker and b.marker[0] == "no-run"), "a Python example opts out only where it needs a GPU"


def test_every_example_is_found():
    pages = {b.page for b in BLOCKS}
    assert {"README", "getting-started.md", "guide/recompute.md", "guide/integrations.md"} <= pages
    assert sum(b.lang == "python" for b in BLOCKS) >= 10


def test_the_readme_links_to_files_that_exist():
    """From the repository root, where it stands."""
    text = _pages()["README"].read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://|#", t)]
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []
    assert len(text.splitlines()) <= 130


def test_cited_paths_exist():
    """A page that cites ``tests/ooc/test_amp.py::test_x`` or ``ooc/engine/lifetime.py`` names
    something that is there."""
    missing = []
    for path in [*DOCS.rglob("*.md"), ROOT / "mkdocs.yml"]:
        for cited in re.findall(r"`([\w.-]+/[\w./-]+\.(?:py|md|json|cpp|png|txt|yml)(?:::\w+)?)", path.read_text()):
            file, _, test = cited.partition("::")
            target = ROOT / file
            if not target.exists() or (test and f"def {test}" not in target.read_text()):
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert missing == []
