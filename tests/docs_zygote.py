"""Runs the documentation's examples for tests/test_docs.py: imports torch, ooc and what the
first optimizer imports (torch._dynamo, through tests/fork_server.py) once, then forks a fresh
child per example, so that no example pays the imports (~5 s each on a 2-core machine) and
none sees what another left in the process.

Requests on stdin, one JSON object a line, read until stdin closes: ``{"id": str, "code":
str | None, "ooc": [[arg, ...], ...], "cwd": str, "timeout": seconds, "ranks": int}``, run
``argv[1]`` children at a time (default 1). Each answer, one line on stdout as its request
ends: ``{"id": str, "status": int, "seconds": float}`` (status: the first non-zero exit code
of its children, or minus the signal that ended one: -14, SIGALRM, when it ran past
``timeout``).

A child runs in ``cwd``, which is also its TMPDIR (swap directories, checkpoints, Trainer
output stay there), with its stdout and stderr in ``cwd/output.txt``; ``code`` runs as a
script (``__name__ == "__main__"``) in a fresh namespace, then each ``ooc`` argument list
through ``ooc.cli.main``, as the ``ooc`` command would, stopping at the first that fails.
With ``ranks`` N > 1, N children run the code at once with the environment ``torchrun
--nproc-per-node N`` gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...),
rank r's output in ``cwd/output-r.txt``. Nothing here has run a kernel on more than one
thread before a fork (imports only), so a child's thread pools start as in a fresh process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ooc

import torch  # noqa: E402,F401  (imported once, for every child)
from fork_server import exit_status  # noqa: E402  (and torch._dynamo, which a first optimizer imports)

import ooc  # noqa: E402
import ooc.cli  # noqa: E402


def _child(request: dict, rank: int | None, env: dict[str, str]) -> int:
    os.chdir(request["cwd"])
    os.environ.update(env)
    os.environ["TMPDIR"] = tempfile.tempdir = request["cwd"]
    out = os.open("output.txt" if rank is None else f"output-{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # the zygote's requests are not the child's
    signal.alarm(int(request["timeout"]))          # SIGALRM's default action ends the child

    def run() -> int:
        if request.get("code"):
            exec(compile(request["code"], "example.py", "exec"), {"__name__": "__main__"})
        for argv in request.get("ooc") or ():
            print("$ ooc " + " ".join(argv), flush=True)
            status = ooc.cli.main(argv)
            if status:
                return status
        return 0

    return exit_status(run)


def _rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun --standalone --nproc-per-node RANKS tells worker RANK."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """Read every request (until stdin closes), run them ``argv[1]`` children at a time (one by
    default; a request's ranks count each), answer each as it ends."""
    parallel = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    waiting = [json.loads(line) for line in sys.stdin]
    running: dict[int, tuple[dict, float]] = {}        # pid -> (request, start)
    groups: dict[str, list[int]] = {}                  # request id -> exit codes so far
    while waiting or running:
        while waiting and (not running or len(running) + waiting[0].get("ranks", 1) <= parallel):
            request = waiting.pop(0)
            ranks = request.get("ranks", 1)
            port = _free_port() if ranks > 1 else 0
            groups[request["id"]] = []
            for rank in range(ranks):
                pid = os.fork()
                if pid == 0:
                    os._exit(_child(request, None if ranks == 1 else rank,
                                    _rank_env(rank, ranks, port) if ranks > 1 else {}))
                running[pid] = (request, time.perf_counter())
        pid, status = os.wait()
        request, start = running.pop(pid)
        codes = groups[request["id"]]
        codes.append(os.waitstatus_to_exitcode(status))
        if len(codes) == request.get("ranks", 1):
            print(json.dumps({"id": request["id"], "status": next((c for c in codes if c), 0),
                              "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
