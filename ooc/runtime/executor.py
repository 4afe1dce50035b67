"""Executing a checked ``Schedule``: the plan's memory actions, as the transition table says.

``PlanExecutor.apply`` runs one action (swap-in, wait for a swap-in, swap-out, wait for a
swap-out, drop, free, discard, recompute: the last two in ``recompute.py``) on one managed
tensor: the precondition, the new state and the device bytes are
``scheduler.actions.TRANSITIONS``'. The slot applies the row (``Slot``'s methods, the one place
a managed tensor's bytes move); this module counts the device bytes and times the waits. An
action the table refuses means the step is not where its plan is: it diverges and finishes on
demand.
Every wait for a transfer counts as stall and shows on the step's timeline.
"""

from __future__ import annotations

import time

import torch

from ooc.runtime.devices import cuda_runtime
from ooc.runtime.labels import label
from ooc.runtime.slots import Slot, in_flight, raise_failed
from scheduler.actions import TRANSITIONS, Names, refusal
from scheduler.schedule import Op
from vmm.errors import OutOfBudget
from vmm.units import format_size


class _Unbudgeted:
    """Memory outside the pool, on the engine's device, for an on-demand step that has
    already failed its budget."""

    def __init__(self, device: torch.device) -> None:
        # where the device's tensors live (the CPU under ooc.testing.fake_cuda)
        self.device = cuda_runtime().tensor_device(device) if device.type == "cuda" else device

    def take(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class _Overflowing:
    """The pool a step's swap-in takes its destination from. On demand (no plan yet, or a
    diverged step) the bytes are needed now: if the pool cannot hold them, they are taken
    outside it, the step finishes and fails at its end with the plan's verdict
    (BudgetTooSmall with the minimum) or this error (``overflow``). A planned step raises."""

    def __init__(self, step: "PlanExecutor", slot: Slot, where: int) -> None:
        self.step, self.slot, self.where = step, slot, where

    def take(self, nbytes: int) -> torch.Tensor:
        step, slot, where = self.step, self.slot, self.where
        try:
            return step.ctx.pool.take(nbytes)
        except OutOfBudget as exc:
            error = OutOfBudget(
                f"op {where} ({step._name(where)}): swapping in {slot.name} ({format_size(slot.nbytes)}, "
                f"{slot.nbytes} B) does not fit the {format_size(step.ctx.budget)} pool: {exc}")
            if step.planned:
                raise error from None
            if step.overflow is None:
                step.overflow = error
            return _Unbudgeted(step.ctx.device).take(nbytes)


class PlanExecutor:
    """The ``Stepper``'s plan actions and transfers (a mixin: it works on the step's slots,
    resident bytes and timeline, which the ``Stepper`` holds). Its own state: ``refused``,
    the plan action the table refused, if any (set by ``apply``)."""

    def _timed(self, track: str, name: str, fn, *args) -> None:
        """Block on a transfer; the time counts as stall and shows on the timeline."""
        t0 = time.perf_counter()
        with label(f"ooc.{name}"):
            fn(*args)
        t1 = time.perf_counter()
        self.stall_s += t1 - t0
        self.events.append((track, name, t0, t1))

    def _wait(self, name: str, fn) -> None:
        """A slot's wait (``Slot.bring_back``), timed as ``_timed`` does."""
        self._timed("wait", name, fn)

    def run_actions(self, actions, where: int, phase: str = "before") -> None:
        for a in actions:
            if not self.planned:
                return   # diverged: the rest of the step runs on demand
            slot = self.slots.get(a.var)
            if slot is None:
                self._diverge(where, f"variable {a.var} of the plan is not bound")
                return
            self.apply(a.op, slot, where, phase, a.chain)

    def apply(self, op: Op, slot: Slot, where: int, phase: str = "before",
              chain: tuple[int, ...] = ()) -> None:
        """Run plan action ``op`` on ``slot`` as the transition table (``scheduler.actions``)
        defines it: its precondition on the slot's state, its new state and device bytes are
        the table's; the slot's methods move the bytes, this method counts and times them. A refused action means the step
        is not where its plan is: it diverges, with the error ``scheduler.check`` gives for
        the same action (``Refused``), and finishes on demand."""
        state = slot.state.residency
        why = refusal(op, state, slot.host_current)
        if why is not None:
            self.refused = Names(self.schedule.sequence).refused(op, slot.var, where, phase, state, why)
            self._diverge(where, str(self.refused))
            return
        eff = TRANSITIONS[op, state]
        ctx = self.ctx
        if op is Op.SWAP_IN:
            self._account(eff.device * slot.nbytes)   # the destination is taken at issue
            with label(f"ooc.swap_in {slot.name}"):
                self._swap_in(slot, where)
            ctx.counters["bytes_in"] += slot.nbytes
        elif op is Op.WAIT_IN:
            self._timed("wait", f"wait_in {slot.name}", slot.finish_swap_in)
            self._register(slot)
        elif op is Op.SWAP_OUT:
            with label(f"ooc.swap_out {slot.name}"):
                self._start_out(slot)
            ctx.counters["bytes_out"] += slot.nbytes
        elif op is Op.WAIT_OUT:
            self._timed("wait", f"wait_out {slot.name}", slot.finish_swap_out)
        elif op is Op.DROP:
            slot.drop(ctx.tier)
        elif op is Op.FREE:
            slot.free(ctx.tier)
        elif op is Op.DISCARD:
            if not self._discard(slot, where):   # its chain cannot re-create it exactly
                return
        elif op is Op.RECOMPUTE:
            self._account(eff.device * slot.nbytes)
            self._recompute(slot, chain, where)
        if op not in (Op.SWAP_IN, Op.RECOMPUTE) and eff.device:
            self._account(eff.device * slot.nbytes)

    def _start_out(self, slot: Slot) -> None:
        slot.start_swap_out(self.ctx.tier)
        self._trace_transfer(slot, "swap-out")

    def _trace_transfer(self, slot: Slot, track: str) -> None:
        """Put the transfer on the timeline from issue to completion (the I/O threads do it,
        so only their completion callback knows when it ended)."""
        future = slot.future
        if future is None or not hasattr(future, "add_done_callback"):
            return
        t0, name, events = time.perf_counter(), f"{track} {slot.name}", self.events
        future.add_done_callback(lambda _: events.append((track, name, t0, time.perf_counter())))

    def _swap_in(self, slot: Slot, where: int) -> None:
        slot.start_swap_in(self.ctx.tier, self._pool_for(slot, where))
        self._trace_transfer(slot, "swap-in")

    def _pool_for(self, slot: Slot, where: int) -> "_Overflowing":
        """The memory a swap-in of ``slot`` before op ``where`` reads into: the pool, or, on
        demand once the pool cannot hold it, memory outside it (see ``_Overflowing``)."""
        return _Overflowing(self, slot, where)

    def wait_for_transfers(self, drain: bool = True) -> None:
        """The commit point's wait: every transfer in flight completes; a failed one raises
        here, naming its variable. ``drain=False``: only those already failed raise."""
        busy = in_flight(self.slots.values())
        if busy and drain:   # one wait for all of them (on a GPU, one host synchronization)
            self._timed("wait", "commit point", self.ctx.tier.drain)
        raise_failed(busy)
