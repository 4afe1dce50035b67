"""tests/forked.py gives what ``subprocess.run([sys.executable, ...])`` gives: the tests that
moved to it rely on exit codes, signals, timeouts, output, the environment, TMPDIR and exit
functions behaving as in a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from forked import python_shim, run_python


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


def test_a_shim_forks_a_command_and_the_children_it_starts_beside_each_other(tmp_path: Path) -> None:
    """``python_shim``: a command run with it (a benchmark script) and the ``[sys.executable,
    ...]`` children it starts, two at once here, are forked by the server; each child's
    output reaches the pipe its starter gave it, its exit code and signal come back as a
    fresh interpreter's would, and one whose starter is killed is killed with it."""
    python, forking = python_shim(tmp_path)
    script = tmp_path / "starter.py"
    script.write_text(textwrap.dedent("""
        import json, os, subprocess, sys
        kids = [subprocess.Popen([sys.executable, "-c", "import os, sys, time; time.sleep(0.5);"
                                  "print(os.getppid(), 'torch' in sys.modules); sys.exit(int(sys.argv[1]))", str(k)],
                                 stdout=subprocess.PIPE, text=True) for k in (0, 4)]
        lines = [k.communicate()[0].split() for k in kids]
        print(json.dumps([os.getpid(), lines, [k.returncode for k in kids]]))
        m = subprocess.run([sys.executable, "-m", "json.tool", "--compact"], input='{"a": [1]}',
                           capture_output=True, text=True)
        print(m.stdout.strip())
        try:
            subprocess.run([sys.executable, "-c", "import time, pathlib; time.sleep(3);"
                            "pathlib.Path(sys.argv[1]).touch()", os.environ["MARK"]], timeout=0.5)
        except subprocess.TimeoutExpired:
            print("timed out")
        sys.stdout.flush()
        os.kill(os.getpid(), 15)
    """))
    mark = tmp_path / "left"
    r = subprocess.run([python, str(script)], env={**os.environ, **forking, "MARK": str(mark)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, r.stderr
    first, second, third = r.stdout.splitlines()
    pid, lines, codes = json.loads(first)
    # forked by the server, not started by the script (their parent is the server), with
    # torch already imported there; each exit code as given
    assert all(parent != str(pid) and imported == "True" for parent, imported in lines) and codes == [0, 4], first
    assert second == '{"a":[1]}' and third == "timed out", r.stdout
    time.sleep(4)
    assert not mark.exists(), "the child whose starter was killed went on"
    # without the server's socket the shim is the real interpreter
    r = subprocess.run([python, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True)
    assert r.stdout == "False\n"
