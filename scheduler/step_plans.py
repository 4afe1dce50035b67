"""One entry point for what follows a step: plan it, price its plan again, give it a form.

The runtime runs a step in one of five forms (``ooc/runtime/step_protocol.py``) and reports
what it saw; every decision about the next steps is made here, from plain data, and the
engine executes it (``ooc/engine/planning.py``):

- a step that ran no plan (recorded) or left it (diverged) is planned from its recording
  (``plan_recorded``: activations rounded to whole chunks, swap only where asked, then
  ``plan`` and ``check``; a step that left a plan of the same ops, each activation at least
  as large as that plan's: ``widening.py``, sizes that depend on the data), unless the
  steps of its plan key have left or lacked a plan too many times in a row (``plans_again``:
  a model whose ops change at random, LayerDrop, made a plan at every step that the next step
  left; a widened plan is made whatever the streak: its sizes only grow, so each such plan is
  closer to one that holds);
- a planned per-op step that kept to a plan with something to move prices the plan again
  on its op times (``reprice``): the recording step ran on cold memory, and its op times are
  too high to price recompute on; each op at the fastest of its recorded and first
  ``REPRICED_RUNS`` planned runs (an op's time only grows by what ran beside it). A plan that
  moves and recomputes the same bytes keeps the plan that runs. On a GPU as on a CPU: the
  recording step's ops, timed with CUDA events, still reach ``cudaMalloc`` where PyTorch's
  caching allocator has no block of their size yet, and the device waits for the launch
  meanwhile; so the GPU's planned per-op steps time their ops too while the plan's prices
  are open (``prices_open``), and the step that times them, slowed by the timing, is not
  the per-op side of a trial (``StepFacts.device_timed``);
- such a step, once the prices are settled, gives its plan a hook-driven form (``hook_form``:
  plain when the plan moves nothing, else anchored within the budget, ``anchoring.py``), and
  the trial between forms is ``anchoring.judge``'s (a plan whose sizes vary,
  ``widening.sizes_vary``, takes them with each save bounded by its variable's room, the
  anchored one swapping only);
- a per-op step that left a plan whose anchored steps on trial kept to it ends the trial for
  them (``hook_wins``): its forward ran other ops and saved the same tensors, which the
  anchored form, seeing saves only, holds to (a seq2seq decoder fed a column of the targets
  or its last ``argmax``, chosen per batch). Planned from instead, each such step made a plan
  the next step of the other kind left, and no form settled. Where no per-op step keeps to
  any plan (that choice per token), the first re-plan of the streak (``plans_again``) drops
  the plan instead (``trace``): the next step records with its hook trace, and its plan gets
  its anchored form at once, at the recording's prices (``at_once``);
- a hook-driven step that left its plan drops it (the next step records; a plan whose sizes
  vary is unhooked instead: the next step runs it per op and, where it grew, leaves it and is
  planned widened); one that kept to it is timed for its trial, unless it ran an update its
  trace's step did not (``hook_ran``);
- which steps may take a hook-driven form at all is ``hook_forms_allowed`` and
  ``plain_candidate``'s (which ops a planned per-op step runs with no bookkeeping is a
  property of its plan: ``scheduler.schedule.quiet_functions``).

``after_step`` is the entry point: the step's facts (``StepFacts``) and the plan's state
(``PlanState``) in, a ``Decision`` out. Pure data: no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import scheduler
from scheduler.anchoring import anchor_within_budget, worth_a_trial
from scheduler.beside import held_beside_of
from scheduler.errors import BudgetTooSmall
from scheduler.ir import Kind, Variable, VariableSequence
from scheduler.replay import mark_replayable
from scheduler.schedule import Schedule
from scheduler.step_facts import Decision, PlanState, Settings, StepFacts
from scheduler.widening import marked, sizes_vary, widened
from vmm.units import format_size

REPRICED_RUNS = 2   # a plan is re-priced on the fastest op times of this many planned runs
# Steps of one plan key in a row that kept no plan, after which a step that left its plan is
# planned from only at doubling intervals (``plans_again``).
REPLAN_STREAK = 3


def plans_again(unkept: int) -> bool:
    """Whether a step that kept no plan is planned from, after ``unkept`` steps of its plan key
    in a row that kept none: while ``unkept`` < ``REPLAN_STREAK``, then where ``unkept`` is
    ``REPLAN_STREAK`` less one plus a power of two (3, 4, 6, 10, 18, ...). A model whose ops
    change from step to step at random (LayerDrop: each layer skipped with a probability, as
    wav2vec2's configuration does by default) left every plan at the next step, and a plan was
    made at every step: on a GPU,
    planning takes longer than a step (issue 38: up to 0.3 s). The steps in between run
    their key's last plan to where they leave it, or on demand; a plan that holds resets
    the count."""
    k = unkept - REPLAN_STREAK
    return k < 0 or k & (k + 1) == 0


def after_step(facts: StepFacts, state: PlanState | None, settings: Settings) -> Decision:
    """The one planning entry point after a step (the module docstring)."""
    if facts.form in ("plain", "anchored"):
        if not facts.kept:
            if state is not None and sizes_vary(state.plan.sequence):
                return Decision(unhook=True)   # per op, it leaves the plan where it grew: widened from there
            return Decision(drop=state is not None)
        return hook_ran(facts)
    if facts.form in ("recorded", "diverged"):
        seq = facts.sequence
        if facts.left is not None and facts.born_at is not None:
            wide = widened(seq, facts.born_at, *facts.left)
            if wide is not seq:   # sizes that only grow, toward a bound: planned whatever the streak
                try:
                    return Decision(plan=plan_recorded(wide, settings))
                except BudgetTooSmall:   # room the step's own sizes do not need: planned at those
                    return Decision(plan=plan_recorded(marked(seq), settings))
        if (facts.form == "diverged" and state is not None and state.plan.beside and not held_beside_of(seq)
                and facts.unkept <= 1):   # the recording step, then this one: not yet in a row
            return Decision(drop=True)   # the next step records whole, to be bounded again (beside.py)
        if facts.form == "diverged" and state is not None and state.hook_held:
            return Decision(hook_wins=True)   # its ops differ where its saves do not (hook_wins)
        if facts.form == "recorded" and facts.gaps is not None:   # asked for: Decision.trace
            return at_once(facts, plan_recorded(seq, settings), settings)
        if (facts.form == "diverged" and facts.may_trace and settings.hook_forms and state is not None
                and facts.unkept >= REPLAN_STREAK and plans_again(facts.unkept)):
            return Decision(drop=True, trace=True)
        if not plans_again(facts.unkept):
            return Decision()
        return Decision(plan=plan_recorded(marked(seq) if facts.founds else seq, settings))
    if state is None:   # a guess of another shape's plan: nothing to note of this one
        return Decision()
    if facts.signature and moves_nothing(state.plan):   # sizes that vary: bounded (HookTrace)
        return Decision(plain=True)
    # a GPU's per-op step times its ops on the device only while the prices are open: the
    # host's launch times of another step price nothing (no times: the prices settle)
    seconds = facts.seconds if facts.device_timed or not settings.gpu else ()
    priced = reprice(state, seconds, settings)
    if priced is not None and priced.plan is not None:   # a new plan: its form comes after its runs
        return priced
    hook = hook_form(facts, dataclasses.replace(state, **_priced(priced)), settings)
    return dataclasses.replace(priced or Decision(), **hook)


def _priced(decision: Decision | None) -> dict:
    if decision is None or decision.priced_runs is None:
        return {}
    return {"priced_runs": decision.priced_runs, "fastest": decision.fastest}


def plan_recorded(seq: VariableSequence, settings: Settings) -> Schedule:
    """The plan of a recorded step: swap only where asked, activations in whole chunks (they
    come back into pool ranges of whole chunks), planned and checked."""
    if settings.recompute == "never":   # swap only: no function may be replayed
        seq = mark_replayable(seq, lambda f: {})
    return plan(round_activations(seq, settings.chunk), settings)


def plan(seq: VariableSequence, settings: Settings) -> Schedule:
    """``plan`` with the engine's budget, policy, pins and pricing, checked (through
    ``scheduler.plan``, the package's name: tests put another planner there)."""
    options: dict = ({"recompute": "prefer"} if settings.recompute == "prefer" and settings.policy == "window"
                     else {})
    if settings.hardware is not None and settings.policy in ("window", "milp"):
        options["hardware"] = settings.hardware(seq)
    if settings.pins is not None:
        options["pins"] = settings.pins(seq)
    budget, beside = settings.budget, held_beside_of(seq) if settings.device_budget else ()
    if beside and settings.policy == "window":   # bounded by the step's budget less what it holds (beside.py)
        budget, options["beside"] = settings.device_budget, beside
    try:
        schedule = scheduler.plan(seq, budget=budget, window=settings.window, policy=settings.policy,
                                 **options)
    except BudgetTooSmall as err:
        kept = [v for v, p in options.get("pins", {}).items() if p == "keep"]
        if kept:
            err.add_note(f"ooc: pin keeps {len(kept)} activations "
                         f"({format_size(sum(seq.variables[v].nbytes for v in kept))}) on the device")
        raise
    scheduler.check(schedule)
    return schedule


def reprice(state: PlanState, seconds: Sequence[float], settings: Settings) -> Decision | None:
    """After each of a plan's first ``REPRICED_RUNS`` planned runs: the plan again, each op
    priced at the fastest of its runs so far (``priced_seconds``). None: nothing to do (not
    re-priced: swap only, another policy, a plan that moves nothing, prices settled)."""
    schedule = state.plan
    if not prices_open(schedule, state.priced_runs, settings):
        return None
    fastest = state.fastest or schedule.sequence
    seq = priced_seconds(fastest, seconds)
    if seq is None:   # the runs do not line up, or the recording was not timed
        return Decision(priced_runs=REPRICED_RUNS, fastest=fastest)
    runs = state.priced_runs + 1
    try:
        new = plan(seq, settings)
    except BudgetTooSmall:   # costs do not change what fits; keep the plan that ran
        return Decision(priced_runs=runs, fastest=seq)
    if _bytes(new) == _bytes(schedule):   # the same decisions: keep running the plan that runs
        return Decision(priced_runs=runs, fastest=seq)
    return Decision(plan=new, repriced=True, priced_runs=runs, fastest=seq)


def prices_open(schedule: Schedule, priced_runs: int, settings: Settings) -> bool:
    """Whether the next planned run of ``schedule`` prices it again (``reprice``), after
    ``priced_runs`` such runs: a plan that moves bytes and may recompute, under a policy that
    prices, for ``REPRICED_RUNS`` runs. On a GPU those runs time their ops (CUDA events)."""
    return (settings.reprice and settings.policy in ("window", "milp") and settings.recompute != "never"
            and priced_runs < REPRICED_RUNS and not moves_nothing(schedule))


def at_settled_prices(state: PlanState) -> Schedule:
    """The plan with each op at the fastest time its runs measured (``PlanState.fastest``): a
    plan kept through re-pricing (the same bytes) still carries its recording's times, too high
    to anchor it on or to predict its step with."""
    if state.fastest is None or state.fastest is state.plan.sequence:
        return state.plan
    return dataclasses.replace(state.plan, sequence=state.fastest)


def hook_form(facts: StepFacts, state: PlanState, settings: Settings) -> dict:
    """The fields of a ``Decision`` that give a kept plan its anchored form (or time the
    per-op side of its trial): a plan that moves bytes, planned again with the chains the
    step's templates rerun (``facts.ready``) or swap only where it has none or that does not
    fit (its prices settled), of a step that ran it whole (a micro-batch that ended before its plan's update
    proved part of it: an anchored step would not see the ops it missed) and did not time its
    ops on the device (its wall time would stand for the per-op side). On a GPU a form the
    simulator predicts far slower than the per-op plan gets none (``worth_a_trial``)."""
    if (facts.gaps is None or not settings.hook_forms or moves_nothing(state.plan) or settings.policy != "window"
            or settings.pins is not None or settings.recompute == "prefer"
            or not facts.ran_whole_plan):
        return {}
    if state.hook is not None:
        return {"trial": "per_op"}
    if prices_open(state.plan, state.priced_runs, settings):
        return {}   # the plan may still change with its prices
    if facts.device_timed:
        return {}   # the next, untimed, step decides: its wall time is the per-op side's
    priced = at_settled_prices(state)
    moved = None
    if facts.ready and state.plan.bytes_recomputed and not sizes_vary(state.plan.sequence):   # templates' chains
        seq = mark_replayable(priced.sequence, lambda f: None if f.index in facts.ready else {})
        hw = settings.hardware(priced.sequence) if settings.hardware is not None else None
        moved = anchor_within_budget(dataclasses.replace(priced, sequence=seq), facts.gaps, facts.first or {},
                                     budget=settings.budget, chunk=settings.chunk, window=settings.window,
                                     policy=settings.policy, hardware=hw, recompute=True, ready=facts.ready)
    if moved is None:   # swap only
        moved = anchor_within_budget(priced, facts.gaps, facts.first or {}, budget=settings.budget,
                                     chunk=settings.chunk, window=settings.window, policy=settings.policy)
    if (moved is not None and settings.gpu and settings.hardware is not None
            and not worth_a_trial(moved, priced, facts.step_s, settings.hardware(priced.sequence))):
        moved = None   # a GPU's form predicted far slower: no trial steps, no pool for them
    return {"anchored": True, "moved": moved}


def at_once(facts: StepFacts, schedule: Schedule, settings: Settings) -> Decision:
    """``schedule``, planned from a recording that noted its hook trace, with its anchored form
    made at once at the recording's prices (swap only: a recording captures no template)."""
    return Decision(plan=schedule, **hook_form(dataclasses.replace(facts, ran_whole_plan=True),
                                               PlanState(schedule, priced_runs=REPRICED_RUNS), settings))


def hook_ran(facts: StepFacts) -> Decision:
    """A hook-driven step that kept to its plan. A plain one has no trial (its saves alone
    guard it). An anchored one is timed for its trial if it did what the per-op steps it is
    timed against did (the update, or not); one that ran an update its trace's step did not
    (gradient accumulation: the plan was made from a micro-batch) ran ops no plan has proven:
    the plan loses its anchored form, the per-op path takes that state back, and its next
    update step diverges there and plans from a step that updates."""
    if facts.form == "plain":
        return Decision()
    if facts.updated and facts.update is None:
        return Decision(unhook=True)
    if facts.updated == (facts.update is not None):
        return Decision(trial="hook")
    return Decision()


def hook_forms_allowed(*, activations_only: bool, enabled: bool) -> bool:
    """Whether an engine's plans may take a hook-driven form at all (``Options.hook_steps``:
    ``enabled``), on a CPU or a GPU alike: with activations managed only. Managed parameters,
    gradients or optimizer state need the per-op path to be brought back and released."""
    return enabled and activations_only


def plain_candidate(schedule: Schedule | None, *, hook_forms: bool) -> bool:
    """Whether a step of ``schedule`` should note what it saves (``Stepper.signature``): its
    plan moves nothing, so it could run with no op intercepted (``hook_form``: plain)."""
    return hook_forms and schedule is not None and moves_nothing(schedule)


def keeps_saved(held: int, nbytes: int, budget: int) -> bool:
    """A step that left its plan (no per-op path to make room): a tensor autograd saves is
    kept while the step's saved bytes stay within the budget, else written to the tier at once."""
    return held + nbytes <= budget


def moves_nothing(schedule: Schedule) -> bool:
    """Whether ``schedule`` has nothing to do: no byte moved, none recomputed."""
    return not (schedule.bytes_in or schedule.bytes_out or schedule.bytes_recomputed)


def priced_seconds(seq: VariableSequence, seconds: Sequence[float]) -> VariableSequence | None:
    """``seq`` with each function's measured seconds the smaller of its own and ``seconds[i]``
    (a later run of the same ops); None when the runs do not line up (another op count) or
    ``seq`` was not timed. The smaller: an op's time only ever grows by what ran beside it
    (cold pages, I/O threads, the host), and the planner charges those separately."""
    if len(seconds) != len(seq.functions) or any(f.cost.seconds is None for f in seq.functions):
        return None
    functions = tuple(
        dataclasses.replace(f, cost=dataclasses.replace(f.cost, seconds=min(f.cost.seconds, t)))
        for f, t in zip(seq.functions, seconds))
    return VariableSequence(functions, seq.variables, seq.meta)


def round_activations(seq: VariableSequence, chunk: int) -> VariableSequence:
    """Activations come back into pool ranges of whole chunks: plan with those sizes."""
    variables = {
        v: (Variable(x.id, -(-x.nbytes // chunk) * chunk, x.kind, x.name, x.live_in, x.live_out)
            if x.kind is Kind.ACTIVATION else x)
        for v, x in seq.variables.items()}
    return VariableSequence(seq.functions, variables, seq.meta)


def _bytes(schedule: Schedule) -> tuple[int, int, int]:
    return schedule.bytes_in, schedule.bytes_out, schedule.bytes_recomputed
