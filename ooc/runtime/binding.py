"""Binding a step's storages to the plan's variables: a variable born in the step gets its
slot when the op that creates it runs (``bind``), and an activation's storage the engine let
go of is taken back when an op writes into it in place (``take_back``).

A step whose start has plans for several shapes waits for its shape (``wait_for_shape``):
the ops it runs before its model's forward (the batch made inside the step: ``x.to(device)``,
``x.float() / 255``, an augmentation) are neither checked against a plan nor bound, and the
storages they make are bound when the forward shows which plan is the step's
(``bind_born``). Bound to the guess at once, a batch of another size left the guess at its
first op (its size is not the plan's), or its storages had slots of the wrong plan and the step
could not take the right one: with batches of three sizes in a shuffled order made inside the
step, 16 of 24 steps left their plan and were planned from again (``test_variable_shapes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ooc.record.managed import Recording
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from scheduler.ir import Kind
from scheduler.schedule import Schedule


class Binding:
    """The step's binding of storages to slots. Its state: ``vars``, (op, output) -> the
    plan's variable born there (the engine's, made with the plan). In a plan whose sizes vary
    (``Course.widened``) an activation may be bound smaller than its variable, also under the
    threshold for managed tensors."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, rec: Recording,
                 vars: dict[tuple[int, int], int]) -> None:
        self.ctx, self.book, self.course, self.rec = ctx, book, course, rec
        self.vars = vars
        self._waiting: dict[tuple[int, int], int] = {}   # the plan's binding while the step waits

    def wait_for_shape(self) -> None:
        """Until ``end_wait``: no op checked against the plan, no action, nothing bound."""
        course = self.course
        course.waiting, course.before, course.after = True, (), ()
        self._waiting, self.vars = self.vars, {}

    def end_wait(self, act: Callable[[int, str], None]) -> str | None:
        """The step runs this plan after all: it must begin with the ops the step ran; then
        they are caught up with (``bind_born``). Returns why not."""
        course, names = self.course, self.rec.names
        course.waiting, self.vars = False, self._waiting
        schedule = course.schedule
        course.before, course.after = schedule.before, schedule.after
        if not begins_with(schedule, names):
            return f"the plan does not begin with the {len(names)} op(s) the step ran before its forward"
        return self.bind_born(act)

    def bind_born(self, act: Callable[[int, str], None]) -> str | None:
        """Catch up with the ops the step ran before it knew this plan (it waited for its
        shape, or another plan's step ran them: ``Stepper.resume``), in the plan's order: for
        each, the plan's actions before it (``act(j, "before")``), the storages it made bound
        to the variables born there, the actions after it. The ops used no managed tensor
        (``Stepper.quiet``): the actions (the first weights' swap-ins, every kind managed) had
        nothing to wait for. Returns why a storage cannot be bound (``bind``)."""
        born: dict[int, list] = {}
        for b in self.rec.births.values():
            if b.var is None and not b.ref.expired():
                born.setdefault(b.op, []).append(b)
        for j in range(len(self.rec.names)):
            act(j, "before")
            for b in born.get(j, ()):
                var = self.vars.get((b.op, b.out))
                why = None if var is None else self.bind(
                    var, torch.UntypedStorage._new_with_weak_ptr(b.ref.cdata), b.nbytes, b.op)
                if why is not None:
                    return why
            act(j, "after")
        return None

    def bind(self, var: int, s: torch.UntypedStorage, nbytes: int, i: int) -> str | None:
        """Storage ``s``, output of op ``i``, is the plan's ``var``: its slot, resident. Returns
        why not (the step diverges): its size is not the plan's, unless it is a smaller
        activation of a plan whose sizes depend on the data (it holds each at the largest its
        op made, ``scheduler/widening.py``: a smaller one runs in that room; a plan made from
        one step stays exact, so that a step of another shape leaves it and is planned as
        it is). An empty activation (a mask that kept nothing, an expert given no token) runs
        in any room: its slot moves no byte."""
        v = self.course.schedule.sequence.variables[var]
        chunk = self.ctx.chunk
        planned_bytes = -(-nbytes // chunk) * chunk if v.kind is Kind.ACTIVATION else nbytes
        if planned_bytes != v.nbytes and not (planned_bytes < v.nbytes and v.kind is Kind.ACTIVATION
                                              and (self.course.widened or not nbytes)):
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
            self.book.wait(f"wait_out {slot.name}", slot.finish_swap_out)
        slot.take_back(s, self.ctx.tier)   # counted as resident already: it replaces the copy, or the copy in flight
        self.book.register(slot)


def begins_with(schedule: Schedule, names: Sequence[str]) -> bool:
    """Whether ``schedule``'s first ops are ``names`` (their actions are caught up with:
    ``Binding.bind_born``)."""
    functions = schedule.sequence.functions
    return len(functions) >= len(names) and all(functions[j].name == name for j, name in enumerate(names))
