"""A step whose plan moves nothing runs as plain PyTorch, watched only by autograd's hooks.

Why: when the budget holds the whole step, the plan has no action at all, yet a planned step
still sends every aten op through the engine's ``TorchDispatchMode``. PyTorch's Python dispatch
alone costs 10-25 us per op (measured: +7% on a ResNet-18 step of 0.17 s at 32 px, more than
the 5% an engine that moves nothing may cost; benchmarks/results/overhead.md). So once a plan
that moves nothing has run once as planned, its later steps run without the mode:

- the guard is the saved-tensor pack hook (one Python call per saved tensor, not per op): the
  storages autograd saves, in order, must have the sizes the verified step saved
  (``Signature``). The activations are what the budget holds; if they are the same, so is the
  step's managed memory;
- a step that saves something else has diverged: from there on, every saved activation that
  would take the step's saved bytes over the budget is written to the slower tier at once and
  read back when the backward needs it (what an on-demand step does, without the mode), and
  the engine records and re-plans the next step;
- a step that fails before its update is rolled back as a planned one is: the buffers (BatchNorm
  statistics) are copied when the step starts, since no per-op path sees their first use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from ooc.runtime.hook_step import HookStep, Spilled
from ooc.storage.tier import SlowerTier
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)

# What a verified step saved, in order: (bytes of the storage, the op that saved it, whether
# it counts in the budget) of every saved tensor of at least ``min_bytes``: activations and
# inputs count, parameters (and views of them) do not (the budget is not theirs).
Signature = tuple[tuple[int, int, bool], ...]


def moves_nothing(schedule: Schedule) -> bool:
    """Whether ``schedule`` has nothing to do: no byte moved, none recomputed."""
    return not (schedule.bytes_in or schedule.bytes_out or schedule.bytes_recomputed)


class PlainStep(HookStep):
    """One step of a verified plan that moves nothing (the module docstring says why).

    The engine drives it as it drives a ``Stepper`` from its optimizer hooks
    (``close_node``, ``wait_for_transfers``, ``update_starts``, ``update_done``, ``schedule``,
    ``updating``), and reads ``diverged_at`` (the op of the plan where the saved tensors first
    differed, None if they did not), ``saved_bytes`` (the saved activations' bytes, an upper
    bound of their peak), ``spilled_bytes``, ``read_bytes``, ``stall_s`` and ``events`` at its end.
    """

    counter = "plain_steps"   # the engine's count of such steps

    def __init__(self, schedule: Schedule, signature: Signature, *, budget: int, min_bytes: int,
                 tier: SlowerTier, model: torch.nn.Module, new_key: Callable[[], int],
                 start_key: Any = None) -> None:
        super().__init__(model, budget, tier, new_key)
        self.schedule, self.start_key = schedule, start_key
        self.signature = signature
        self.min_bytes = min_bytes
        self.k = 0                 # saved tensors of at least min_bytes so far
        self.saved_bytes = 0       # their bytes (a saved storage counted at each save: an upper bound)

    # -- autograd's hooks --------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        try:
            nbytes = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):   # sparse: PyTorch's, as the planned step left it
            return t
        if nbytes < self.min_bytes:
            return t
        k = self.k
        self.k = k + 1
        if self.diverged_at is None:
            expected = self.signature[k][0] if k < len(self.signature) else None
            if expected == nbytes:
                return t
            self._diverge(k, f"saved tensor {k} has {nbytes} B, the plan's had "
                          f"{'none' if expected is None else f'{expected} B'}")
        return self._after_plan(t, nbytes)

    def unpack(self, p: Any) -> torch.Tensor:
        return self._read_spilled(p) if isinstance(p, Spilled) else p

    def _held(self) -> int:
        return self.saved_bytes

    def _hold(self, nbytes: int) -> None:
        self.saved_bytes += nbytes

    def _diverge(self, k: int, why: str) -> None:
        sig = self.signature
        self.diverged_at = sig[min(k, len(sig) - 1)][1] if sig else 0
        self.why = why
        # What was saved so far matched the plan, which fits the budget: count it from here.
        self.saved_bytes = sum(n for n, _, counted in sig[:k] if counted)

    def finish(self, failed: bool) -> None:
        """The step is over: a completed one that saved fewer tensors than the plan diverged
        too; the tier forgets what the step wrote (nothing reads it after the backward)."""
        if not failed and self.diverged_at is None and self.k != len(self.signature):
            self._diverge(self.k, f"{self.k} saved tensors of at least {format_size(self.min_bytes)}, "
                          f"the plan's step saved {len(self.signature)}")
        if self.diverged_at is None:   # as the plan's step: what it saved counts
            self.saved_bytes = sum(n for n, _, counted in self.signature if counted)
        self._forget_spilled()
        self.events.insert(0, ("compute", "plain step (no op intercepted)", self.t0, time.perf_counter()))

    # -- what the engine's optimizer hooks call ----------------------------------------------

    def close_node(self) -> None:
        """No backward node holds anything of the engine's: nothing to close."""

    def wait_for_transfers(self, drain: bool = True) -> None:
        """The commit point's wait: a plain step's writes are synchronous, none is in flight."""

    def update_starts(self) -> None:
        self.rollback.commit()
        self.updating = True

