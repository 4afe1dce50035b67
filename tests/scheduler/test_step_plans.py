"""The one planning entry point after a step (``scheduler.step_plans``): plain data in, a
decision out, the same decisions the engine made itself before (benchmarks/dump_plans.py
compares them on the zoo)."""

from __future__ import annotations

import dataclasses

import scheduler
from scheduler import plan
from scheduler.anchoring import MARGIN, TRIAL_RUNS, judge
from scheduler.step_plans import (REPRICED_RUNS, Decision, PlanState, Settings, StepFacts, after_step,
                                  hook_forms_allowed, keeps_saved, moves_nothing, plain_candidate, plan_recorded,
                                  prices_open, priced_seconds, at_settled_prices)
from scheduler.schedule import quiet_functions
from tests.scheduler.strategies import training_like_sequence


def _timed(seq, seconds: float):
    functions = tuple(dataclasses.replace(f, cost=dataclasses.replace(f.cost, seconds=seconds))
                      for f in seq.functions)
    return dataclasses.replace(seq, functions=functions)


SEQ = _timed(training_like_sequence(8), 1e-3)
TIGHT = Settings(budget=SEQ.in_core_peak_bytes // 2, chunk=1 << 16, window=None)


def test_a_recorded_or_diverged_step_is_planned_from_its_recording() -> None:
    for form in ("recorded", "diverged"):
        d = after_step(StepFacts(form, False, 1.0, sequence=SEQ), None, TIGHT)
        assert d.plan is not None and not d.repriced and not d.drop
        assert d.plan.peak_resident_bytes <= TIGHT.budget and not moves_nothing(d.plan)
    never = plan_recorded(SEQ, dataclasses.replace(TIGHT, recompute="never"))
    assert never.bytes_recomputed == 0


def test_a_hook_driven_step_is_timed_if_it_kept_its_plan_else_its_plan_goes() -> None:
    state = PlanState(plan_recorded(SEQ, TIGHT))
    assert after_step(StepFacts("anchored", True, 1.0), state, TIGHT).trial == "hook"
    assert after_step(StepFacts("plain", False, 1.0), state, TIGHT).drop
    assert not after_step(StepFacts("anchored", False, 1.0), None, TIGHT).drop   # a guess's plan


def test_an_anchored_step_is_timed_only_if_it_did_what_its_traces_step_did() -> None:
    state = PlanState(plan_recorded(SEQ, TIGHT))

    def after(updated: bool, update: int | None, form: str = "anchored"):
        return after_step(StepFacts(form, True, 1.0, updated=updated, update=update), state, TIGHT)

    assert after(True, 40).trial == "hook" and after(False, None).trial == "hook"
    # an update its trace's step did not run (a plan made from a micro-batch): per op from now on
    d = after(True, None)
    assert d.unhook and d.trial is None and not d.drop
    # no update where its trace's step ran one (a micro-batch of a plan made with the update): not timed
    d = after(False, 40)
    assert d.trial is None and not d.unhook and not d.drop
    # a plain step has no trial, whatever it ran
    assert after(True, None, "plain") == after(False, 40, "plain") == Decision()


def test_hook_driven_forms_only_with_activations_alone_and_a_plan_that_moves_nothing_is_plain() -> None:
    assert hook_forms_allowed(activations_only=True, enabled=True)
    for off in ({"activations_only": False}, {"enabled": False}):
        assert not hook_forms_allowed(**{"activations_only": True, "enabled": True, **off})
    roomy = plan_recorded(SEQ, dataclasses.replace(TIGHT, budget=SEQ.in_core_peak_bytes * 2))
    tight = plan_recorded(SEQ, TIGHT)
    assert plain_candidate(roomy, hook_forms=True)
    assert not plain_candidate(roomy, hook_forms=False)
    assert not plain_candidate(tight, hook_forms=True) and not plain_candidate(None, hook_forms=True)


def test_a_plan_that_moves_nothing_gets_its_plain_form_and_no_price() -> None:
    roomy = dataclasses.replace(TIGHT, budget=SEQ.in_core_peak_bytes * 2)
    state = PlanState(plan_recorded(SEQ, roomy))
    d = after_step(StepFacts("planned", True, 1.0, seconds=[1e-4] * len(SEQ.functions), signature=True),
                   state, roomy)
    assert d.plain and d.plan is None and d.priced_runs is None


def test_prices_settle_after_the_repriced_runs_then_the_anchored_form_is_made() -> None:
    state = PlanState(plan_recorded(SEQ, TIGHT))
    gaps = set(range(len(SEQ.functions) + 1))
    facts = StepFacts("planned", True, 1.0, seconds=[1e-3] * len(SEQ.functions), ran_whole_plan=True,
                      gaps=gaps, first={})
    for run in range(1, REPRICED_RUNS + 1):
        d = after_step(facts, state, TIGHT)
        assert d.priced_runs == run
        assert d.anchored == (run == REPRICED_RUNS), "no form while the prices may change"
        state = dataclasses.replace(state, priced_runs=d.priced_runs, fastest=d.fastest,
                                    plan=d.plan or state.plan)
    assert d.moved is not None and d.moved.peak_resident_bytes <= TIGHT.budget   # every gap an anchor
    assert after_step(facts, state, TIGHT).priced_runs is None   # settled
    d = after_step(facts, dataclasses.replace(state, hook="kept"), TIGHT)
    assert d.trial == "per_op" and not d.anchored
    part = dataclasses.replace(facts, ran_whole_plan=False)   # a micro-batch: no form
    assert not after_step(part, state, TIGHT).anchored


def test_a_plan_never_re_priced_gets_its_anchored_form_after_its_first_run() -> None:
    """Prices off (``reprice=False``): settled from the start, so the first planned run that
    kept to the plan makes the anchored form (waiting for re-priced runs that never come, no
    such plan under "auto" would ever have one)."""
    fixed = dataclasses.replace(TIGHT, reprice=False, gpu=True)
    state = PlanState(plan_recorded(SEQ, fixed))
    facts = StepFacts("planned", True, 1.0, seconds=[1e-3] * len(SEQ.functions), ran_whole_plan=True,
                      gaps=set(range(len(SEQ.functions) + 1)), first={})
    d = after_step(facts, state, fixed)
    assert d.anchored and d.priced_runs is None and d.moved is not None
    assert not after_step(facts, state, TIGHT).anchored   # prices on: the plan waits for them
    assert not after_step(facts, state, dataclasses.replace(fixed, recompute="prefer")).anchored


def test_the_anchored_form_is_made_at_the_settled_prices_of_a_plan_kept_through_them() -> None:
    """A plan that re-pricing kept (the same bytes) still carries its recording's op times: its
    anchored form is planned, and on a GPU judged, at the fastest times its runs measured."""
    state = PlanState(plan_recorded(SEQ, TIGHT))
    fastest = priced_seconds(state.plan.sequence, [1e-6] * len(SEQ.functions))
    settled = dataclasses.replace(state, priced_runs=REPRICED_RUNS, fastest=fastest)
    assert at_settled_prices(state) is state.plan
    assert at_settled_prices(settled).sequence is fastest and at_settled_prices(settled).before == state.plan.before
    facts = StepFacts("planned", True, 1.0, seconds=[1e-6] * len(SEQ.functions), ran_whole_plan=True,
                      gaps=set(range(len(SEQ.functions) + 1)), first={})
    d = after_step(facts, settled, TIGHT)
    assert d.anchored and d.moved is not None
    assert [f.cost.seconds for f in d.moved.sequence.functions] == [1e-6] * len(SEQ.functions)


def test_a_gpu_plan_is_priced_on_its_timed_runs_and_gets_its_form_at_an_untimed_one() -> None:
    """On a GPU the recording step's CUDA-event times ran on a cold allocator: the plan's first
    REPRICED_RUNS planned runs time their ops (``device_timed``) and price it again, as a
    CPU's do; the form is made at the first untimed run (a timed run's wall time, slowed by
    the timing, would stand for the per-op side). An untimed run's times are the host's
    launches: they price nothing, and the prices settle."""
    gpu = dataclasses.replace(TIGHT, gpu=True)
    state = PlanState(plan_recorded(SEQ, gpu))
    assert prices_open(state.plan, 0, gpu) and not prices_open(state.plan, REPRICED_RUNS, gpu)
    assert not prices_open(state.plan, 0, dataclasses.replace(gpu, recompute="never"))
    gaps = set(range(len(SEQ.functions) + 1))
    timed = StepFacts("planned", True, 9.0, seconds=[1e-3] * len(SEQ.functions), ran_whole_plan=True,
                      gaps=gaps, first={}, device_timed=True)
    for run in range(1, REPRICED_RUNS + 1):
        d = after_step(timed, state, gpu)
        assert d.priced_runs == run and not d.anchored, "no form on a timed run"
        state = dataclasses.replace(state, priced_runs=d.priced_runs, fastest=d.fastest, plan=d.plan or state.plan)
    untimed = dataclasses.replace(timed, device_timed=False, step_s=1.0)
    d = after_step(untimed, state, gpu)
    assert d.priced_runs is None and d.anchored and d.moved is not None
    # an untimed run while the prices are open (launch times, far below the ops' run times)
    launches = dataclasses.replace(untimed, seconds=[1e-9] * len(SEQ.functions))
    d = after_step(launches, PlanState(plan_recorded(SEQ, gpu)), gpu)
    assert d.plan is None and d.priced_runs == REPRICED_RUNS and d.anchored
    cpu = after_step(launches, PlanState(plan_recorded(SEQ, TIGHT)), TIGHT)   # a CPU's are its ops'
    assert cpu.priced_runs == 1


def test_quiet_functions_have_no_role_in_the_plan() -> None:
    """No action around them, no variable used, in no recompute chain, not where the runtime
    binds a variable; every other function is looked at."""
    n = len(SEQ.functions)   # ops that use no variable, between the training-like ones
    loose = [dataclasses.replace(f, index=2 * i, uses=f.uses) for i, f in enumerate(SEQ.functions)]
    loose = [g for i, f in enumerate(loose) for g in (f, dataclasses.replace(f, index=2 * i + 1, name="aten.view", uses=()))]
    seq = dataclasses.replace(SEQ, functions=tuple(loose))
    assert len(seq.functions) == 2 * n
    for recompute in ("never", "prefer"):
        schedule = plan_recorded(seq, dataclasses.replace(TIGHT, recompute=recompute))
        chained = {w for actions in schedule.before for a in actions for w in a.chain}
        quiet = quiet_functions(schedule)
        for i, f in enumerate(schedule.sequence.functions):
            role = bool(f.uses or schedule.before[i] or schedule.after[i] or i in chained)
            assert (i in quiet) != role, (recompute, i, f.name)
        assert quiet and len(quiet) < len(schedule.sequence.functions)
        made = set(list(quiet)[:2])
        assert quiet_functions(schedule, made) == quiet - made


def test_priced_seconds_takes_the_faster_of_each_op_and_refuses_another_op_count() -> None:
    faster = priced_seconds(SEQ, [5e-4] * len(SEQ.functions))
    assert all(f.cost.seconds == 5e-4 for f in faster.functions)
    slower = priced_seconds(SEQ, [2e-3] * len(SEQ.functions))
    assert all(f.cost.seconds == 1e-3 for f in slower.functions)
    assert priced_seconds(SEQ, [1e-3]) is None


def test_the_trial_and_the_spill_rule() -> None:
    assert judge([1.0], [2.0], moved=1, planned=1) is None   # not TRIAL_RUNS each yet
    runs = TRIAL_RUNS
    assert judge([1.0] * runs, [1.0] * runs, moved=1, planned=1) is True
    assert judge([1.0] * runs, [1.0] * runs, moved=2, planned=1) is False   # more bytes: MARGIN faster
    assert judge([1.0 - 2 * MARGIN] * runs, [1.0] * runs, moved=2, planned=1) is True
    assert keeps_saved(60, 40, 100) and not keeps_saved(61, 40, 100)
    assert plan(SEQ, budget=SEQ.in_core_peak_bytes * 2).bytes_out == 0


def test_a_gpu_plan_gets_no_anchored_form_predicted_far_slower_than_its_per_op_steps() -> None:
    """On a GPU the anchored form is tried only if the simulator does not predict it
    TRIAL_SLOWER slower than the per-op plan, whose time is the slower of its prediction and
    its measured run: a host-bound per-op step (measured far above its prediction) still gets
    its trial. ResNet-50's H100 profile at half its managed peak: the per-op plan recomputes,
    its anchored form swaps only (on the H100 every such trial of ResNet-50 lost)."""
    from pathlib import Path

    from scheduler.anchoring import TRIAL_SLOWER
    from scheduler.ir import VariableSequence
    from scheduler.managed import managed_view
    from scheduler.recompute import default_hardware

    profile = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "h100" / "resnet50.json"
    seq = managed_view(VariableSequence.from_json(profile))
    gpu = Settings(budget=seq.in_core_peak_bytes // 2, chunk=2 << 20, window=None, reprice=False,
                   hardware=default_hardware, gpu=True)
    state = PlanState(plan_recorded(seq, gpu))
    assert state.plan.bytes_recomputed > 0
    hw = default_hardware(seq)
    per_op = scheduler.simulate(state.plan, hw, timeline=False).total_s
    gaps = set(range(len(seq.functions) + 1))

    def decided(step_s: float, settings: Settings = gpu) -> Decision:
        facts = StepFacts("planned", True, step_s, seconds=[f.cost.seconds for f in seq.functions],
                          ran_whole_plan=True, gaps=gaps, first={})
        return after_step(facts, state, settings)

    measured = decided(per_op)   # the per-op step ran as predicted: its swap-only form would lose
    assert measured.anchored and measured.moved is None
    host_bound = decided(10 * per_op).moved   # per-op steps bound by the host: the form is tried
    assert host_bound is not None and host_bound.bytes_recomputed == 0
    assert scheduler.simulate(host_bound, hw, timeline=False).total_s > per_op * TRIAL_SLOWER
    assert decided(per_op, dataclasses.replace(gpu, hardware=None)).moved is not None   # no prices: tried


def test_with_templates_the_anchored_form_keeps_the_chains_they_rerun() -> None:
    """A step that captured templates (``StepFacts.ready``: the functions a hook-driven step can
    rerun, each with the gap from which it holds what it reads) gives its plan an anchored form
    that recomputes with those functions alone, on the device's prices, and discards no earlier
    than that gap; without templates the form swaps only. ResNet-50's H100 profile at half its
    managed peak, every op a hook: its per-op plan recomputes, and so does its anchored form,
    predicted within TRIAL_SLOWER of the per-op plan (the swap-only form is not:
    ``test_a_gpu_plan_gets_no_anchored_form_predicted_far_slower_than_its_per_op_steps``)."""
    from pathlib import Path

    from scheduler.anchoring import TRIAL_SLOWER
    from scheduler.ir import VariableSequence
    from scheduler.managed import managed_view
    from scheduler.actions import Op
    from scheduler.recompute import default_hardware
    from scheduler.schedule import Schedule

    profile = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "h100" / "resnet50.json"
    seq = managed_view(VariableSequence.from_json(profile))
    gpu = Settings(budget=seq.in_core_peak_bytes // 2, chunk=2 << 20, window=None, reprice=False,
                   hardware=default_hardware, gpu=True)
    state = PlanState(plan_recorded(seq, gpu))
    chained = {w for actions in state.plan.before for a in actions for w in a.chain}
    assert chained
    n = len(seq.functions)

    def decided(ready: dict[int, int] | None) -> Schedule | None:
        facts = StepFacts("planned", True, 1.0, seconds=[f.cost.seconds for f in seq.functions],
                          ran_whole_plan=True, gaps=set(range(n + 1)), first={}, ready=ready)
        return after_step(facts, state, gpu).moved

    moved = decided({w: w + 1 for w in chained})   # each template's reads saved by its own op
    assert moved is not None and moved.bytes_recomputed > 0
    scheduler.check(moved)
    assert {w for actions in moved.before for a in actions for w in a.chain} <= chained
    per_op = scheduler.simulate(state.plan, default_hardware(seq), timeline=False).total_s
    assert scheduler.simulate(moved, default_hardware(seq), timeline=False).total_s <= per_op * TRIAL_SLOWER
    late = n // 2   # every template holds what it reads only from the middle of the step on
    held = decided({w: late for w in chained})
    assert held is not None
    discards = [g for g in range(n) for a in held.before[g] if a.op is Op.DISCARD]
    assert discards and min(discards) >= late
    assert decided(None) is None or decided(None).bytes_recomputed == 0   # no templates: swap only


def test_steps_that_keep_no_plan_are_planned_from_at_doubling_intervals() -> None:
    """``plans_again``: the first ``REPLAN_STREAK`` + 2 unkept steps in a row are planned from
    (a plan diverging once or twice before it holds is the usual warm-up), then the 7th,
    11th, 19th, 35th: a model whose ops change at random stops costing a plan per step."""
    from scheduler.step_plans import REPLAN_STREAK, plans_again

    assert [n for n in range(40) if plans_again(n)] == [0, 1, 2, 3, 4, 6, 10, 18, 34]
    assert all(plans_again(n) for n in range(REPLAN_STREAK))


def test_a_per_op_step_that_leaves_a_plan_whose_anchored_steps_held_ends_the_trial_for_them() -> None:
    """A forward that runs other ops from step to step but saves the same tensors (a decoder
    fed the targets or its own argmax, chosen per batch) leaves the per-op plan at every change
    and holds to its anchored form: planned from again, each such step made a plan the next
    one left, and no form settled. Before any anchored step held, it is planned from."""
    state = PlanState(plan_recorded(SEQ, TIGHT), hook="kept", hook_held=1)
    d = after_step(StepFacts("diverged", False, 1.0, sequence=SEQ), state, TIGHT)
    assert d == Decision(hook_wins=True)
    d = after_step(StepFacts("diverged", False, 1.0, sequence=SEQ), dataclasses.replace(state, hook_held=0), TIGHT)
    assert d.plan is not None and not d.hook_wins
    d = after_step(StepFacts("recorded", False, 1.0, sequence=SEQ), state, TIGHT)   # not a step of the plan
    assert d.plan is not None and not d.hook_wins


def test_a_streak_of_steps_that_keep_no_plan_records_once_with_its_trace_and_forms_at_once() -> None:
    """Per-op steps that never keep to a plan (ops drawn per step: teacher forcing per token)
    never made an anchored form. The streak's first re-plan drops the plan and asks the next
    step to record with its hook trace (``trace``), once per plan key (``may_trace``); that
    recording's plan gets its anchored form at once, at the recording's prices."""
    from scheduler.step_plans import REPLAN_STREAK

    state = PlanState(plan_recorded(SEQ, TIGHT))
    left = StepFacts("diverged", False, 1.0, sequence=SEQ, unkept=REPLAN_STREAK, may_trace=True)
    assert after_step(left, state, TIGHT) == Decision(drop=True, trace=True)
    assert after_step(dataclasses.replace(left, unkept=REPLAN_STREAK - 1), state, TIGHT).plan is not None
    assert after_step(dataclasses.replace(left, may_trace=False), state, TIGHT).plan is not None   # tried once
    assert after_step(left, state, dataclasses.replace(TIGHT, hook_forms=False)).plan is not None
    traced = StepFacts("recorded", False, 1.0, sequence=SEQ, gaps=set(range(len(SEQ.functions) + 1)), first={})
    d = after_step(traced, None, TIGHT)
    assert d.plan is not None and d.anchored and d.moved is not None
    assert d.moved.peak_resident_bytes <= TIGHT.budget
    d = after_step(dataclasses.replace(traced, gaps=None), None, TIGHT)   # a recording not asked to trace
    assert d.plan is not None and not d.anchored
