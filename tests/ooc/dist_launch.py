"""Start ``dist_worker.py`` on N ranks as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT on a free port), with a hard timeout: a hang kills every rank and fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(configs: list[dict], out: Path, *, world: int = 2, timeout: float = 120,
           device: str = "cpu") -> list[list[dict]]:
    """Run the configs on ``world`` ranks (``device="cuda"``: one GPU each, nccl); return each
    rank's results. Raises on a hang, a crash or a non-zero exit, with every rank's stderr."""
    env = dict(os.environ, WORLD_SIZE=str(world), OOC_DIST_DEVICE=device, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for rank in range(world):
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "dist_worker.py"), "--configs", json.dumps(configs), "--out", str(out)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    logs, hung = [], False
    verbose = bool(os.environ.get("OOC_DIST_VERBOSE"))   # every rank's whole stderr
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for q in procs:   # every rank: one hung rank blocks the others in a collective
                q.kill()
            o, e = p.communicate()
        logs.append(f"--- rank {len(logs)} rc={p.returncode}\n{o[-3000:]}\n{e if verbose else e[-6000:]}")
    if verbose:
        print("\n".join(logs), file=sys.stderr)
    if hung or any(p.returncode for p in procs):
        raise AssertionError(("ranks hung past %.0f s\n" % timeout if hung else "a rank failed\n")
                             + "\n".join(logs))
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


if __name__ == "__main__":   # python tests/ooc/dist_launch.py '[{...}]'
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for rank, res in enumerate(launch(json.loads(sys.argv[1]), Path(d) / "r",
                                          timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 300)):
            for r in res:
                print(json.dumps(r))
