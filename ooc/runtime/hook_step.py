"""What a step watched only by autograd's saved-tensor hooks holds (``anchored_step.py``, whose
plan swaps at the hooks or moves nothing): no per-op path sees a buffer's first use, so a
rollback copies every buffer when the step starts; and once the step has left its plan, what
it saves beyond the budget is written to the slower tier at once and read back when the
backward needs it (what an on-demand step does, without the per-op path)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ooc.runtime.rollback import StepRollback
from ooc.runtime.saved_tensors import _of_parameter, unlinked
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_protocol import waited
from ooc.runtime.views import View
from ooc.storage.tier import SlowerTier
from scheduler.ir import Kind
from scheduler.step_plans import keeps_saved
from vmm.units import format_size


class Spilled:
    """A saved activation that a diverged step wrote to the tier: its slot (on the tier), and
    its view."""

    __slots__ = ("slot", "device", "view")

    def __init__(self, slot: Slot, t: torch.Tensor) -> None:
        self.slot, self.device, self.view = slot, t.device, View.of(t)


class _TorchMemory:
    """Where a spilled activation comes back: PyTorch's allocator, as where it was made (the
    step left its plan, and the pool's room is the plan's: ``RangeSource``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def take(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class HookStep:
    """The state the engine reads at a hook-driven step's end: ``diverged_at`` (None if it kept
    to its plan) and ``why`` (``sizes_differed``: a save where the trace has one, of other
    bytes: ``scheduler/widening.py``), ``spilled_bytes`` and ``read_bytes`` (to and from the tier),
    ``stall_s``, ``events``, ``rollback``; ``updating`` inside ``optimizer.step()``."""

    refused = None   # no per-op action runs, so the transition table refuses none here

    def __init__(self, model: torch.nn.Module, budget: int, tier: SlowerTier) -> None:
        self.budget, self.tier = budget, tier
        self.spilled: list[Slot] = []   # what the step spilled (on the tier until the step ends)
        self.diverged_at: int | None = None
        self.why = ""
        self.sizes_differed = False
        self.spilled_bytes = self.read_bytes = 0
        self.stall_s = 0.0
        self.updating = False
        self.events: list[tuple[str, str, float, float]] = []
        self.t0 = time.perf_counter()
        self.rollback = StepRollback(model, copy_all=True)   # no per-op path sees a buffer's first use

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def unpack(self, p: Any) -> torch.Tensor:
        raise NotImplementedError

    def update_done(self) -> None:
        self.updating = False

    # -- after the plan: the saved tensors over the budget go to the tier ---------------------

    def _after_plan(self, t: torch.Tensor, nbytes: int) -> Any:
        """A save the plan does not know (the step left it): kept while the step's bytes stay
        within the budget, else written to the tier at once. Parameters are not the budget's."""
        if _of_parameter(t) or t.is_meta:
            return unlinked(t, t)
        if not keeps_saved(self._held(), nbytes, self.budget):   # the scheduler's rule
            return self._spill(t, nbytes)
        self._hold(nbytes)
        return unlinked(t, t)

    def _held(self) -> int:
        """The bytes the step counts as held now (the budget's)."""
        raise NotImplementedError

    def _hold(self, nbytes: int) -> None:
        """Count a save ``_after_plan`` kept."""
        raise NotImplementedError

    def _spill(self, t: torch.Tensor, nbytes: int) -> Spilled:
        """Write a saved activation of a diverged step to the tier (its slot's ``to_tier``);
        autograd keeps only where."""
        slot = Slot(-1 - len(self.spilled), Kind.ACTIVATION, nbytes, f"saved tensor {len(self.spilled)}",
                    in_place=False, state=State.RESIDENT, storage=t.untyped_storage())
        waited(self, f"write out saved tensor ({format_size(nbytes)})", slot.to_tier, self.tier)
        self.spilled.append(slot)
        self.spilled_bytes += nbytes
        return Spilled(slot, t)

    def _read_spilled(self, p: Spilled) -> torch.Tensor:
        """Read back what ``_spill`` wrote, synchronously: the backward's node needs it now
        (into PyTorch's memory, where the step made it; the tier keeps its copy until the
        step's end, as another unpack of it may come)."""
        slot = p.slot
        if slot.state is not State.RESIDENT:
            self.read_bytes += slot.bring_back(self.tier, _TorchMemory(p.device),
                                               wait=lambda name, fn: waited(self, f"read back {name}", fn))
        out = p.view.on(slot.storage)
        slot.drop(self.tier)   # the tensor holds the bytes now; the slot, the tier's copy
        return out

    def _forget_spilled(self) -> None:
        """The step is over: nothing reads what it spilled again."""
        for slot in self.spilled:
            slot.forget_copy(self.tier)
        self.spilled.clear()
