"""GPU profiles: one training step of each benchmark case recorded on a real GPU, kept as files.

A profile is ``ooc.trace(..., device="cuda", measure=True)``'s variable sequence: every aten op
of forward, backward and optimizer step, the storages each one uses, and its device time
between two CUDA events. With it, ``ooc plan`` and ``ooc simulate`` predict the GPU step on
any machine (planning needs no GPU). Its ``meta`` says where it was recorded: GPU, torch,
CUDA, commit, the link's measured bandwidth, and the in-core step time measured beside it.

    python benchmarks/gpu_profiles.py [--quick] [--out DIR]     # on a GPU machine

writes ``DIR/<case>.json`` (default ``benchmarks/profiles/``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402
import gpu_cases  # noqa: E402
from gpu_cases import FULL, QUICK, GpuCase  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles"


class _Autocast(nn.Module):
    """The model's forward under the case's autocast (the trace sees the casts it makes)."""

    def __init__(self, inner: nn.Module, case: GpuCase) -> None:
        super().__init__()
        self.inner, self._case = inner, case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._case.autocast():
            return self.inner(x)


def record(case: GpuCase, out_dir: Path, extra_meta: dict[str, Any] | None = None) -> Path:
    """Trace one step of ``case`` on the GPU with device op times; write ``<case>.json``."""
    import ooc

    model, x, y, loss_fn = case.build()
    net = _Autocast(model, case) if case.amp is not None else model
    torch.manual_seed(1)
    with case.attention():
        seq = ooc.trace(net, x, y, loss_fn=loss_fn, optimizer=case.optimizer_for, device=gpu_cases.DEVICE,
                        measure=True, name=case.name)
    props = torch.cuda.get_device_properties(0)
    seq.meta.update({
        "case": case.name, "label": case.label, "gpu": props.name,
        "gpu_memory_bytes": props.total_memory, "cuda": torch.version.cuda,
        "commit": common.git_commit(), "date": common.machine_info()["date"],
        "amp": str(case.amp).replace("torch.", "") if case.amp is not None else None,
        "op_seconds_by": "CUDA events around each op, read after the step",
        **(extra_meta or {})})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{case.name}.json"
    seq.to_json(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the quick cases (a smoke, not profiles)")
    p.add_argument("--out", type=Path, default=PROFILES, help="directory (default benchmarks/profiles)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: a profile needs a GPU", file=sys.stderr)
        return 0
    for case in QUICK if args.quick else FULL:
        print(record(case, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
