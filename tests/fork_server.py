"""Runs ``python -c CODE ARGS``, ``python -m MODULE ARGS`` and ``python SCRIPT ARGS`` for the
tests without a fresh interpreter each: this process imports torch (and ``torch._dynamo``,
which the first optimizer imports) once, then forks a child per request. A fresh interpreter
pays ~3-5 s for torch and ~2 s for the first optimizer on a 2-core machine before it runs a
line of the test's child; the tests that run a case in a child do so to isolate what is
process-wide (a crash, the CPU allocator, glibc's thresholds, signals), which a forked child
isolates as well. ooc itself is not imported here: a child imports it, under its own
environment, as a fresh process would.

Nothing here runs a kernel or starts a thread pool before a fork, so a child's thread pools
start as in a fresh process; environment variables read when a library loads are the
server's, but for OMP_NUM_THREADS, which a child's environment sets as it would in a fresh
process (``torch.set_num_threads``).

``python fork_server.py SOCKET``: listens on the Unix socket SOCKET and serves its clients at
once, each in a child of its own (a benchmark's cases run beside each other, and a child may
itself ask for children: ``python_shim``). A request: an 8-byte length with the caller's
stdin, stdout and stderr as passed descriptors, then that many bytes of JSON ``{"argv": [...],
"env": {...}, "cwd": str, "timeout": seconds}``, ``argv`` being what follows ``python`` on a
command line. The child runs with those descriptors as its 0, 1 and 2; as it ends, one line
back, ``{"pid": int, "status": int}`` (the exit code, or minus the signal that ended it: -14,
SIGALRM, when it ran past ``timeout``). A client that goes away first takes its child with it
(SIGKILL), as a killed ``python`` would be gone; the server ends when its stdin closes (the
process that started it is gone).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Callable

import torch  # noqa: F401  (imported once, for every child)
import torch._dynamo  # noqa: F401  (what the first optimizer would import)

SHIM_ENV = "OOC_FORK_SHIM"   # in a request's env: the child's sys.executable (its own children forked too)


def _child(request: dict, fds: list[int]) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None                          # found again from TMPDIR, as on a fresh start
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for fd, given in zip((0, 1, 2), fds):             # the caller's stdin, stdout and stderr
        os.dup2(given, fd)
        os.close(given)
    if request.get("timeout"):
        signal.alarm(int(request["timeout"]))        # SIGALRM's default action ends the child
    sys.executable = os.environ.get(SHIM_ENV) or sys.executable
    argv = request["argv"]
    # sys.path as a fresh `python` would start it: the script's folder (the working folder for
    # -m, '' for -c), then PYTHONPATH, then the installation's own entries.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.abspath(argv[0])))
    sys.path[:] = [first] + extra + BASE_PATH

    def run() -> None:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")

    return exit_status(run)


def exit_status(run: Callable[[], int | None]) -> int:
    """What ``python`` would exit with after ``run()``: its SystemExit's code, 1 (and the
    traceback on stderr) for any other exception, else ``run()``'s value or 0."""
    try:
        return run() or 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _received(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size, body = int.from_bytes(head, "little"), b""
    while len(body) < size:
        part = conn.recv(size - len(body))
        if not part:
            raise ConnectionError("the client left mid-request")
        body += part
    return json.loads(body), list(fds)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}   # child's pid -> its client's connection
    while True:
        waiting = {conn.fileno(): pid for pid, conn in clients.items()}
        readable, _, _ = select.select([listener, sys.stdin, *clients.values()], [], [], 0.05)
        for ready in readable:
            if ready is sys.stdin and not sys.stdin.buffer.read1(1 << 16):
                return                                # the starter is gone: so are we
            if ready is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _received(conn)
                except (ConnectionError, OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in clients.values():
                        other.close()
                    conn.close()
                    _ended(_child(request, fds))
                for fd in fds:
                    os.close(fd)
                clients[pid] = conn
            elif isinstance(ready, socket.socket) and ready.fileno() in waiting:
                pid = waiting[ready.fileno()]    # a client readable before its answer: it left
                if not ready.recv(1):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall((json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
                except OSError:
                    pass
                conn.close()


def _ended(code: int) -> None:
    """What an interpreter does as it ends: join the threads that are not daemons, run the exit
    functions (weakref.finalize's among them: a swap file's cleanup)... but not the server's
    buffers, nor its exit, a second time."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# The installation's sys.path entries, without this folder and without PYTHONPATH's.
BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]

if __name__ == "__main__":
    serve(sys.argv[1])
