"""The decisions around a plan's anchored form: which budget proves it, and whether it is kept.

A plan that swaps can run at a step's saved-tensor hooks alone (``anchors.py`` moves its
actions there). Two decisions follow, both made here from plain data:

- ``anchor_within_budget``: anchoring holds bytes longer than the plan did, so the plan is
  made again for a budget lowered by what its anchored form went over (and a chunk more, the
  runtime's rounding), ``ANCHOR_TRIES`` times at most, until ``check`` proves the anchored
  form within the real budget; swap only, or with the chains a runtime can rerun at hooks
  (``recompute=True``: those its templates rerun, ``ooc/runtime/templates.py``).
- ``worth_a_trial``: on a GPU (plans priced on the device's own op times, CUDA events), a
  form the simulator predicts ``TRIAL_SLOWER`` slower than its per-op plan is not tried. On the
  H100 (benchmarks/results/gpu.md) every swap-only form of a recomputing plan of ResNet-50
  and GPT-2 lost its trial (swap-only plans of their profiles: 1.4-3.2x the per-op step),
  after two trial steps each and with its pool, which brings more bytes back at once, left
  mapped; the Llama's won (its per-op steps host-bound at ~0.6 s, its anchored form predicted
  at 0.22-0.33 s).
- ``judge``: the trial. Anchored and per-op steps take turns until each ran ``TRIAL_RUNS``
  times (each side's first steps run on colder memory), and the faster of their fastest is
  kept. An anchored plan that moves more bytes than the per-op plan (it swaps what that one
  recomputes) must be ``MARGIN`` faster: at equal speed, fewer bytes through the swap file
  are the better plan (ResNet-50 b8 at 1/4 ran both at 1.15 s, moving 1,152 MiB against
  580 MiB; GPT 6x256 ran anchored ~10% faster).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Set

import scheduler
from scheduler.actions import replay
from scheduler.anchors import anchor
from scheduler.errors import BudgetTooSmall, ScheduleError
from scheduler.replay import mark_replayable
from scheduler.schedule import Schedule

TRIAL_RUNS = 2   # anchored steps timed against the per-op plan before one of them is kept
TRIAL_SLOWER = 1.25   # a GPU's anchored form predicted this much slower is not tried
MARGIN = 0.03
ANCHOR_TRIES = 4   # plans tried at lower budgets for an anchored form within the budget


def anchor_within_budget(schedule: Schedule, gaps: Set[int], first: Mapping[int, int], *,
                         budget: int, chunk: int, window: int | None, policy: str,
                         hardware: "scheduler.Hardware | None" = None,
                         recompute: bool = False, ready: Mapping[int, int] | None = None) -> Schedule | None:
    """The swap-only plan of ``schedule``'s sequence, anchored at ``gaps`` (``first``: each
    variable's first anchor), that ``check`` proves within ``budget``, or None. With
    ``recompute`` (a runtime that reruns chains at hooks: ``anchors``' docstring), the plan
    keeps the chains its sequence marks replayable, priced on ``hardware`` (``ready``: see
    ``anchor``). A plan bounded by a step's budget (``schedule.beside``) stays so, within its
    own budget."""
    # without templates a chain needs the per-op path
    seq = schedule.sequence if recompute else mark_replayable(schedule.sequence, lambda f: {})
    priced = {"hardware": hardware} if recompute and hardware is not None else {}
    if schedule.beside:   # a plan bounded by the step's budget (scheduler.beside): its device budget
        budget, priced = schedule.budget, {**priced, "beside": schedule.beside}
    lowered = budget
    for _ in range(ANCHOR_TRIES):
        try:
            planned = scheduler.plan(seq, budget=lowered, window=window, policy=policy, **priced)
        except BudgetTooSmall:
            return None
        moved = anchor(dataclasses.replace(planned, budget=budget), gaps, first, recompute=recompute, ready=ready)
        if moved is None:
            return None
        try:
            scheduler.check(moved)
            return moved
        except ScheduleError:
            try:
                over = (moved.bounded_peak_bytes if moved.beside else replay(moved).peak) - budget
            except ScheduleError:   # refused by the transition table: no anchored form
                return None
            if over <= 0:   # refused for another reason than bytes
                return None
            lowered -= over + chunk
            if lowered <= 0:   # the anchored form holds more than the whole budget: none
                return None
    return None


def worth_a_trial(moved: Schedule, plan: Schedule, per_op_s: float, hw: "scheduler.Hardware") -> bool:
    """Whether a GPU plan's anchored form ``moved`` may beat its per-op ``plan``: its predicted
    step (no op intercepted: no host lane) against the per-op plan's, the slower of its
    predicted step and ``per_op_s``, the time its planned run took (a per-op step bound by the
    host, which the simulator does not see unless told, shows there)."""
    anchored = scheduler.simulate(moved, hw, timeline=False).total_s
    per_op = max(per_op_s, scheduler.simulate(plan, hw, timeline=False).total_s)
    return anchored <= per_op * TRIAL_SLOWER


def judge(anchored_s: Sequence[float], per_op_s: Sequence[float], *, moved: int, planned: int) -> bool | None:
    """Whether the anchored form is kept, from the step times of each side (``moved`` and
    ``planned``: the bytes each side moves per step); None until each ran ``TRIAL_RUNS``."""
    if min(len(anchored_s), len(per_op_s)) < TRIAL_RUNS:
        return None
    return min(anchored_s) <= min(per_op_s) * (1 - MARGIN if moved > planned else 1)
