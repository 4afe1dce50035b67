"""``run_python(args, ...)``: ``subprocess.run([sys.executable, *args], capture_output=True,
text=True, ...)`` for the tests, served by ``tests/fork_server.py`` (torch imported once, a
forked child per call) instead of a fresh interpreter: ~5 s less a call on a 2-core machine.
``python_shim(folder)``: an executable that takes ``python``'s arguments and has the server
run them, for a command (a benchmark script) whose own children start as
``[sys.executable, ...]``: its children are forked too.

For the children whose point is a process of their own (a crash, the CPU allocator, glibc's
thresholds), not a fresh import: a test that checks what importing does (test_layout's "ooc
imports no framework") keeps ``subprocess``. The server starts at the first call and lives
for the session (it ends when this process does); if it dies (a child's crash cannot kill it,
but a test might), the next call starts another.

Only the standard library here: the shim runs this file under ``python -S``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOCKET_ENV = "OOC_FORK_SOCKET"   # where a shim finds the server
SHIM_ENV = "OOC_FORK_SHIM"       # the shim's path, for the children it starts (fork_server.SHIM_ENV)
_server: subprocess.Popen | None = None
_socket: str | None = None


def server_socket() -> str:
    """The socket of this process's server, started if none is running."""
    global _server, _socket
    if _server is None or _server.poll() is not None:
        folder = tempfile.mkdtemp(prefix="ooc-fork-")   # 0700: only this user reaches the socket
        _socket = os.path.join(folder, "socket")
        # The server's environment (this process's) is what a child's libraries load with.
        _server = subprocess.Popen([sys.executable, str(HERE / "fork_server.py"), _socket],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert _server.stdout is not None
        if _server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/fork_server.py did not start (exit {_server.wait()})")
    assert _socket is not None
    return _socket


def forked(path: str, args: list[str], env: dict[str, str], cwd: str, timeout: float | None,
           fds: tuple[int, int, int]) -> int:
    """Have the server at ``path`` run ``python *args`` with ``fds`` as its stdin, stdout and
    stderr; its exit status (minus the signal that ended it). Returns when the child ends."""
    body = json.dumps({"argv": [str(a) for a in args], "env": env, "cwd": cwd,
                       "timeout": max(1, int(timeout)) if timeout else 0}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [len(body).to_bytes(8, "little")], list(fds))
        conn.sendall(body)
        answer = b""
        while not answer.endswith(b"\n"):
            part = conn.recv(4096)
            if not part:
                raise RuntimeError("tests/fork_server.py ended before answering")
            answer += part
    return json.loads(answer)["status"]


def run_python(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python *args`` (``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``) in a forked
    child; its exit code (minus the signal that ended it), stdout and stderr, as
    ``subprocess.run`` gives them. ``env`` is the child's whole environment (default: this
    process's). Past ``timeout`` the child ends on SIGALRM and ``subprocess.TimeoutExpired``
    is raised."""
    path = server_socket()
    with tempfile.TemporaryDirectory(prefix="ooc-forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        fds = (os.open(os.devnull, os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT, 0o600),
               os.open(err, os.O_WRONLY | os.O_CREAT, 0o600))
        try:
            status = forked(path, args, dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                            timeout, fds)
        finally:
            for fd in fds:
                os.close(fd)
        stdout = Path(out).read_text(errors="replace")
        stderr = Path(err).read_text(errors="replace")
    if status == -signal.SIGALRM:   # the timeout
        raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *args], status, stdout, stderr)


def python_shim(folder: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """An executable in ``folder`` that runs ``python ARGS`` through this process's server, and
    the environment a command started with it needs (the server's socket and the shim's path:
    the children it starts as ``[sys.executable, ...]`` go through the shim as well). Without
    that environment the shim runs the real interpreter."""
    shim = Path(folder) / "python"
    shim.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(HERE)!r})\n"
                    f"import forked\nforked.shim_main({sys.executable!r})\n")
    shim.chmod(0o700)
    return str(shim), {SOCKET_ENV: server_socket(), SHIM_ENV: str(shim)}


def shim_main(python: str) -> None:
    """The shim: this process's arguments, environment, folder and standard streams to the
    server; its child's exit status as ours (a signal that ended the child ends us too)."""
    path = os.environ.get(SOCKET_ENV)
    if not path or not os.path.exists(path):
        os.execv(python, [python, *sys.argv[1:]])
    status = forked(path, sys.argv[1:], dict(os.environ), os.getcwd(), None, (0, 1, 2))
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)
