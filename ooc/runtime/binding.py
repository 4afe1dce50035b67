"""Binding a step's storages to the plan's variables: a variable born in the step gets its
slot when the op that creates it runs (``_bind_born``), and an activation's storage the
engine let go of is taken back when an op writes into it in place (``_take_back``)."""

from __future__ import annotations

import torch

from ooc.runtime.slots import Slot, State
from scheduler.ir import Kind


class Binding:
    """The ``Stepper``'s binding of storages to slots (a mixin; no state of its own)."""

    def _bind_born(self, var: int, s: torch.UntypedStorage, nbytes: int, i: int) -> None:
        v = self.schedule.sequence.variables[var]
        planned_bytes = -(-nbytes // self.ctx.chunk) * self.ctx.chunk if v.kind is Kind.ACTIVATION else nbytes
        if planned_bytes != v.nbytes:   # same ops, other shapes (a new batch size)
            self._diverge(i, f"op {i} created {nbytes} B where the plan has {v.name} of {v.nbytes} B")
            return
        slot = Slot(var, v.kind, nbytes, v.name, in_place=v.kind is not Kind.ACTIVATION,
                    state=State.RESIDENT, storage=s)
        self._account(nbytes)
        self._register(slot)
        b = self.rec.live_birth(s)
        if b is not None:   # recorded too, in case the step diverges later and is re-planned
            self.rec.promote(b, var, v.kind, v.name)

    def _take_back(self, slot: Slot, s: torch.UntypedStorage, i: int) -> None:
        """Op ``i`` writes in place into the storage activation ``slot`` was born in, after the
        engine let go of it (wrote it out; maybe read a copy back into the pool). The forward
        still holds that storage (ResNet's ``out += identity; relu_(out)`` before autograd
        saves ``out``), so the op's bytes land there, not in the engine's copies: the slot
        takes the storage back, drops its copy in memory (same bytes until now) and forgets
        the tier's, which goes stale. Else unpack hands the backward the pre-write bytes."""
        if slot.storage is s and slot.state is not State.OUT:
            return   # the storage appears twice among the op's arguments
        if slot.state is State.OUT:   # its copy is being written out (ensure leaves that to run)
            self._timed("wait", f"wait_out {slot.name}", slot.finish_swap_out)
        slot.take_back(s, self.ctx.tier)   # counted as resident already: it replaces the copy, or the copy in flight
        self._register(slot)
