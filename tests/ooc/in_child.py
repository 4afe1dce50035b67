"""Run a function of a test module in a process of its own, so that a crash fails the test.

A read of a released storage is garbage or a segfault (issue 40), which would take pytest down
with it: tests of reads between steps and of updates outside a step run their scenario in a
child, on one compute thread (two OpenMP threads spinning for a core of this 2-core machine
made a child 5x slower under load), and report a signal by name.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for forked
from forked import run_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_in_child(test_file: str, name: str, *args: str, timeout: float = 300) -> None:
    """Call ``name(*args)`` of the module ``test_file`` (its ``__file__``) in a process of its
    own (forked by tests/fork_server.py, torch already imported); fail with its output if it
    exits non-zero or is killed by a signal."""
    path = Path(test_file)
    code = (f"import sys; sys.path[:0] = [{str(path.parent)!r}, {str(ROOT)!r}]; "
            f"import torch; torch.set_num_threads(1); import {path.stem} as t; t.{name}(*{args!r})")
    r = run_python(["-c", code], cwd=ROOT, timeout=timeout)
    how = f"killed by {signal.Signals(-r.returncode).name}" if r.returncode < 0 else f"exited with {r.returncode}"
    assert r.returncode == 0, f"{name}{args} {how}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
