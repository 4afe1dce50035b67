"""Hook-driven forms of a plan: the engine out of the way of the ops.

A planned step runs every aten op through the engine's dispatch mode, which costs time per op
whether or not the plan acts there (GPT 6x256 b8 on this CPU: ~70 ms of a 0.6 s step; on an
H200 the per-op steps of ResNet-50 b32 took 99 ms against 28 ms in core under a plan that moved
nothing, benchmarks/results/gpu.md). With activations managed only, on a CPU or a GPU, a plan
can run at the saved-tensor hooks alone (``ooc/runtime/anchored_step.py``), once a planned
per-op step kept to it and showed where its hooks ran:

- a plan that moves nothing (the budget holds the whole step) runs with no action at all: its
  verified step noted what autograd saved (``Stepper.signature``), and the later steps compare
  their saves with it (``plain`` in the stats). On small models PyTorch's Python dispatch by
  itself cost more than the 5% an engine that moves nothing may add;
- a plan that swaps or recomputes is moved to the anchors its step's hook trace gives
  (``scheduler.anchors.anchor``; its chains rerun from the templates that step captured,
  ``ooc/runtime/templates.py``, else swapped), for a budget the scheduler lowers until
  ``check`` proves the moved plan within the real one (``scheduler.anchoring.anchor_within_budget``);
  then anchored and per-op steps take turns on trial, and the scheduler's rule keeps the
  faster (``scheduler.anchoring.judge``). On a GPU each step on trial waits for the device at
  its end: its host time alone would be its launches.

A step of either form that leaves its plan is finished synchronously, and the engine records
and plans again, as after any step that diverged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Hashable

from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.hook_trace import HookTrace
from ooc.runtime.templates import Templates
from scheduler.anchoring import judge
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class HookPlan:
    """A plan's hook-driven form: ``moved``, the plan its steps run (the plan itself when it
    moves nothing; None: it has none within the budget), the hook trace it was made from, the
    templates its chains rerun from (None: it swaps only), and
    its trial (step times of the anchored form and of the per-op plan, taken in turn, then
    ``kept`` or ``rejected``). A plan that moves nothing has no trial: it is kept."""

    plan: Schedule
    moved: Schedule | None
    trace: HookTrace
    templates: Templates | None = None
    trial: list[float] = dataclasses.field(default_factory=list)
    per_op: list[float] = dataclasses.field(default_factory=list)
    kept: bool = False
    rejected: bool = False

    @property
    def held(self) -> int:
        """The anchored steps of its trial that kept to the plan (0 once judged, or with no
        anchored form)."""
        on_trial = self.moved is not None and self.moved is not self.plan and not (self.kept or self.rejected)
        return len(self.trial) if on_trial else 0

    def judge(self) -> bool:
        """Decide once both sides ran their trial (``scheduler.anchoring.judge``). Returns
        whether it decided now."""
        if self.kept or self.rejected or self.moved is None:
            return False
        verdict = judge(self.trial, self.per_op, moved=_moved(self.moved), planned=_moved(self.plan))
        if verdict is None:
            return False
        self.kept, self.rejected = verdict, not verdict
        return True


class HookForms:
    """The hook-driven form of each plan key that has one (or was refused one), and the keys
    whose recording was asked to note its hook trace, to make one at once where no per-op step
    keeps to a plan (``scheduler.step_plans.Decision.trace``). ``enabled``: whether the engine
    may run such steps at all (``Options.hook_steps``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._entries: dict[Hashable, HookPlan] = {}
        # plan key -> a recording asked to note its hook trace (True), or done (False): once
        # per key (``scheduler.step_plans.Decision.trace``)
        self._traces: dict[Hashable, bool] = {}

    def get(self, key: Hashable) -> HookPlan | None:
        return self._entries.get(key)

    def drop(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
        self._traces.clear()

    def may_trace(self, key: Hashable) -> bool:
        """Whether ``key``'s next recording may yet be asked to note its hook trace."""
        return self.enabled and key not in self._traces

    def trace_next(self, key: Hashable) -> None:
        """``key``'s next recording notes its hook trace."""
        self._traces[key] = True

    def tracing(self, key: Hashable) -> bool:
        """Whether a recording of ``key`` starting now notes its hook trace (asked, not done):
        once, the ask is used up."""
        if not self._traces.get(key):
            return False
        self._traces[key] = False
        return True

    def add(self, key: Hashable, entry: HookPlan) -> None:
        self._entries[key] = entry
        if entry.moved is not None and entry.moved is not entry.plan:
            plan, moved, trace = entry.plan, entry.moved, entry.trace
            log.info("anchored plan: %d anchors, %s in, %s out, %s recomputed per step, peak %s (per-op plan: "
                     "%s in, %s out, %s recomputed); on trial", len(trace.gaps()), format_size(moved.bytes_in),
                     format_size(moved.bytes_out), format_size(moved.bytes_recomputed),
                     format_size(moved.peak_resident_bytes),
                     format_size(plan.bytes_in), format_size(plan.bytes_out), format_size(plan.bytes_recomputed))
        elif entry.moved is None:
            log.info("no anchored form of the plan fits the budget (its actions moved to autograd's hooks were "
                     "not proven within it in its tries at lower budgets): its steps run per op")

    def step(self, key: Hashable, schedule: Schedule | None, make: Callable[..., AnchoredStep]) -> AnchoredStep | None:
        """The hook-driven step for ``key``'s plan ``schedule``, if it has one and its turn
        is now (on trial, the turns alternate: the per-op plan's turn gives None)."""
        entry = self._entries.get(key)
        if (entry is None or entry.moved is None or entry.plan is not schedule or entry.rejected
                or not self.enabled):
            return None
        if not entry.kept and len(entry.trial) > len(entry.per_op):
            return None   # on trial: the per-op plan's turn
        return make(entry.plan, entry.moved, entry.trace, entry.templates)

    def on_trial(self, key: Hashable, schedule: Schedule | None) -> bool:
        """Whether a step of ``key``'s plan ``schedule``, of either form, is timed for its trial."""
        entry = self._entries.get(key)
        return (entry is not None and entry.plan is schedule and entry.moved is not None
                and entry.moved is not entry.plan and not (entry.kept or entry.rejected))

    def per_op_ran(self, key: Hashable, schedule: Schedule, seconds: float) -> bool:
        """A planned per-op step of ``schedule`` kept to it: its time, on trial. Returns
        whether ``key`` has an entry for this plan (nothing more to note)."""
        entry = self._entries.get(key)
        if entry is None or entry.plan is not schedule:
            return False
        entry.per_op.append(seconds)
        self._log_judged(entry)
        return True

    def hook_ran(self, st: AnchoredStep, seconds: float) -> None:
        """A hook-driven step that kept to its plan, timed for its trial
        (``scheduler.step_plans.hook_ran`` says when)."""
        entry = self._entries.get(st.start_key)
        if entry is None or entry.plan is not st.schedule or entry.moved is entry.plan or entry.kept:
            return
        entry.trial.append(seconds)
        self._log_judged(entry)

    def wins(self, key: Hashable, schedule: Schedule, at: int | None) -> None:
        """A per-op step of ``key``'s plan ``schedule`` left it at op ``at`` where its anchored
        steps on trial kept to it (``scheduler.step_plans.Decision.hook_wins``): the anchored
        form is kept."""
        entry = self._entries.get(key)
        if entry is None or entry.plan is not schedule or not entry.held:
            return
        entry.kept = True
        log.info("a per-op step left the plan at op %s where %d anchored step(s) kept to it: anchored steps "
                 "kept (the forward runs other ops from step to step, and saves the same tensors)", at,
                 len(entry.trial))

    def unhook(self, key: Hashable, schedule: Schedule, why: str) -> None:
        """``key``'s plan ``schedule`` runs per op from now on (``Decision.unhook``), because ``why``."""
        entry = self._entries.get(key)
        if entry is None or entry.plan is not schedule:
            return
        entry.moved, entry.kept = None, False
        log.info("%s: back to the per-op path", why)

    @staticmethod
    def _log_judged(entry: HookPlan) -> None:
        if entry.judge():
            log.info("anchored steps %s: fastest %.3f s against the per-op plan's %.3f s",
                     "kept" if entry.kept else "rejected", min(entry.trial), min(entry.per_op))


def _moved(schedule: Schedule) -> int:
    return schedule.bytes_in + schedule.bytes_out


__all__ = ["HookForms", "HookPlan"]
