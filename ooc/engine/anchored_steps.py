"""Anchored steps: a plan that swaps, run at autograd's hooks instead of at every op.

A planned step runs every aten op through the engine's dispatch mode, which costs time per op
whether or not the plan acts there (GPT 6x256 b8 on this CPU: ~70 ms of a 0.6 s step). With
activations managed only, a plan that swaps (and does not recompute) can run at the saved-
tensor hooks alone: after a planned step kept to its plan, its hook trace gives the anchors,
``scheduler.anchors.anchor`` moves the plan's actions there and ``scheduler.check`` proves the
moved plan within the budget. The next steps that start in the same state run anchored
(``ooc/runtime/anchored_step.py``); one that leaves the plan is finished synchronously and the
engine records and plans again, as after a plain step that diverged.
"""

from __future__ import annotations

import dataclasses
import logging

import scheduler
from ooc.engine.planning import REPRICED_RUNS
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.hook_trace import HookTrace
from ooc.runtime.plain_step import moves_nothing
from ooc.runtime.stepper import Stepper
from scheduler.actions import replay
from scheduler.anchors import anchor
from scheduler.errors import ScheduleError
from scheduler.replay import mark_replayable
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)

TRIAL_RUNS = 2   # anchored steps timed against the per-op plan before one of them is kept
# An anchored plan that moves more bytes than the per-op plan (it swaps what that one
# recomputes) must be this much faster to be kept: at equal speed, fewer bytes through the
# swap file are the better plan (ResNet-50 b8 at 1/4 ran both at 1.15 s, moving 1,152 MiB
# against 580 MiB; GPT 6x256 ran anchored ~10% faster).
MARGIN = 0.03

ANCHOR_TRIES = 4   # plans tried at lower budgets for an anchored form within the budget


@dataclasses.dataclass(eq=False)
class Anchored:
    """A plan's anchored form (None: it has none within the budget), the hook trace it was made
    from, and its trial: step times of the anchored form and of the per-op plan, taken in turn,
    then ``kept`` or ``rejected``."""

    plan: Schedule
    moved: Schedule | None
    trace: HookTrace
    trial: list[float] = dataclasses.field(default_factory=list)
    per_op: list[float] = dataclasses.field(default_factory=list)
    kept: bool = False
    rejected: bool = False

    def judge(self) -> bool:
        """Decide once both sides ran ``TRIAL_RUNS`` steps: the faster of their fastest.
        Returns whether it decided now."""
        if self.kept or self.rejected or min(len(self.trial), len(self.per_op)) < TRIAL_RUNS:
            return False
        moves_more = self.moved is not None and _moved(self.moved) > _moved(self.plan)
        self.kept = min(self.trial) <= min(self.per_op) * (1 - MARGIN if moves_more else 1)
        self.rejected = not self.kept
        return True


class AnchoredSteps:
    """``OutOfCore``'s anchored steps (a mixin). Its state (``_init_anchored``): ``_anchored``,
    start key -> ``Anchored`` for each plan that was tried; ``anchored_steps``, whether the engine
    may run them (True; tests of the per-op path turn it off)."""

    def _init_anchored(self) -> None:
        self._anchored: dict[object, Anchored] = {}
        self._ran: Schedule | None = None   # the anchored plan the last step ran (stats' plan.*)
        self.anchored_steps = True

    def _note_anchored(self, st: Stepper, seconds: float) -> None:
        """After a planned per-op step that kept to a plan that moves bytes to its end, and whose prices
        are settled (``_reprice``): the anchored form of its swap-only plan, if one proves within
        the budget. Then a trial: anchored and per-op steps take turns until each ran
        ``TRIAL_RUNS`` times, and the faster is kept (the per-op plan may recompute what the
        anchored one must swap, and each side's first steps run on colder memory)."""
        trace = st.hook_trace
        key, schedule = st.start_key, st.schedule
        if (trace is None or not st.planned or st.diverged_at is not None or not self.anchored_steps
                or self.plans.get(key, (None,))[0] is not schedule or moves_nothing(schedule)
                or self.policy != "window" or self._pin is not None   # pins are the per-op plan's
                or self.recompute == "prefer"):   # asked to recompute: a form that swaps instead is not that
            return
        if len(st.rec.names) != len(schedule.sequence.functions):
            # The step ended before its plan did (a micro-batch without the update its plan
            # has): it proved part of the plan only. An anchored step does not see the ops it
            # would have missed, so a stale update (momentum created since the plan was made)
            # would go unnoticed where a per-op step diverges and re-plans.
            return
        entry = self._anchored.get(key)
        if entry is not None and entry.plan is schedule:
            entry.per_op.append(seconds)
            self._log_judged(entry)
            return
        if self.recompute and self.repriced.get(key, (0,))[0] < REPRICED_RUNS:
            return   # the plan may still change with its prices
        trace.update = st.rec.optimizer_start
        moved = self._anchor_within_budget(schedule, trace)
        self._anchored[key] = Anchored(schedule, moved, trace, per_op=[seconds])
        if moved is not None:
            log.info("anchored plan: %d anchors, %s in, %s out per step, peak %s (per-op plan: %s in, %s out, "
                     "%s recomputed); on trial", len(trace.gaps()), format_size(moved.bytes_in),
                     format_size(moved.bytes_out), format_size(moved.peak_resident_bytes),
                     format_size(schedule.bytes_in), format_size(schedule.bytes_out),
                     format_size(schedule.bytes_recomputed))

    def _anchored_step(self, key: object) -> AnchoredStep | None:
        entry = self._anchored.get(key)
        if (entry is None or entry.moved is None or entry.plan is not self.schedule or entry.rejected
                or not self.anchored_steps):
            return None
        if not entry.kept and len(entry.trial) > len(entry.per_op):
            return None   # on trial: the per-op plan's turn
        return AnchoredStep(entry.plan, entry.moved, entry.trace, budget=self.budget,
                            min_bytes=self.min_bytes, tier=self.tier, pool=self.pool, model=self.model,
                            new_key=self._ids.__next__, start_key=key)

    def _judge_anchored(self, st: AnchoredStep, seconds: float) -> None:
        """After an anchored step that kept to its plan: its time, while on trial, if it did what
        the per-op steps it is timed against did (the update, or not). One that ran an update
        its trace's step did not (gradient accumulation: the plan was made from a micro-batch)
        ran ops no plan has proven: the per-op path takes that state back, and its next update
        step diverges there and plans from a step that updates, as without anchored steps."""
        entry = self._anchored.get(st.start_key)
        if entry is None or entry.plan is not st.schedule:
            return
        if st.updated and entry.trace.update is None:   # no anchored form for this plan any more
            entry.moved, entry.kept = None, False
            log.info("an anchored step ran an update its plan's step did not: back to the per-op path")
        elif not entry.kept and st.updated == (entry.trace.update is not None):
            entry.trial.append(seconds)
            self._log_judged(entry)

    @staticmethod
    def _log_judged(entry: Anchored) -> None:
        if entry.judge():
            log.info("anchored steps %s: fastest %.3f s against the per-op plan's %.3f s",
                     "kept" if entry.kept else "rejected", min(entry.trial), min(entry.per_op))

    def _anchor_within_budget(self, schedule: Schedule, trace: HookTrace) -> Schedule | None:
        """The swap-only plan of ``schedule``'s sequence, anchored at ``trace``'s hooks, that
        ``check`` proves within the budget, or None. Anchoring holds bytes longer than the plan
        did, so the plan is made for a budget lowered by what its anchored form went over, a
        few times at most."""
        seq = mark_replayable(schedule.sequence, lambda f: {})   # a chain needs the per-op path
        gaps, first = trace.gaps(), trace.first_saved()
        budget = self.budget
        for _ in range(ANCHOR_TRIES):
            try:
                planned = scheduler.plan(seq, budget=budget, window=self.window, policy=self.policy)
            except scheduler.BudgetTooSmall:
                return None
            moved = anchor(dataclasses.replace(planned, budget=self.budget), gaps, first)
            if moved is None:
                return None
            try:
                scheduler.check(moved)
                return moved
            except ScheduleError:
                try:
                    over = replay(moved).peak - self.budget
                except ScheduleError:   # refused by the transition table: no anchored form
                    return None
                if over <= 0:   # refused for another reason than bytes
                    return None
                budget -= over + self.chunk
                if budget <= 0:   # the anchored form goes over by more than the budget itself
                    return None
        return None


def _moved(schedule: Schedule) -> int:
    return schedule.bytes_in + schedule.bytes_out
