"""What every part of a step shares, each in one small object the parts are given.

- ``Course``: whether the step still follows its plan, where it left it, and the op it is at.
  The ``Stepper`` alone changes it (``Stepper._diverge``); the parts read it.
- ``StepBook``: the step's managed slots, the device bytes they hold as the plan counts them
  (``resident``, ``peak``, an on-demand ``overflow``), and its timeline (``events``,
  ``stall_s``): what the plan executor, the on-demand room, recomputation and the binding
  all count into.

Neither refers to a part or to the ``Stepper``: the parts hold them, never the reverse, so a
finished step is garbage as soon as the engine lets go of it (no reference cycle:
``tests/ooc/test_step_garbage.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ooc.record.managed import Recording
from ooc.runtime.slots import Slot
from ooc.runtime.step_context import StepContext
from ooc.runtime.step_protocol import waited
from scheduler.actions import Refused
from scheduler.schedule import Schedule
from scheduler.widening import sizes_vary
from vmm.errors import OutOfBudget


class Course:
    """The step's course: ``schedule`` (None on demand), ``planned`` (still following it),
    ``diverged_at`` (the op where it stopped, None if it did not), ``refused`` (the plan
    action the transition table refused, if any), ``i`` (the op running or last run), the
    plan per op as lists the per-op path indexes (``names``, ``before``, ``after``),
    ``waiting``: the step waits for its shape (``Binding.wait_for_shape``), and ``widened``: the
    plan holds sizes that depend on the data (``scheduler/widening.py``: an activation is bound
    into its variable's room, at any size up to it; the hook traces are bounded)."""

    __slots__ = ("_rec", "after", "before", "bounded", "diverged_at", "i", "names", "planned", "refused",
                 "schedule", "waiting", "widened")

    def __init__(self, schedule: Schedule | None, rec: Recording) -> None:
        self.schedule = schedule
        self.planned = schedule is not None
        self.diverged_at: int | None = None
        self.refused: Refused | None = None
        self.i = 0
        functions = schedule.sequence.functions if schedule is not None else ()
        self.names = [f.name for f in functions]
        self.before = schedule.before if schedule is not None else ()
        self.after = schedule.after if schedule is not None else ()
        self.waiting = False
        self.widened = schedule is not None and sizes_vary(schedule.sequence)
        self.bounded = schedule is not None and bool(schedule.beside)
        self._rec = rec

    def bound(self, i: int, budget: int) -> int:
        """The most the managed tensors may hold at op ``i`` of a plan bounded by a step's budget
        less what the step holds beside it (``bounded``: ``Schedule.beside``); past its ops, and
        for any other plan, ``budget``."""
        return self.schedule.limit(i) if self.bounded and i < len(self.schedule.beside) else budget

    def name(self, i: int) -> str:
        """Op ``i``'s name, for messages: the plan's, else the recording's."""
        if i < len(self.names):
            return self.names[i]
        return self._rec.names[i] if i < len(self._rec.names) else "end of step"


class StepBook:
    """The step's slots (var -> ``Slot``, and by the id of their storage), the managed bytes
    they hold, and its timeline. Its own methods change them; every part counts here."""

    __slots__ = ("by_storage", "ctx", "events", "overflow", "peak", "resident", "slots", "stall_s")

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.slots: dict[int, Slot] = {}        # var -> slot
        self.by_storage: dict[int, Slot] = {}   # id(storage) -> slot, for this step
        self.resident = 0                       # managed device bytes, as the plan counts them
        self.peak = 0
        self.stall_s = 0.0
        self.events: list[tuple[str, str, float, float]] = []  # (track, name, t0, t1)
        self.overflow: OutOfBudget | None = None   # an on-demand need the pool could not meet

    def register(self, slot: Slot) -> None:
        self.slots[slot.var] = slot
        if slot.storage is not None:
            self.by_storage[id(slot.storage)] = slot

    def slot_of(self, t: torch.Tensor) -> Slot | None:
        """The slot of the storage ``t`` is a view of, if the step manages it."""
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # sparse: no storage, PyTorch's (see on_op)
            return None
        slot = self.by_storage.get(id(s))
        if slot is not None and slot.storage is not s:
            del self.by_storage[id(s)]   # a dead storage's id was reused
            return None
        return slot

    def account(self, delta: int) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)

    def wait(self, name: str, fn: Callable[..., None], *args) -> None:
        """Block on a transfer: stall, on the timeline (``step_protocol.waited``)."""
        waited(self, name, fn, *args)

    def write_out(self, slot: Slot) -> None:
        """Start writing ``slot`` to the tier, counted and on the timeline."""
        slot.start_swap_out(self.ctx.tier)
        self.trace_transfer(slot, "swap-out")
        self.ctx.counters["bytes_out"] += slot.nbytes

    def trace_transfer(self, slot: Slot, track: str) -> None:
        """Put the transfer on the timeline from issue to completion (the I/O threads do it,
        so only their completion callback knows when it ended)."""
        future = slot.future
        if future is None or not hasattr(future, "add_done_callback"):
            return
        t0, name, events = time.perf_counter(), f"{track} {slot.name}", self.events
        future.add_done_callback(lambda _: events.append((track, name, t0, time.perf_counter())))

    def forgive_overflow(self) -> OutOfBudget | None:
        """The on-demand overflow so far, forgotten: the engine decided it does not fail the
        step (a plan will keep later steps within the budget)."""
        overflow, self.overflow = self.overflow, None
        return overflow
