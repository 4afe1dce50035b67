"""tests/forked.py gives what ``subprocess.run([sys.executable, ...])`` gives: the tests that
moved to it rely on exit codes, signals, timeouts, output, the environment, TMPDIR and exit
functions behaving as in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from forked import run_python


def test_exit_codes_output_and_signals_are_as_a_fresh_interpreter_gives_them() -> None:
    r = run_python(["-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); sys.exit(3)",
                    "a", "b"])
    assert (r.returncode, r.stdout, r.stderr) == (3, "out ['a', 'b']\n", "err\n")
    assert run_python(["-c", "raise ValueError('named')"]).returncode == 1
    assert "ValueError: named" in run_python(["-c", "raise ValueError('named')"]).stderr
    assert run_python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]).returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(30)"], timeout=1)
    assert run_python(["-c", "print('after a timeout')"]).stdout == "after a timeout\n"


def test_environment_cwd_tmpdir_path_and_exit_functions(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys, tempfile
        atexit.register(lambda: open(os.environ["MARK"], "w").write("ran"))
        print(os.getcwd(), tempfile.gettempdir(), os.environ.get("ONLY_HERE"), sys.path[0], sys.argv[1])
    """))
    env = {**os.environ, "MARK": str(tmp_path / "mark"), "ONLY_HERE": "1", "TMPDIR": str(tmp_path)}
    r = run_python([str(script), "x"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path), str(tmp_path), "1", str(tmp_path), "x"]
    assert (tmp_path / "mark").read_text() == "ran"   # weakref.finalize's cleanups run so too
    r = run_python(["-c", "import os; print(os.environ.get('ONLY_HERE'))"])
    assert r.stdout == "None\n"                          # nothing carried over from the last child
    assert "ooc" not in run_python(["-c", "import sys; print(sorted(sys.modules))"]).stdout.split("'")
    assert run_python(["-c", "import sys; print(sys.executable)"]).stdout.strip() == sys.executable
