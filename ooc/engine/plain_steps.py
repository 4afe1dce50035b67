"""Plain steps: the engine out of the way when its plan has nothing to do.

A plan that moves nothing (the budget holds the whole step) is first run as planned, through
the dispatch mode, to prove that the step keeps to it; that run notes what autograd saved
(``Stepper.signature``). The later steps that start in the same state run as plain PyTorch,
guarded by the saved-tensor hooks alone (``ooc/runtime/plain_step.py``): about in-core speed
on small models, where PyTorch's Python dispatch by itself cost more than the 5% an engine that
moves nothing may add. CPU, activations managed only: managed parameters, gradients or state
need the per-op path to be brought back and released, and on a GPU the activations would sit in
PyTorch's caching allocator beside the engine's pool.
"""

from __future__ import annotations

import logging

from ooc.runtime import cpu_allocator
from ooc.runtime.plain_step import PlainStep, Signature, moves_nothing
from ooc.runtime.stepper import Stepper
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)


class PlainSteps:
    """``OutOfCore``'s plain steps (a mixin). Its state (``_init_plain``): ``_plain``, the
    start key -> (plan, what its verified step saved) of each plan that moves nothing and ran
    once as planned; ``plain_steps``, whether the engine may run plain steps at all (True; tests
    of the per-op path turn it off)."""

    def _init_plain(self) -> None:
        self._plain: dict[object, tuple[Schedule, Signature]] = {}
        self.plain_steps = True

    def _plain_candidate(self) -> bool:
        """Whether the step about to run follows a plan whose later steps could run plain."""
        return (self.plain_steps and self.schedule is not None and self.device.type == "cpu"
                and self.manage == {"activations"} and moves_nothing(self.schedule))

    def _plain_step(self, key: object) -> PlainStep | None:
        """A plain step for a step starting in ``key``, if its plan was verified."""
        entry = self._plain.get(key)
        if entry is None or entry[0] is not self.schedule or not self._plain_candidate():
            return None
        self.pool.trim()   # nothing will be swapped in: the pool's idle chunks go back
        return PlainStep(self.schedule, entry[1], budget=self.budget, min_bytes=self.min_bytes,
                         tier=self.tier, model=self.model, new_key=self._ids.__next__, start_key=key)

    def _note_verified(self, st: Stepper) -> None:
        """A planned step that kept to its plan that moves nothing: later steps may run plain."""
        if st.signature is not None and st.planned and st.diverged_at is None:
            self._plain[st.start_key] = (st.schedule, tuple(st.signature))

    def _finish_plain(self, st: PlainStep, exc: BaseException | None, seconds: float) -> None:
        """A plain step's end: roll back a failed one (before its update), book it, and after a
        step that diverged, drop the plan so that the next step records and re-plans."""
        cpu_allocator.end(self)
        try:
            st.finish(failed=exc is not None)
        finally:
            if exc is not None and st.rollback.undo is not None:   # failed before the commit point
                note = st.rollback.roll_back()
                if note and hasattr(exc, "add_note"):
                    exc.add_note(note)
            self.counters[st.counter] += 1
            self.counters["bytes_out"] += st.spilled_bytes
            self.counters["bytes_in"] += st.read_bytes
            self._book_step(st.events, seconds, st.stall_s, planned=st.diverged_at is None,
                            diverged_at=st.diverged_at, peak=st.saved_bytes)
        if st.counter == "anchored_steps" and st.diverged_at is None and exc is None:
            self._judge_anchored(st, seconds)
        if st.diverged_at is not None and exc is None:
            log.warning("step diverged from its plan near op %d (%s): %s; %s written out and read "
                        "back on demand, re-planning next step", st.diverged_at,
                        self._plan_op_name(st.schedule, st.diverged_at), st.why,
                        format_size(st.spilled_bytes))
            if self.plans.get(st.start_key, (None,))[0] is st.schedule:   # not a guess of another shape's
                self._drop_plan(st.start_key)

    @staticmethod
    def _plan_op_name(schedule: Schedule, i: int) -> str:
        functions = schedule.sequence.functions
        return functions[i].name if 0 <= i < len(functions) else "end of step"
