"""Binding a step's storages to the plan's variables: a variable born in the step gets its
slot when the op that creates it runs (``bind``), and an activation's storage the engine let
go of is taken back when an op writes into it in place (``take_back``)."""

from __future__ import annotations

import torch

from ooc.record.managed import Recording
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from scheduler.ir import Kind


class Binding:
    """The step's binding of storages to slots. Its state: ``vars``, (op, output) -> the
    plan's variable born there (the engine's, made with the plan)."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, rec: Recording,
                 vars: dict[tuple[int, int], int]) -> None:
        self.ctx, self.book, self.course, self.rec = ctx, book, course, rec
        self.vars = vars

    def bind(self, var: int, s: torch.UntypedStorage, nbytes: int, i: int) -> str | None:
        """Storage ``s``, output of op ``i``, is the plan's ``var``: its slot, resident. Returns
        why not, if its size is not the plan's (the step diverges)."""
        v = self.course.schedule.sequence.variables[var]
        chunk = self.ctx.chunk
        planned_bytes = -(-nbytes // chunk) * chunk if v.kind is Kind.ACTIVATION else nbytes
        if planned_bytes != v.nbytes:   # same ops, other shapes (a new batch size)
            return f"op {i} created {nbytes} B where the plan has {v.name} of {v.nbytes} B"
        slot = Slot(var, v.kind, nbytes, v.name, in_place=v.kind is not Kind.ACTIVATION,
                    state=State.RESIDENT, storage=s)
        self.book.account(nbytes)
        self.book.register(slot)
        b = self.rec.live_birth(s)
        if b is not None:   # recorded too, in case the step diverges later and is re-planned
            self.rec.promote(b, var, v.kind, v.name)
        return None

    def take_back(self, slot: Slot, s: torch.UntypedStorage) -> None:
        """An op writes in place into the storage activation ``slot`` was born in, after the
        engine let go of it (wrote it out; maybe read a copy back into the pool). The forward
        still holds that storage (ResNet's ``out += identity; relu_(out)`` before autograd
        saves ``out``), so the op's bytes land there, not in the engine's copies: the slot
        takes the storage back, drops its copy in memory (same bytes until now) and forgets
        the tier's, which goes stale. Else unpack hands the backward the pre-write bytes."""
        if slot.storage is s and slot.state is not State.OUT:
            return   # the storage appears twice among the op's arguments
        if slot.state is State.OUT:   # its copy is being written out (ensure leaves that to run)
            self.book.timed("wait", f"wait_out {slot.name}", slot.finish_swap_out)
        slot.take_back(s, self.ctx.tier)   # counted as resident already: it replaces the copy, or the copy in flight
        self.book.register(slot)
