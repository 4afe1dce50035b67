"""What a step watched only by autograd's saved-tensor hooks holds, whether its plan moves
nothing (``plain_step.py``) or swaps at the hooks (``anchored_step.py``): no per-op path sees a
buffer's first use, so a rollback copies every buffer when the step starts."""

from __future__ import annotations

import time
from typing import Any

import torch

from ooc.runtime.rollback import StepRollback


class HookStep:
    """The state the engine reads at a hook-driven step's end: ``diverged_at`` (None if it kept
    to its plan) and ``why``, ``spilled_bytes`` and ``read_bytes`` (to and from the tier),
    ``stall_s``, ``events``, ``rollback``; ``updating`` inside ``optimizer.step()``."""

    planned = True
    refused = None   # no per-op action runs, so the transition table refuses none here

    def __init__(self, model: torch.nn.Module) -> None:
        self.diverged_at: int | None = None
        self.why = ""
        self.spilled_bytes = self.read_bytes = 0
        self.stall_s = 0.0
        self.updating = False
        self.events: list[tuple[str, str, float, float]] = []
        self.t0 = time.perf_counter()
        self.rollback = StepRollback(model)
        for key in self.rollback.buffers:   # no per-op path sees a buffer's first use: copy all now
            self.rollback.save_before_write(key)

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def unpack(self, p: Any) -> torch.Tensor:
        raise NotImplementedError

    def update_done(self) -> None:
        self.updating = False
