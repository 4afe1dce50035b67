"""Runs ``python -c CODE ARGS`` and ``python SCRIPT ARGS`` for the tests without a fresh
interpreter each: this process imports torch (and ``torch._dynamo``, which the first optimizer
imports) once, then forks a child per request. A fresh interpreter pays ~3 s for torch and
~2 s for the first optimizer on a 2-core machine before it runs a line of the test's child;
the tests that run a case in a child do so to isolate what is process-wide (a crash, the CPU
allocator, glibc's thresholds, signals), which a forked child isolates as well. ooc itself is
not imported here: a child imports it, under its own environment, as a fresh process would.

Nothing here runs a kernel or starts a thread pool before a fork, so a child's thread pools
start as in a fresh process; environment variables read when a library loads (OMP_NUM_THREADS)
are the server's, so a child that needs another thread count says so with
``torch.set_num_threads``, as the tests' children already do.

Requests on stdin, one JSON object a line: ``{"argv": [...], "env": {...}, "cwd": str,
"timeout": seconds, "stdout": path, "stderr": path}``, where ``argv`` is what follows
``python`` on a command line (``["-c", code, *args]`` or ``[script, *args]``). One child at a
time; as it ends, one line on stdout: ``{"pid": int, "status": int}`` (the exit code, or minus
the signal that ended it: -14, SIGALRM, when it ran past ``timeout``).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import traceback
from typing import Callable

import torch  # noqa: F401  (imported once, for every child)
import torch._dynamo  # noqa: F401  (what the first optimizer would import)


def _child(request: dict) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None                          # found again from TMPDIR, as on a fresh start
    # stdin: not the server's requests; stdout and stderr: the caller's files (0600)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    signal.alarm(int(request["timeout"]))            # SIGALRM's default action ends the child
    argv = request["argv"]
    # sys.path as a fresh `python` would start it: the script's folder (or '' for -c), then
    # PYTHONPATH, then the installation's own entries.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["" if argv[0] == "-c" else os.path.dirname(os.path.abspath(argv[0]))] + extra + BASE_PATH

    def run() -> None:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = _child(request)
            # What an interpreter does as it ends: join the threads that are not daemons, run
            # the exit functions (weakref.finalize's among them: a swap file's cleanup)...
            try:
                threading._shutdown()
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)   # ...but not the server's buffers, nor its exit, a second time
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}), flush=True)


# The installation's sys.path entries, without this folder and without PYTHONPATH's.
BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]

if __name__ == "__main__":
    main()
