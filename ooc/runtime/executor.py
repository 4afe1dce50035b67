"""Executing a checked ``Schedule``: the plan's memory actions, as the transition table says.

``PlanExecutor.apply`` runs one action (swap-in, wait for a swap-in, swap-out, wait for a
swap-out, drop, free, discard, recompute: the last two in ``recompute.py``) on one managed
tensor: the precondition, the new state and the device bytes are
``scheduler.actions.TRANSITIONS``'. The slot applies the row (``Slot``'s methods, the one place
a managed tensor's bytes move); this module counts the device bytes and times the waits. An
action the table refuses means the step is not where its plan is: the executor says why, and the
``Stepper`` diverges (the rest of the step runs on demand).
Every wait for a transfer counts as stall and shows on the step's timeline.
"""

from __future__ import annotations

from collections.abc import Callable

from ooc.runtime.overflow import pool_for
from ooc.runtime.recompute import Recomputation
from ooc.runtime.commit_point import wait_for_transfers
from ooc.runtime.slots import Slot
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from scheduler.actions import TRANSITIONS, Names, refusal
from scheduler.schedule import Op

Ensure = Callable[..., None]   # Stepper.ensure(slot, op, keep): make a slot usable for an op


class PlanExecutor:
    """The plan's actions around each op, on the step's slots (``StepBook``), as long as the
    step follows its plan (``Course``); discard and recompute are ``Recomputation``'s."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, recompute: Recomputation) -> None:
        self.ctx, self.book, self.course, self.recompute = ctx, book, course, recompute

    def run(self, actions, where: int, phase: str, ensure: Ensure) -> str | None:
        """Run ``actions`` around op ``where``; stops at the first the step cannot run and
        says why (the caller diverges), or at a divergence during one (a recompute's input
        not resident). ``ensure`` makes a chain's input usable (``Stepper.ensure``)."""
        slots, course = self.book.slots, self.course
        for a in actions:
            if not course.planned:
                return None   # diverged: the rest of the step runs on demand
            slot = slots.get(a.var)
            if slot is None:   # its op made less than min_bytes there, or nothing: another step
                v = course.schedule.sequence.variables[a.var]
                return (f"{v.name} ({v.nbytes} B in the plan) was not made by this step as a managed "
                        f"tensor (under {self.ctx.min_bytes} B, or not at all)")
            why = self.apply(a.op, slot, where, phase, a.chain, ensure)
            if why is not None:
                return why
        return None

    def apply(self, op: Op, slot: Slot, where: int, phase: str, chain: tuple[int, ...],
              ensure: Ensure) -> str | None:
        """Run plan action ``op`` on ``slot`` as the transition table (``scheduler.actions``)
        defines it: its precondition on the slot's state, its new state and device bytes are
        the table's; the slot's methods move the bytes, this method counts and times them. A
        refused action means the step is not where its plan is: returns why, with the error
        ``scheduler.check`` gives for the same action (``Course.refused``), and the caller
        diverges."""
        state = slot.state.residency
        why = refusal(op, state, slot.host_current)
        course, book, ctx = self.course, self.book, self.ctx
        if why is not None:
            course.refused = Names(course.schedule.sequence).refused(op, slot.var, where, phase, state, why)
            return str(course.refused)
        eff = TRANSITIONS[op, state]
        if op is Op.SWAP_IN:
            book.account(eff.device * slot.nbytes)   # the destination is taken at issue
            self.swap_in(slot, where)   # (the slot labels its transfers for profilers)
            ctx.counters["bytes_in"] += slot.nbytes
        elif op is Op.WAIT_IN:
            book.wait(f"wait_in {slot.name}", slot.finish_swap_in)
            book.register(slot)
        elif op is Op.SWAP_OUT:
            book.write_out(slot)
        elif op is Op.WAIT_OUT:
            book.wait(f"wait_out {slot.name}", slot.finish_swap_out)
        elif op is Op.DROP:
            slot.drop(ctx.tier)
        elif op is Op.FREE:
            slot.free(ctx.tier)
        elif op is Op.DISCARD:
            why = self.recompute.discard(slot, where)
            if why is not None:   # its chain cannot re-create it exactly
                return why
        elif op is Op.RECOMPUTE:
            book.account(eff.device * slot.nbytes)
            self.recompute.recompute(slot, chain, where, ensure)
        if op not in (Op.SWAP_IN, Op.RECOMPUTE) and eff.device:
            book.account(eff.device * slot.nbytes)
        return None

    def swap_in(self, slot: Slot, where: int) -> None:
        slot.start_swap_in(self.ctx.tier, pool_for(self.ctx, self.book, self.course, slot, where))
        self.book.trace_transfer(slot, "swap-in")

    def wait_for_transfers(self, drain: bool = True) -> None:
        """The commit point's wait: every transfer in flight completes; a failed one raises
        here, naming its variable. ``drain=False``: only those already failed raise."""
        wait_for_transfers(self.book, self.book.slots.values(), self.ctx.tier, drain)
