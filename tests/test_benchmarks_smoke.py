"""Every benchmark script still runs: ``benchmarks/bench_*.py --quick`` exits 0 and writes its report.

The scripts are found by name, so a new benchmark is covered the day it lands. Each runs as
its own process (as a user would run it), with ``--out`` pointing into a temporary directory
so the committed results are never touched; two run at a time (this machine has two cores),
each with one compute thread. The processes are forked by tests/fork_server.py, the scripts'
and the cases' they start as ``[sys.executable, ...]`` (``forked.python_shim``): ~110 fresh
interpreters, 3-5 s each for torch's import on a 2-core machine, were most of this test's
time (505 s of a 2,073 s suite).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from forked import python_shim

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))
PARALLEL = 2
PER_SCRIPT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_benchmark_runs_quick(tmp_path: Path) -> None:
    assert SCRIPTS, f"no bench_*.py in {BENCHMARKS}"
    python, forking = python_shim(tmp_path)
    # One compute thread per script: two scripts at a time on two cores with PyTorch's default
    # of a thread per core ran each step ~10x slower (oversubscribed), for nothing this test
    # checks (it checks that each script runs and reports; timings belong to full runs).
    env = {**os.environ, **forking, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    pending = list(SCRIPTS)
    running: list[tuple[Path, Path, subprocess.Popen, float]] = []
    failures: list[str] = []

    def finish(script: Path, out: Path, proc: subprocess.Popen, t0: float) -> None:
        try:
            proc.wait(timeout=max(1.0, PER_SCRIPT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failures.append(f"{script.name}: still running after {PER_SCRIPT_S} s")
            return
        if proc.returncode != 0:
            log = out.with_suffix(".log").read_text(errors="replace")
            tail = "\n".join(log.strip().splitlines()[-15:])
            failures.append(f"{script.name}: exit status {proc.returncode}\n{tail}")
        elif not out.is_file() or out.stat().st_size == 0:
            failures.append(f"{script.name}: exit 0 but no report at {out}")

    while pending or running:
        while pending and len(running) < PARALLEL:
            script = pending.pop(0)
            name = script.stem.removeprefix("bench_")
            out = tmp_path / f"{name}-quick.md"
            # Output to a file, not a pipe: a chatty script must not block on a full pipe.
            with open(out.with_suffix(".log"), "wb") as log:
                proc = subprocess.Popen([python, str(script), "--quick", "--out", str(out)],
                                        cwd=BENCHMARKS.parent, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
            running.append((script, out, proc, time.monotonic()))
        # Wait for whichever finishes first (poll: a few processes, no need for more).
        while running and all(p.poll() is None for _, _, p, _ in running):
            time.sleep(0.2)
            for item in list(running):
                if time.monotonic() - item[3] > PER_SCRIPT_S:
                    running.remove(item)
                    finish(*item)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            finish(*item)
    assert not failures, "\n\n".join(failures)
