"""plan(): every policy's schedule is safe, "window" moves only what the budget forces out
(and less than the paper's scheduler), budgets below the minimum fail with a true minimum."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Action, BudgetTooSmall, Cost, Kind, Op, Schedule, Variable, build_sequence
from scheduler.baselines import backward_start
from scheduler.check import check
from scheduler.planner import POLICIES, plan
from scheduler.window import default_window, working_sets
from strategies import sequences, training_like_sequence, training_sequences

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _moved(s: Schedule) -> int:
    return s.bytes_in + s.bytes_out


def _ops(s: Schedule, op: Op) -> list[int]:
    return [a.var for lists in (s.before, s.after) for acts in lists for a in acts if a.op is op]


def _budgets(seq) -> list[int]:
    ws = max(working_sets(seq), default=0)
    peak = seq.in_core_peak_bytes
    return sorted({max(1, ws), max(1, (ws + peak) // 2), max(1, peak), peak + 7})


# -- safety on random sequences -------------------------------------------------------------------


@FAST
@given(sequences(), st.sampled_from(POLICIES))
def test_every_policy_returns_checked_schedules_from_the_minimum_up(seq, policy) -> None:
    ws = max(working_sets(seq), default=0)
    for budget in _budgets(seq):
        try:
            s = plan(seq, budget, policy=policy)
        except BudgetTooSmall as err:
            # The window planners fit any budget that holds the largest working set; the
            # baselines' fixed rules may need more, and then say how much.
            assert policy not in ("window", "window-paper"), err
            assert err.minimum > budget and err.budget == budget
            s = plan(seq, err.minimum, policy=policy)
            assert check(s).peak_bytes == err.minimum
            continue
        r = check(s)
        assert r.peak_bytes <= budget == s.budget
        assert s.policy == policy
        # Nothing in flight at the end, and the start state comes back (check proves it;
        # here, independently: every swap-in has a wait_in, every swap-out a wait_out).
        assert sorted(_ops(s, Op.SWAP_IN)) == sorted(_ops(s, Op.WAIT_IN))
        assert sorted(_ops(s, Op.SWAP_OUT)) == sorted(_ops(s, Op.WAIT_OUT))
    if ws > 1:
        with pytest.raises(BudgetTooSmall) as info:
            plan(seq, ws - 1, policy=policy)
        assert info.value.minimum >= ws


@FAST
@given(sequences())
def test_window_moves_nothing_when_the_step_fits(seq) -> None:
    for budget in (max(1, seq.in_core_peak_bytes), seq.in_core_peak_bytes + 100):
        s = plan(seq, budget)
        assert _moved(s) == 0
        assert not _ops(s, Op.DROP) and not _ops(s, Op.WAIT_OUT)
        needed = {v for v, var in seq.variables.items() if var.live_in and (seq.uses_of[v] or var.live_out)}
        assert s.initial_resident == needed
        assert check(s).resident_bytes == seq.live_bytes


@FAST
@given(sequences(), st.sampled_from(POLICIES), st.data())
def test_plan_is_deterministic(seq, policy, data) -> None:
    budget = max(1, data.draw(st.sampled_from(_budgets(seq))))
    try:
        first = plan(seq, budget, policy=policy)
    except BudgetTooSmall as err:
        with pytest.raises(BudgetTooSmall) as again:
            plan(seq, budget, policy=policy)
        assert str(again.value) == str(err)
        return
    second = plan(seq, budget, policy=policy)
    assert first == second and first.to_dict() == second.to_dict()


# -- the minimum budget ------------------------------------------------------------------------------


@FAST
@given(sequences(), st.sampled_from(["window", "window-paper"]))
def test_window_minimum_is_the_largest_working_set(seq, policy) -> None:
    sizes = working_sets(seq)
    ws = max(sizes)
    if ws <= 1:
        return
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, ws - 1, policy=policy)
    err = info.value
    assert err.minimum == ws and err.budget == ws - 1
    assert err.function == next(i for i, b in enumerate(sizes) if b > ws - 1)
    assert err.working_set == sizes[err.function] and err.name == seq.functions[err.function].name
    assert "raise the budget to at least" in str(err) and f"({ws} B)" in str(err)
    assert check(plan(seq, err.minimum, policy=policy)).peak_bytes <= ws


def test_budget_too_small_names_the_function() -> None:
    seq = training_like_sequence(4, act_bytes=1000, param_bytes=10)
    big = max(range(len(seq.functions)), key=working_sets(seq).__getitem__)
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, 100)
    err = info.value
    assert err.function <= big and err.working_set > 100
    assert f"function {err.function} ({seq.functions[err.function].name})" in str(err)


def test_budget_too_small_explains_a_minimum_above_the_named_functions_needs() -> None:
    """The first function over the budget is named, the step's largest working set sets the
    minimum: the message said "needs 8 MiB ... at least 16 MiB" as if the two disagreed."""
    mib = 1 << 20
    seq = build_sequence([("small", [(0, "w")], Cost()), ("large", [(0, "r"), (1, "w")], Cost())],
                         [Variable(0, 8 * mib, Kind.ACTIVATION, name="a"),
                          Variable(1, 8 * mib, Kind.ACTIVATION, name="b")])
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, 4 * mib)
    err = info.value
    assert (err.function, err.working_set, err.minimum) == (0, 8 * mib, 16 * mib)
    assert "the step as a whole needs more" in str(err)
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, 12 * mib)
    assert info.value.working_set == info.value.minimum == 16 * mib
    assert "as a whole" not in str(info.value)  # one figure, nothing to explain


def test_baselines_report_their_own_peak_as_minimum() -> None:
    seq = training_like_sequence(8, act_bytes=1000, param_bytes=10)
    ws = max(working_sets(seq))
    for policy in ("none", "vdnn", "lms"):
        with pytest.raises(BudgetTooSmall) as info:
            plan(seq, ws, policy=policy)
        err = info.value
        assert err.minimum > ws and err.working_set > ws
        assert check(plan(seq, err.minimum, policy=policy)).peak_bytes == err.minimum
        with pytest.raises(BudgetTooSmall):
            plan(seq, err.minimum - 1, policy=policy)
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, ws, policy="none")
    assert info.value.minimum == seq.in_core_peak_bytes


# -- window vs window-paper on training-like sequences ----------------------------------------------


@pytest.mark.parametrize("style", ["cnn", "transformer"])
@pytest.mark.parametrize("param_bytes", [1 << 10, 1 << 16])
def test_window_moves_fewer_bytes_than_the_paper(style, param_bytes) -> None:
    seq = training_like_sequence(24, style=style, param_bytes=param_bytes)
    for fraction in (2, 4):
        budget = seq.in_core_peak_bytes // fraction
        ours = plan(seq, budget)
        paper = plan(seq, budget, policy="window-paper")
        assert 0 < _moved(ours) < _moved(paper), (fraction, _moved(ours), _moved(paper))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_sequences(), st.sampled_from([2, 3, 4, 8]))
def test_window_never_moves_more_than_the_paper_on_training_steps(seq, fraction) -> None:
    budget = max(max(working_sets(seq)), seq.in_core_peak_bytes // fraction)
    assert _moved(plan(seq, budget)) <= _moved(plan(seq, budget, policy="window-paper"))


def test_paper_scheduler_moves_parameters_even_when_everything_fits() -> None:
    seq = training_like_sequence(6)
    paper = plan(seq, seq.in_core_peak_bytes)
    assert _moved(paper) == 0
    paper = plan(seq, seq.in_core_peak_bytes, policy="window-paper")
    assert paper.initial_resident == frozenset() and paper.window == default_window(seq.in_core_peak_bytes)
    params = {v for v, var in seq.variables.items() if var.kind is Kind.PARAM}
    assert params <= set(_ops(paper, Op.SWAP_IN)) and params <= set(_ops(paper, Op.SWAP_OUT))


def test_window_keeps_the_last_activations_and_evicts_the_first() -> None:
    # Belady: the activations saved first in the forward are needed last in the backward.
    seq = training_like_sequence(16, style="transformer", param_bytes=64)
    s = plan(seq, seq.in_core_peak_bytes * 2 // 3)
    out = {seq.variables[v].name for v in _ops(s, Op.SWAP_OUT)}
    assert {"a0", "h0"} <= out
    assert not {"a15", "h15", "a14", "h14"} & out


def test_window_drops_clean_copies_instead_of_copying_them_out() -> None:
    # w is read-only in the step and too big to keep next to the activations: it comes in
    # from host memory, and its device copy is dropped, never copied back.
    seq = build_sequence(
        [("f0", [(1, "w")], Cost()), ("f1", [(1, "r"), (2, "w")], Cost()),
         ("f2", [(0, "r"), (2, "r")], Cost()), ("f3", [(2, "r"), (3, "w")], Cost()),
         ("f4", [(0, "r"), (3, "r")], Cost())],
        [Variable(0, 50, Kind.PARAM, "w", live_in=True, live_out=True),
         Variable(1, 40, Kind.ACTIVATION, "a"), Variable(2, 40, Kind.ACTIVATION, "b"),
         Variable(3, 40, Kind.ACTIVATION, "c")])
    s = plan(seq, 90)
    assert 0 not in s.initial_resident  # evicted before its first use: it starts in host memory
    assert _ops(s, Op.DROP) == [0, 0] and _ops(s, Op.SWAP_OUT) == []
    assert (s.bytes_in, s.bytes_out) == (100, 0)


def test_window_prefetches_within_the_window_only() -> None:
    seq = training_like_sequence(12, style="transformer", param_bytes=64)
    budget = seq.in_core_peak_bytes // 2
    wide = plan(seq, budget)
    narrow = plan(seq, budget, window=1)
    assert _moved(wide) == _moved(narrow)  # the window changes when, not what
    # With a one-byte window every swap-in is issued right before the function that waits.
    for i, acts in enumerate(narrow.before):
        ins = [a.var for a in acts if a.op is Op.SWAP_IN]
        waits = {a.var for a in acts if a.op is Op.WAIT_IN}
        assert set(ins) <= waits
    # With the default window some swap-ins are issued functions ahead of their wait.
    early = [a.var for acts in wide.before for a in acts
             if a.op is Op.SWAP_IN and Action(Op.WAIT_IN, a.var) not in acts]
    assert early


# -- baselines -------------------------------------------------------------------------------------


def test_vdnn_offloads_forward_activations_and_prefetches_one_ahead() -> None:
    seq = training_like_sequence(10, style="transformer", param_bytes=8)
    s = plan(seq, seq.in_core_peak_bytes, policy="vdnn")
    bs = seq.meta["backward_start"]
    outs = _ops(s, Op.SWAP_OUT)
    assert outs and all(seq.variables[v].kind is Kind.ACTIVATION for v in outs)
    for v in outs:
        (i_in,) = [i for i, acts in enumerate(s.before) for a in acts if a.op is Op.SWAP_IN and a.var == v]
        first_bwd = min(i for i in seq.uses_of[v] if i >= bs)
        assert i_in == first_bwd - 1
    # The heuristic finds the same boundary without the recorder's hint.
    bare = build_sequence([(f.name, [(u.var, u.access.value[0]) for u in f.uses], f.cost) for f in seq.functions],
                          seq.variables.values())
    assert bs <= backward_start(bare) <= bs + 2  # the first gradient created
    no_grads = build_sequence(
        [(f.name, [(u.var, u.access.value[0]) for u in f.uses], f.cost) for f in seq.functions],
        [Variable(v.id, v.nbytes, Kind.TEMPORARY if v.kind is Kind.GRAD else v.kind, v.name, v.live_in,
                  v.live_out) for v in seq.variables.values()])
    assert abs(backward_start(no_grads) - bs) <= 1  # where the live variables pile up most
    hinted = plan(bare, seq.in_core_peak_bytes, policy="vdnn", backward_start=bs)
    assert (hinted.before, hinted.after, hinted.initial_resident) == (s.before, s.after, s.initial_resident)


def test_lms_swaps_across_long_gaps_only() -> None:
    seq = training_like_sequence(10, style="transformer", param_bytes=8)
    none = plan(seq, seq.in_core_peak_bytes, policy="lms", swapout_threshold=len(seq.functions))
    assert _moved(none) == 0
    near = plan(seq, seq.in_core_peak_bytes, policy="lms", swapout_threshold=4, swapin_ahead=2)
    far = plan(seq, seq.in_core_peak_bytes, policy="lms", swapout_threshold=20)
    assert _moved(near) > _moved(far) > 0
    for v in _ops(near, Op.SWAP_IN):
        ins = [i for i, acts in enumerate(near.before) for a in acts if a.op is Op.SWAP_IN and a.var == v]
        waits = [i for i, acts in enumerate(near.before) for a in acts if a.op is Op.WAIT_IN and a.var == v]
        assert all(w - i <= 2 for i, w in zip(ins, waits))
    assert not {seq.variables[v].kind for v in _ops(near, Op.SWAP_OUT)} & {Kind.PARAM, Kind.OPTIMIZER_STATE}


def test_none_without_a_budget_uses_the_in_core_peak() -> None:
    seq = training_like_sequence(5)
    s = plan(seq, None, policy="none")
    assert s.budget == seq.in_core_peak_bytes and _moved(s) == 0 and s.window == 0


# -- arguments, JSON, empty steps, speed -------------------------------------------------------------


def test_arguments_are_checked() -> None:
    seq = training_like_sequence(2)
    with pytest.raises(ValueError, match="unknown policy 'best'.*window, window-paper, vdnn, lms, none"):
        plan(seq, 10**6, policy="best")
    with pytest.raises(TypeError, match="budget must be an int.*parse_size"):
        plan(seq, "16GiB")
    with pytest.raises(TypeError, match="budget must be an int"):
        plan(seq, 1.5e6)
    with pytest.raises(ValueError, match="budget must be positive"):
        plan(seq, 0)
    with pytest.raises(ValueError, match="needs a budget"):
        plan(seq, None)
    with pytest.raises(ValueError, match="window must be positive"):
        plan(seq, 10**6, window=-1)
    with pytest.raises(TypeError, match="does not take option.*swapin_ahead.*accepts: hardware"):
        plan(seq, 10**6, swapin_ahead=2)
    with pytest.raises(ValueError, match="swapin_ahead"):
        plan(seq, 10**6, policy="lms", swapin_ahead=-1)
    with pytest.raises(ValueError, match="swapout_threshold must be positive"):
        plan(seq, 10**6, policy="lms", swapout_threshold=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_schedule_json_round_trip(tmp_path, policy) -> None:
    seq = training_like_sequence(6, style="transformer", param_bytes=1 << 12)
    s = plan(seq, seq.in_core_peak_bytes * 2 // 3 if policy != "none" else seq.in_core_peak_bytes,
             policy=policy)
    path = tmp_path / "plan.json"
    s.to_json(path)
    back = Schedule.from_json(path)
    assert back == s
    assert check(back) == check(s)


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_and_trivial_sequences(policy) -> None:
    empty = build_sequence([], [Variable(0, 8, Kind.PARAM, "w", live_in=True, live_out=True)])
    s = plan(empty, 8, policy=policy)
    assert s.before == s.after == () and check(s).peak_bytes <= 8
    one = build_sequence([("f", [(0, "w")], Cost())], [Variable(0, 0, Kind.TEMPORARY, "t")])
    assert check(plan(one, 1, policy=policy)).peak_bytes == 0


def test_planning_a_large_step_logs(caplog) -> None:
    """~12k functions. Plan time against the sequence's length (a least-squares line) is
    benchmarks/bench_plan.py's: a bar on time here would fail on a slower machine."""
    seq = training_like_sequence(2000, style="transformer", act_bytes=1 << 16, param_bytes=1 << 12)
    with caplog.at_level(logging.INFO, logger="scheduler.planner"):
        s = plan(seq, seq.in_core_peak_bytes // 4)
    assert any("plan window" in r.getMessage() for r in caplog.records)
    assert _moved(s) > 0 and s.peak_resident_bytes <= s.budget


def test_a_planner_failing_above_the_working_set_reports_a_bisected_minimum(caplog) -> None:
    from scheduler.planner import _with_minimum
    from scheduler.window import Infeasible, plan_window

    seq = training_like_sequence(6, act_bytes=100, param_bytes=10)
    true_minimum = max(working_sets(seq)) + 37

    def fussy(budget: int) -> Schedule:  # a planner with a structural need above the working set
        if budget < true_minimum:
            raise Infeasible(5, true_minimum)
        return plan_window(seq, budget)

    assert check(_with_minimum(seq, true_minimum, fussy)).peak_bytes <= true_minimum
    with caplog.at_level(logging.WARNING, logger="scheduler.planner"):
        with pytest.raises(BudgetTooSmall) as info:
            _with_minimum(seq, true_minimum - 30, fussy)
    assert info.value.minimum == true_minimum and info.value.function == 5
    assert "more than the largest working set" in caplog.text


def test_a_sequence_goes_with_the_plans_made_of_it() -> None:
    """What the planners share about a sequence (``working_sets.Prepared``) is kept on it, not
    in a cache beside it: one of the last 17 kept them, and the sequences, alive after their
    engine had closed."""
    import gc
    import weakref

    seq = training_like_sequence(24)
    schedule = plan(seq, seq.in_core_peak_bytes // 2)
    assert _moved(schedule) > 0
    gone = weakref.ref(seq)
    del seq, schedule
    gc.collect()
    assert gone() is None
