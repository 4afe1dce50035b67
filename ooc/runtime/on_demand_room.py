"""On demand: keeping a step without a plan within the budget.

A step with no plan for the state it starts in (the recording step) or one that left its plan
(a divergence) keeps nothing it does not need: saved activations and gradients are written out
as soon as autograd saves or accumulates them, persistent tensors leave after each op, and
everything comes back synchronously at its use. Before anything becomes resident, room is
made: the victims are the scheduler's choice (``scheduler.on_demand.choose_victims``) among the
managed tensors the op does not use, least recently used first; this module carries the
choice out (waits, releases, writes). Only an op whose own tensors exceed the budget goes over
it, counted as such (``overflow``), and fails its step at the end.
"""

from __future__ import annotations

import logging

import torch

from ooc.record.managed import Birth
from ooc.record.storages import storage_of
from ooc.runtime.slots import Slot, State
from scheduler import on_demand
from scheduler.ir import Kind
from vmm.errors import OutOfBudget
from vmm.units import format_size

log = logging.getLogger(__name__)


class OnDemandRoom:
    """The ``Stepper``'s on-demand budget, and the adoption of the step's new managed storages,
    which on demand needs room first (a mixin over the step's slots and resident bytes).

    Its state (``_init_room``): ``recent``, what may hold managed memory, least recently used
    first (slots, and the optimizer's new storages of ``FreshStorages``); ``held``, the
    activations the running backward node unpacked (autograd holds them until it returns:
    never evicted); ``in_flight_out``, on-demand writes, oldest first; ``overflow``, an
    on-demand need the pool could not meet (the step fails with it at its end).
    """

    def _init_room(self, persistent: list[Slot]) -> None:
        self.recent: dict[Slot | Birth, None] = {}
        self.held: dict[Slot, None] = {}
        self.in_flight_out: list[Slot] = []
        self.overflow: OutOfBudget | None = None
        if not self.planned:   # the last registered leave first: a forward uses them in order
            for slot in reversed(persistent):
                if slot.state in (State.RESIDENT, State.IN, State.OUT):
                    self.recent[slot] = None

    def adopt(self, slot: Slot, what: str) -> None:
        """A storage of this step becomes managed (a saved activation, a gradient): count its
        bytes, after making room for them on demand."""
        if not self.planned:
            self._make_room_for(slot.nbytes, (), self.i, what)
            self._touch(slot)
        self._register(slot)
        self._account(slot.nbytes)

    def adopt_grad(self, slot: Slot) -> None:
        """A gradient autograd has finished accumulating becomes managed. On demand it is
        written out at once, like a saved activation: its next use is the optimizer step,
        after the rest of the backward, and keeping every gradient until then is what took
        on-demand steps over their budget."""
        self.adopt(slot, f"the gradient {slot.name}")
        if not self.planned:
            self._write_out(slot)
            self._reap_writes(block=False)

    def adopt_grad_of(self, grad: torch.Tensor, name: str) -> None:
        """A parameter's gradient autograd has finished accumulating (the engine's post-
        accumulate hook): manage it, if this step created its storage and nothing manages it."""
        s = storage_of(grad)
        if s is None:   # a sparse gradient (nn.Embedding(sparse=True)): left to PyTorch
            return
        b = self.rec.live_birth(s)
        if b is not None and b.var is None and self.slot_of(grad) is None:
            var = self.ctx.new_var()
            self.rec.promote(b, var, Kind.GRAD, f"{name}.grad")
            self.adopt_grad(Slot(var, Kind.GRAD, b.nbytes, f"{name}.grad", in_place=True,
                                 state=State.RESIDENT, storage=s))

    def _on_demand_after(self, touched: list[Slot]) -> None:
        """Keep nothing: persistent tensors leave after the op that used them."""
        for slot in dict.fromkeys(touched):
            if slot.in_place and slot.state is State.RESIDENT:
                if slot.host_current:
                    slot.drop(self.ctx.tier)
                    self._account(-slot.nbytes)
                else:
                    self._write_out(slot)
        self._reap_writes(block=False)

    def _write_out(self, slot: Slot) -> None:
        """On demand: start writing ``slot`` out; its bytes count until the write is reaped."""
        self._start_out(slot)
        self.ctx.counters["bytes_out"] += slot.nbytes
        self.in_flight_out.append(slot)

    def _reap_writes(self, block: bool) -> None:
        """Finish on-demand writes, oldest first; block while too many bytes are in flight."""
        limit = on_demand.in_flight_limit(self.ctx.budget)
        while self.in_flight_out:
            slot = self.in_flight_out[0]
            if slot.state is not State.OUT:
                self.in_flight_out.pop(0)
                continue
            in_flight = sum(s.nbytes for s in self.in_flight_out)
            if not (block or slot.future.done() or in_flight > limit):
                break
            self.in_flight_out.pop(0)
            self._timed("wait", f"wait_out {slot.name}", slot.finish_swap_out)
            self._account(-slot.nbytes)

    def writes_settled(self) -> None:
        """The engine waited for every transfer of the step (``OutOfCore._settle``): no
        on-demand write is in flight any more."""
        self.in_flight_out.clear()

    def _touch(self, x: Slot | Birth) -> None:
        """On demand: ``x`` was just used; eviction takes the least recently used first."""
        if not self.planned:
            self.recent.pop(x, None)
            self.recent[x] = None

    def _make_room_for(self, nbytes: int, keep: set | tuple, where: int, what: str) -> None:
        """On demand: make ``nbytes`` fit the budget before they become resident.

        If evicting everything that may go still leaves too little (op ``where``'s own
        tensors exceed the budget), the step carries on over the budget, counted as such
        (``peak``), and fails at its end with ``overflow`` or the plan's BudgetTooSmall: an
        unplanned step cannot take back an op half done, but it must not hide the excess.
        """
        if self._make_room(nbytes, keep):
            return
        why = (f"what it cannot do without already takes {format_size(self.resident)} "
               f"({self.resident} B: {self._kept_names()})" if self.resident else "alone it is larger")
        error = OutOfBudget(
            f"op {where} ({self._name(where)}): {what} ({format_size(nbytes)}, {nbytes} B) does "
            f"not fit the {format_size(self.ctx.budget)} budget: {why}; raise the budget to at "
            f"least {format_size(self.resident + nbytes)}")
        if self.overflow is None:
            log.warning("%s", error)
            self.overflow = error

    def _make_room(self, nbytes: int, keep: set | tuple) -> bool:
        """Evict until ``nbytes`` more fit the budget; False if they cannot.

        The victims are the scheduler's choice (``scheduler.on_demand.choose_victims``) among
        the managed tensors the op does not use (``keep``) and the running backward node does
        not hold (``held``), in the order ops last used them. Carrying it out: finished writes
        are reaped, a write in flight is waited for, a tensor the slower tier holds is
        released, any other is written out and waited for (the waits count as stall).
        """
        budget = self.ctx.budget
        if self.resident + nbytes <= budget:
            return True
        self._reap_writes(block=False)
        held = self.held
        victims = on_demand.choose_victims(self.recent, self.resident + nbytes - budget, self._evictable_bytes,
                                           lambda x: x in keep or x in held)
        for x in victims:
            del self.recent[x]
            if isinstance(x, Birth):
                self._evict_fresh(x)
            else:
                self._evict(x)
        return self.resident + nbytes <= budget

    def _evictable_bytes(self, x: Slot | Birth) -> int:
        """The bytes evicting ``x`` gives back (0 for an entry already gone)."""
        if isinstance(x, Birth):
            return x.nbytes if x in self.fresh else 0
        return x.nbytes if x.state in (State.RESIDENT, State.IN, State.OUT) else 0

    def _evict(self, slot: Slot) -> None:
        """Give a slot's memory back: wait for its write in flight, release it if the slower
        tier holds its bytes, else write it out and wait."""
        if slot.state is State.IN:
            self._timed("wait", f"swap_in {slot.name}", slot.finish_swap_in)
        if slot.state is State.RESIDENT and slot.host_current:
            slot.drop(self.ctx.tier)
            self._account(-slot.nbytes)
            return
        if slot.state is State.RESIDENT:
            self._start_out(slot)
            self.ctx.counters["bytes_out"] += slot.nbytes
        if slot.state is State.OUT:
            self._timed("wait", f"evict {slot.name}", slot.finish_swap_out)
            self._account(-slot.nbytes)

    def _kept_names(self) -> str:
        """What stayed resident after evicting all that could go, for an overflow message."""
        names = [x.name if isinstance(x, Slot) else f"{self.rec.names[x.op]}#{x.op}"
                 for x in self.recent if self._evictable_bytes(x)]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    def forgive_overflow(self) -> OutOfBudget | None:
        """The on-demand overflow so far, forgotten: the engine decided it does not fail the
        step (a plan will keep later steps within the budget)."""
        overflow, self.overflow = self.overflow, None
        return overflow
