"""``run_python(args, ...)``: ``subprocess.run([sys.executable, *args], capture_output=True,
text=True, ...)`` for the tests, served by ``tests/fork_server.py`` (torch imported once, a
forked child per call) instead of a fresh interpreter: ~5 s less a call on a 2-core machine.

For the children whose point is a process of their own (a crash, the CPU allocator, glibc's
thresholds), not a fresh import: a test that checks what importing does (test_layout's "ooc
imports no framework") keeps ``subprocess``. The server starts at the first call and lives
for the session; if it dies (a child's crash cannot kill it, but a test might), the next call
starts another.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "fork_server.py"
_server: subprocess.Popen | None = None


def _started() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        # The server's environment (this process's) is what a child's libraries load with.
        _server = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        atexit.register(_server.kill)
    return _server


def run_python(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python *args`` (``-c CODE ...`` or ``SCRIPT ...``) in a forked child; its exit code
    (minus the signal that ended it), stdout and stderr, as ``subprocess.run`` gives them.
    ``env`` is the child's whole environment (default: this process's). Past ``timeout`` the
    child ends on SIGALRM and ``subprocess.TimeoutExpired`` is raised."""
    server = _started()
    with tempfile.TemporaryDirectory(prefix="ooc-forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {"argv": [str(a) for a in args], "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd()), "timeout": max(1, int(timeout)), "stdout": out, "stderr": err}
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        ended = server.stdout.readline()
        if not ended:
            raise RuntimeError(f"tests/fork_server.py ended (exit {server.wait()}) before answering")
        status = json.loads(ended)["status"]
        stdout = Path(out).read_text(errors="replace") if os.path.exists(out) else ""
        stderr = Path(err).read_text(errors="replace") if os.path.exists(err) else ""
    if status == -14:   # SIGALRM: the timeout
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *args], status, stdout, stderr)
