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
from collections.abc import Callable, Collection
from typing import Protocol

import torch

from ooc.host.malloc import give_back_heap
from ooc.record.managed import Birth, Recording
from ooc.record.storages import storage_of
from ooc.runtime.fresh_storages import FreshStorages
from ooc.runtime.overflow import pool_for
from ooc.runtime.given_back import freed_error, given_back_error
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from scheduler import on_demand
from scheduler.ir import Kind
from vmm.errors import OutOfBudget
from vmm.units import format_size

log = logging.getLogger(__name__)


class Recreates(Protocol):
    """What the room needs of recomputation (``recompute.Recomputation``): the chain a
    discarded variable was discarded for, and rerunning it."""

    discarded_for: dict[int, tuple[int, ...]]

    def recompute(self, slot: Slot, chain: tuple[int, ...], where: int, ensure: Callable[..., None]) -> None: ...


class OnDemandRoom:
    """A step's on-demand budget, and the adoption of the step's new managed storages, which
    on demand needs room first (over the step's ``StepBook``).

    Its state: ``recent``, what may hold managed memory, least recently used first (slots,
    and the optimizer's new storages of ``FreshStorages``); ``held``, the activations the
    running backward node unpacked (autograd holds them until it returns: never evicted);
    ``in_flight_out``, on-demand writes, oldest first. An on-demand need the pool could not
    meet is the book's ``overflow`` (the step fails with it at its end).
    """

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, rec: Recording,
                 fresh: FreshStorages, recompute: Recreates, persistent: list[Slot]) -> None:
        self.ctx, self.book, self.course, self.rec, self.fresh = ctx, book, course, rec, fresh
        self.recompute = recompute
        self.recent: dict[Slot | Birth, None] = {}
        self.held: dict[Slot, None] = {}
        self.in_flight_out: list[Slot] = []
        if not course.planned:   # the last registered leave first: a forward uses them in order
            for slot in reversed(persistent):
                if slot.state in (State.RESIDENT, State.IN, State.OUT):
                    self.recent[slot] = None

    def leave_plan(self) -> None:
        """The step left its plan: from here on it keeps only what it needs. Every slot that
        holds device memory is in the eviction order, and the saved activations the scheduler
        says so (``scheduler.on_demand.to_write_out_on_leaving``) are written out now."""
        slots = self.book.slots.values()
        self.recent = {s: None for s in slots if s.state in (State.RESIDENT, State.IN, State.OUT)}
        held = self.held
        for slot in on_demand.to_write_out_on_leaving(
                (s, not s.in_place, s.state is State.RESIDENT and not s.host_current, s in held) for s in slots):
            self.write_out(slot)

    def bring_back(self, slot: Slot, i: int, keep: set | tuple, ensure: Callable[..., None]) -> None:
        """On demand: make ``slot`` usable for op ``i`` now, within the budget, evicting nothing
        in ``keep``: read back from the tier (``Slot.bring_back``) or re-created by its chain
        (``ensure`` makes the chain's inputs usable in turn)."""
        if slot.given_back():
            raise given_back_error(slot, f"op {i} ({self.course.name(i)})")
        if slot.state is State.ABSENT and slot.storage is None:
            raise freed_error(slot, f"op {i} ({self.course.name(i)})")
        if slot.state is State.OUT and not slot.in_place:
            return  # the engine still holds the source: reading it while it is written is safe
        self.touch(slot)
        book = self.book
        if slot.state is State.DISCARDED:   # no copy anywhere: its chain re-creates it
            self.make_room_for(slot.nbytes, keep, i, f"recomputing {slot.name}")
            book.account(slot.nbytes)
            self.recompute.recompute(slot, self.recompute.discarded_for[slot.var], i, ensure)
            return

        def account(delta: int) -> None:   # room first, for what the read takes
            if delta > 0:
                self.make_room_for(delta, keep, i, f"swapping in {slot.name}")
            book.account(delta)

        self.ctx.counters["bytes_in"] += slot.bring_back(
            self.ctx.tier, pool_for(self.ctx, book, self.course, slot, i), wait=book.wait, account=account,
            started=lambda s: book.trace_transfer(s, "swap-in"))
        book.register(slot)

    def adopt(self, slot: Slot, what: str) -> None:
        """A storage of this step becomes managed (a saved activation, a gradient): count its
        bytes, after making room for them on demand."""
        if not self.course.planned:
            self.make_room_for(slot.nbytes, (), self.course.i, what, made=True)
            self.touch(slot)
        self.book.register(slot)
        self.book.account(slot.nbytes)

    def adopt_grad(self, slot: Slot) -> None:
        """A gradient autograd has finished accumulating becomes managed. On demand it is
        written out at once, like a saved activation: its next use is the optimizer step,
        after the rest of the backward, and keeping every gradient until then is what took
        on-demand steps over their budget."""
        self.adopt(slot, f"the gradient {slot.name}")
        if not self.course.planned:
            self.write_out(slot)
            self.reap_writes(block=False)

    def adopt_grad_of(self, grad: torch.Tensor, name: str) -> None:
        """A parameter's gradient autograd has finished accumulating (the engine's post-
        accumulate hook): manage it, if this step created its storage and nothing manages it."""
        s = storage_of(grad)
        if s is None:   # a sparse gradient (nn.Embedding(sparse=True)): left to PyTorch
            return
        b = self.rec.live_birth(s)
        if b is not None and b.var is None and self.book.slot_of(grad) is None:
            var = self.ctx.new_var()
            self.rec.promote(b, var, Kind.GRAD, f"{name}.grad")
            self.adopt_grad(Slot(var, Kind.GRAD, b.nbytes, f"{name}.grad", in_place=True,
                                 state=State.RESIDENT, storage=s))

    def after_op(self, touched: list[Slot]) -> None:
        """Keep nothing: persistent tensors leave after the op that used them. Under a budget
        for the whole step (``StepContext.device_live``), managed tensors also make way for
        what PyTorch's ops made (a gradient: no managed tensor comes with it to make room for;
        state brought back between steps sat beside the backward's gradients, 64 MiB over),
        and leave room for the next op's results as large as the step's largest so far: they
        exist before the op returns (a GPT-2's recording step went 7 MiB over its 112 MiB step
        budget inside the loss's backward, whose 19.5 MiB gradient came into a full room)."""
        for slot in dict.fromkeys(touched):
            if slot.in_place and slot.state is State.RESIDENT:
                if slot.host_current:
                    slot.drop(self.ctx.tier)
                    self.book.account(-slot.nbytes)
                else:
                    self.write_out(slot)
        self.reap_writes(block=False)
        if self.ctx.device_live is not None:
            self._make_room(0, (), self.rec.largest_birth)

    def write_out(self, slot: Slot) -> None:
        """On demand: start writing ``slot`` out; its bytes count until the write is reaped."""
        self.book.write_out(slot)
        self.in_flight_out.append(slot)

    def reap_writes(self, block: bool) -> None:
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
            self.book.wait(f"wait_out {slot.name}", slot.finish_swap_out)
            self.book.account(-slot.nbytes)

    def writes_settled(self) -> None:
        """The engine waited for every transfer of the step (``OutOfCore._settle``): no
        on-demand write is in flight any more."""
        self.in_flight_out.clear()

    def touch(self, x: Slot | Birth) -> None:
        """On demand: ``x`` was just used; eviction takes the least recently used first."""
        if not self.course.planned:
            self.recent.pop(x, None)
            self.recent[x] = None

    def hold(self, slot: Slot) -> None:
        """The running backward node unpacked ``slot``: autograd holds it until it returns."""
        self.held[slot] = None

    def release_held(self, keep: Collection[Slot] = ()) -> None:
        """The backward node returned. On demand its unpacked activations counted until now
        (autograd held them); their bytes go back, the slower tier keeps a copy. ``keep``:
        those something still holds, held on."""
        if not self.course.planned:
            for slot in self.held:
                if (slot.kind is Kind.ACTIVATION and slot.state is State.RESIDENT and slot.host_current
                        and slot not in keep):
                    slot.drop(self.ctx.tier)
                    self.book.account(-slot.nbytes)
        if keep:
            self.held = {slot: None for slot in self.held if slot in keep}
        else:   # (the usual close: no new dict per backward node)
            self.held.clear()

    def track_fresh(self, b: Birth, keep: set, i: int) -> Birth:
        """Count a storage the optimizer just created, after making room for it."""
        self.make_room_for(b.nbytes, keep, i, f"a new tensor of {self.rec.names[i]}", made=True)
        self.fresh.add(b)
        self.touch(b)
        return b

    def prune_fresh(self, updating: bool) -> None:
        """The optimizer's new storages that died leave the eviction order (and the budget),
        and, ``updating``, those it adopted that the program let go of (``FreshStorages.let_go``)."""
        for b in self.fresh.died():
            self.recent.pop(b, None)
        if updating:
            self.fresh.let_go(ended=False)

    def make_room_for(self, nbytes: int, keep: set | tuple, where: int, what: str, made: bool = False) -> None:
        """On demand: make ``nbytes`` fit the budget before they become resident (``made``:
        they are already, a storage the step just made that the engine now manages).

        If evicting everything that may go still leaves too little (op ``where``'s own
        tensors exceed the budget), the step carries on over the budget, counted as such
        (``peak``), and fails at its end with ``overflow`` or the plan's BudgetTooSmall: an
        unplanned step cannot take back an op half done, but it must not hide the excess.
        Under a budget for the whole step (``StepContext.device_live``) the device's bytes
        are kept within it too, as far as evicting managed tensors can: what PyTorch holds
        beyond that is the step's end's to refuse (``step_budget.share_of``), not an overflow.
        """
        if self._make_room(nbytes, keep, 0 if made else nbytes):
            return
        resident = self.book.resident
        why = (f"what it cannot do without already takes {format_size(resident)} "
               f"({resident} B: {self._kept_names()})" if resident else "alone it is larger")
        error = OutOfBudget(
            f"op {where} ({self.course.name(where)}): {what} ({format_size(nbytes)}, {nbytes} B) does "
            f"not fit the {format_size(self.ctx.budget)} budget: {why}; raise the budget to at "
            f"least {format_size(resident + nbytes)}")
        if self.book.overflow is None:
            log.warning("%s", error)
            self.book.overflow = error

    def _make_room(self, nbytes: int, keep: set | tuple, coming: int) -> bool:
        """Evict until ``nbytes`` more fit the budget, and the device's bytes with ``coming``
        more fit a budget for the whole step; False if the budget's cannot.

        The victims are the scheduler's choice (``scheduler.on_demand.choose_victims``) among
        the managed tensors the op does not use (``keep``) and the running backward node does
        not hold (``held``), in the order ops last used them. Carrying it out: finished writes
        are reaped, a write in flight is waited for, a tensor the slower tier holds is
        released, any other is written out and waited for (the waits count as stall).
        """
        budget, book = self.ctx.budget, self.book
        if book.resident + nbytes <= budget and self._over_device(coming) <= 0:
            return True
        self.reap_writes(block=False)
        held = self.held
        over = self._over_device(coming)
        victims = on_demand.choose_victims(self.recent, max(book.resident + nbytes - budget, over),
                                           self._evictable_bytes, lambda x: x in keep or x in held)
        for x in victims:
            del self.recent[x]
            if not isinstance(x, Birth):
                self._evict(x)
            elif (slot := self.fresh.adopt(x)) is not None:
                self._evict(slot)
        if over > 0 and victims and self.ctx.device.type == "cpu":   # what glibc held (state brought back
            give_back_heap()   # between steps: set_budget, resident()) goes back to the system, not its heap
        return book.resident + nbytes <= budget

    def _over_device(self, coming: int) -> int:
        """Bytes by which the device, with ``coming`` more, exceeds a budget for the whole
        step (``StepContext.device_live``; none: 0)."""
        live = self.ctx.device_live
        return 0 if live is None else live() + coming - self.ctx.device_budget

    def _evictable_bytes(self, x: Slot | Birth) -> int:
        """The bytes evicting ``x`` gives back (0 for an entry already gone)."""
        if isinstance(x, Birth):
            return x.nbytes if x in self.fresh.fresh else 0
        return x.nbytes if x.state in (State.RESIDENT, State.IN, State.OUT) else 0

    def _evict(self, slot: Slot) -> None:
        """Give a slot's memory back: wait for its write in flight, release it if the slower
        tier holds its bytes, else write it out and wait."""
        book = self.book
        if slot.state is State.IN:
            book.wait(f"swap_in {slot.name}", slot.finish_swap_in)
        if slot.state is State.RESIDENT and slot.host_current:
            slot.drop(self.ctx.tier)
            book.account(-slot.nbytes)
            return
        if slot.state is State.RESIDENT:
            book.write_out(slot)
        if slot.state is State.OUT:
            book.wait(f"evict {slot.name}", slot.finish_swap_out)
            book.account(-slot.nbytes)

    def _kept_names(self) -> str:
        """What stayed resident after evicting all that could go, for an overflow message."""
        names = [x.name if isinstance(x, Slot) else f"{self.rec.names[x.op]}#{x.op}"
                 for x in self.recent if self._evictable_bytes(x)]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
