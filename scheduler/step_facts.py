"""The data ``scheduler.step_plans.after_step`` takes and gives: how the engine plans
(``Settings``), what a step showed (``StepFacts``), what was decided for its plan so far
(``PlanState``) and what follows (``Decision``). Plain data, no torch: the engine fills them
(``ooc/engine/planning.py``) and the rules read them (``step_plans.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Set

from scheduler.hardware import Hardware
from scheduler.ir import VariableSequence
from scheduler.schedule import Schedule


@dataclass(frozen=True)
class Settings:
    """How the engine plans: its budget, chunk, window, policy and recompute mode ("auto",
    "never", "prefer"); ``pins`` (a sequence -> the user's pin per activation) and
    ``hardware`` (a sequence -> what it is priced on), None where not given; whether plans
    are re-priced on planned runs (``reprice``) and may take a hook-driven form
    (``hook_forms``: ``hook_forms_allowed``); ``gpu``: the plan runs on a GPU, whose per-op
    steps may be bound by the host (``anchoring.worth_a_trial``)."""

    budget: int
    chunk: int
    window: int | None
    policy: str = "window"
    recompute: str = "auto"
    pins: Callable[[VariableSequence], Mapping[int, str]] | None = None
    hardware: Callable[[VariableSequence], Hardware] | None = None
    reprice: bool = True
    hook_forms: bool = True
    gpu: bool = False
    device_budget: int = 0   # a budget for the whole step, one arena: recordings with HELD_BESIDE plan bounded by it


@dataclass(frozen=True)
class StepFacts:
    """What a completed step showed, as data: its ``form`` (``FORMS``), whether it kept to
    its plan to the end (``kept``; a per-op step: ``ran_whole_plan``, it ran all the plan's
    ops), its recording (``sequence``, recorded and diverged steps) and measured op times
    (``seconds``), its hooks (``gaps``, ``first``: each variable's first anchor; ``update``:
    the gap of the update, None if it ran none; a hook-driven step: that of the trace it ran
    against), whether it saved what a plain form compares (``signature``), whether it ran an
    update (``updated``) and its wall time (``step_s``; ``device_timed``: its ops were timed
    with CUDA events, each behind a sleep queued to keep the device busy, so its wall time is
    not what an untimed step takes); ``ready``: the functions a hook-driven step can rerun
    from templates the step captured (``ooc/runtime/templates.py``), each with the gap from
    which it holds what the template reads (None: no templates); ``unkept``: the steps of its
    plan key right before it that kept no plan (``plans_again``); ``left``: the plan a diverged
    step left (or a new shape's recording guessed), where its variables were born and whether
    the step differs from it in sizes its chunks may not show, with ``born_at``, where the
    step's were (``widening.widened``); ``may_trace``: its plan key may record for its anchored
    form (once: ``Decision.trace``); ``founds``: the step is the first of a size among
    shapes whose plans' sizes vary (``ooc.engine.plan_cache.PlanCache.kin``), and its plan is
    marked so at once (``widening.marked``): the next step of that size runs it, where it
    would record again to be widened."""

    form: str
    kept: bool
    step_s: float
    seconds: Sequence[float] = ()
    sequence: VariableSequence | None = None
    ran_whole_plan: bool = False
    gaps: Set[int] | None = None
    first: Mapping[int, int] | None = None
    update: int | None = None
    signature: bool = False
    updated: bool = False
    device_timed: bool = False
    ready: Mapping[int, int] | None = None
    unkept: int = 0
    left: tuple[Schedule, Mapping[tuple[int, int], int], bool] | None = None
    born_at: Mapping[int, tuple[int, int]] | None = None
    founds: bool = False
    may_trace: bool = False


@dataclass(frozen=True)
class PlanState:
    """What was decided for one plan so far: its plan, the runs priced and the sequence at
    the fastest op times (``repriced``), and its hook-driven form if it was given one
    (``hook``: "plain", "anchored" or "none" when none is within the budget), with the
    anchored steps of its trial that kept to it (``hook_held``)."""

    plan: Schedule
    priced_runs: int = 0
    fastest: VariableSequence | None = None
    hook: str | None = None
    hook_held: int = 0


@dataclass(frozen=True)
class Decision:
    """What the engine does after a step: keep ``plan`` (a new plan, or a re-priced one:
    ``repriced``), note the prices (``priced_runs``, ``fastest``), give the plan a hook form
    (``plain``, or ``anchored``: its moved plan, None if none fits), time a trial side
    (``trial``: "per_op" or "hook"), end the trial for the anchored form (``hook_wins``), take
    the plan's hook-driven form away (``unhook``), or ``drop`` the plan (``trace``: the next
    step records with its hook trace)."""

    plan: Schedule | None = None
    repriced: bool = False
    priced_runs: int | None = None
    fastest: VariableSequence | None = None
    plain: bool = False
    anchored: bool = False
    moved: Schedule | None = None
    trial: str | None = None
    unhook: bool = False
    drop: bool = False
    hook_wins: bool = False
    trace: bool = False


__all__ = ["Decision", "PlanState", "Settings", "StepFacts"]
