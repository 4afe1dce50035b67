"""check(): accepts safe schedules with exact measurements, rejects every kind of violation
with the function, the variable and the fix in the message."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler import Action, BudgetTooSmall, Cost, Kind, Op, Schedule, ScheduleError, Variable, build_sequence
from scheduler.check import CheckResult, check
from scheduler.planner import POLICIES, plan
from scheduler.window import working_sets
from strategies import random_sequence, sequences, training_like_sequence

W, A, G, X = 0, 1, 2, 3  # param, activation, grad, input


def _seq():
    """fwd: x, w -> a;  mid: w;  bwd: a, w -> g;  opt: g, w -> w (in place)."""
    return build_sequence(
        [("fwd", [(X, "r"), (W, "r"), (A, "w")], Cost()),
         ("mid", [(W, "r")], Cost()),
         ("bwd", [(A, "r"), (W, "r"), (G, "w")], Cost()),
         ("opt", [(G, "r"), (W, "r"), (W, "w")], Cost())],
        [Variable(W, 10, Kind.PARAM, "w", live_in=True, live_out=True),
         Variable(A, 20, Kind.ACTIVATION, "a"),
         Variable(G, 10, Kind.GRAD, "g"),
         Variable(X, 5, Kind.INPUT, "x", live_in=True)])


def _sched(before=None, after=None, initial=(), budget=100, seq=None) -> Schedule:
    seq = seq or _seq()
    n = len(seq.functions)
    acts = lambda d, i: tuple(Action(Op(op), v) for op, v in (d or {}).get(i, ()))  # noqa: E731
    return Schedule(seq, budget=budget, policy="hand", window=0,
                    before=tuple(acts(before, i) for i in range(n)),
                    after=tuple(acts(after, i) for i in range(n)),
                    initial_resident=frozenset(initial))


def in_core(**kw) -> Schedule:
    after = {0: [("free", X)], 2: [("free", A)], 3: [("free", G)]}
    after.update(kw.pop("after", {}))
    return _sched(after=after, initial=kw.pop("initial", {W, X}), **kw)


def swapping(**kw) -> Schedule:
    """w lives in host memory, a goes out during mid, w is written by opt and goes back."""
    before = {0: [("swap_in", W), ("wait_in", W)],
              1: [("wait_out", A), ("swap_in", W), ("wait_in", W)],
              2: [("swap_in", A), ("wait_in", A)]}
    after = {0: [("free", X), ("swap_out", A), ("drop", W)],
             2: [("free", A)],
             3: [("free", G), ("swap_out", W), ("wait_out", W)]}
    before.update(kw.pop("before", {}))
    after.update(kw.pop("after", {}))
    return _sched(before=before, after=after, initial=kw.pop("initial", {X}), budget=kw.pop("budget", 40), **kw)


def _err(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        check(schedule)
    return info.value


# -- safe schedules and what check measures ------------------------------------------------------


def test_in_core_schedule_measures_live_bytes() -> None:
    r = check(in_core(budget=40))
    assert r == CheckResult(peak_bytes=40, resident_bytes=(35, 30, 40, 20), bytes_in=0, bytes_out=0,
                            transfers=0, final_resident=frozenset({W}))
    assert r.resident_bytes == in_core().sequence.live_bytes


def test_swapping_schedule_counts_transfers_and_in_flight_bytes() -> None:
    s = swapping()
    r = check(s)
    # fwd: w + x + a = 35; mid: w (a's swap-out waited before mid) = 10; bwd: a + w + g = 40.
    assert r.resident_bytes == (35, 10, 40, 20)
    assert (r.peak_bytes, r.bytes_in, r.bytes_out, r.transfers) == (40, 40, 30, 5)
    assert (r.bytes_in, r.bytes_out) == (s.bytes_in, s.bytes_out)
    assert r.final_resident == frozenset()  # w started in host memory and ends there


def test_in_flight_bytes_count_until_the_wait() -> None:
    # Without the wait_out before mid, a (20 B) is still on the device during mid.
    s = swapping(before={1: [("swap_in", W), ("wait_in", W)], 2: [("wait_out", A), ("swap_in", A), ("wait_in", A)]})
    assert check(s).resident_bytes == (35, 30, 40, 20)


def test_created_live_out_may_end_in_either_tier_and_unused_live_in_may_stay() -> None:
    seq = build_sequence(
        [("f", [(0, "w")], Cost())],
        [Variable(0, 8, Kind.GRAD, "g", live_out=True), Variable(1, 4, Kind.INPUT, "unused", live_in=True)])
    assert check(_sched(seq=seq)).final_resident == frozenset({0})
    out = _sched(seq=seq, after={0: [("swap_out", 0), ("wait_out", 0)]})
    assert check(out).final_resident == frozenset()
    # The unused live_in variable may also start resident and stay there.
    assert check(_sched(seq=seq, initial={1})).peak_bytes == 12


def test_freeing_a_host_only_copy_is_allowed() -> None:
    s = swapping(after={2: [("free", A)], 3: [("free", G), ("swap_out", W), ("wait_out", W)]})
    check(s)
    # x starts in host memory, is swapped in, used, and freed; a host-only copy can be forgotten.
    seq = build_sequence([("f", [(0, "r")], Cost()), ("g", [(1, "w")], Cost())],
                         [Variable(0, 5, Kind.INPUT, "x", live_in=True), Variable(1, 5, Kind.ACTIVATION, "y")])
    check(_sched(seq=seq, before={0: [("swap_in", 0), ("wait_in", 0)]},
                 after={0: [("drop", 0), ("free", 0)], 1: [("free", 1)]}))


# -- violations ------------------------------------------------------------------------------------


def test_use_of_a_variable_in_host_memory() -> None:
    e = _err(swapping(before={1: []}))
    assert (e.function, e.variable) == (1, W)
    msg = str(e)
    assert "function 1 (mid) reads variable 0 (param 'w', 10 B)" in msg
    assert "host memory" in msg and "add swap_in + wait_in of variable 0" in msg


def test_use_before_swap_in_completes() -> None:
    e = _err(swapping(before={2: [("swap_in", A)]}, after={2: [("free", A)]}))
    assert (e.function, e.variable) == (2, A)
    assert "still being swapped in" in str(e) and "add wait_in of variable 1" in str(e)


def test_use_while_swapping_out() -> None:
    e = _err(swapping(before={1: [("swap_in", W), ("wait_in", W)], 2: []}))
    assert (e.function, e.variable) == (2, A)
    assert "being swapped out" in str(e)


def test_over_budget_during_a_function() -> None:
    e = _err(swapping(budget=39))
    assert e.function == 2
    assert "40 B" in str(e) and "exceed budget 39 B" in str(e) and "during function 2 (bwd)" in str(e)


def test_over_budget_after_a_swap_in() -> None:
    seq = build_sequence([("f", [(0, "r")], Cost())],
                         [Variable(0, 10, Kind.PARAM, "w", live_in=True, live_out=True)])
    e = _err(_sched(seq=seq, budget=5, before={0: [("swap_in", 0), ("wait_in", 0)]},
                    after={0: [("drop", 0)]}))
    assert (e.function, e.variable) == (0, 0)
    assert "after swap_in of variable 0 before function 0 (f)" in str(e)


def test_initial_residency_over_budget() -> None:
    e = _err(in_core(budget=14))
    assert e.function is None and "at the start of the step" in str(e)


def test_free_before_the_last_use() -> None:
    e = _err(in_core(after={1: [("free", A)], 2: []}))
    assert (e.function, e.variable) == (1, A)
    assert "function 2 (bwd) uses it later" in str(e)
    # Before its last user, in the same function, is also too early.
    e = _err(in_core(before={2: [("free", A)]}, after={2: []}))
    assert (e.function, e.variable) == (2, A)


def test_free_of_a_live_out_variable() -> None:
    e = _err(in_core(after={3: [("free", G), ("free", W)]}))
    assert (e.function, e.variable) == (3, W) and "live_out" in str(e)


def test_drop_of_a_dirty_variable() -> None:
    # opt writes w: its host copy is stale, so dropping it at the end would lose the update.
    e = _err(swapping(after={3: [("free", G), ("drop", W)]}))
    assert (e.function, e.variable) == (3, W)
    assert "stale" in str(e) and "function 3 (opt) wrote it" in str(e) and "swap_out" in str(e)


def test_drop_without_a_host_copy() -> None:
    e = _err(in_core(after={1: [("drop", W)]}))
    assert (e.function, e.variable) == (1, W) and "no host copy" in str(e)


def test_end_state_must_match_the_start() -> None:
    # w started in host memory but is left resident.
    e = _err(swapping(after={3: [("free", G)]}))
    assert (e.function, e.variable) == (3, W)
    assert "ends the step resident" in str(e) and "not in initial_resident" in str(e)
    # w started resident but ends in host memory.
    e = _err(in_core(after={3: [("free", G), ("swap_out", W), ("wait_out", W)]}))
    assert e.variable == W and "swap it back in" in str(e)


def test_pending_transfer_at_the_end() -> None:
    e = _err(swapping(after={3: [("free", G), ("swap_out", W)]}))
    assert (e.function, e.variable) == (3, W)
    assert "at the end of the step" in str(e) and "add wait_out of variable 0" in str(e)


def test_dead_variable_never_freed() -> None:
    e = _err(in_core(after={3: []}))
    assert (e.function, e.variable) == (3, G)
    assert "not live_out" in str(e) and "add free of variable 2 after function 3 (opt)" in str(e)


@pytest.mark.parametrize("before, after, fn, var, words", [
    ({0: [("wait_in", W)]}, {}, 0, W, "no swap_in to wait for"),
    ({}, {0: [("wait_out", A)]}, 0, A, "no swap_out to wait for"),
    ({0: [("swap_in", W)]}, {}, 0, W, "not in host memory"),
    ({0: [("swap_out", A)]}, {}, 0, A, "absent"),
    ({1: [("swap_in", A)]}, {0: [("swap_out", A)]}, 1, A, "being swapped out"),
    ({}, {0: [("free", X), ("free", X)]}, 0, X, "only a resident or host-only variable can be freed"),
])
def test_actions_in_the_wrong_state(before, after, fn, var, words) -> None:
    base_after = {0: [("free", X)], 2: [("free", A)], 3: [("free", G)]}
    base_after.update(after)
    e = _err(_sched(before=before, after=base_after, initial={W, X}))
    assert (e.function, e.variable) == (fn, var)
    assert words in str(e)


def test_initial_resident_must_be_live_in() -> None:
    e = _err(in_core(initial={W, X, A}))
    assert e.variable == A and "not live_in" in str(e)


# -- check is strict: no action of a planned schedule is optional ---------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences(max_functions=12))
def test_removing_any_transfer_or_free_breaks_a_planned_schedule(seq) -> None:
    ws = max(working_sets(seq), default=0)
    budget = max(1, (ws + seq.in_core_peak_bytes) // 2)
    for policy in ("window", "window-paper"):
        s = plan(seq, budget, policy=policy)
        for lists_name in ("before", "after"):
            lists = getattr(s, lists_name)
            for i, acts in enumerate(lists):
                for k, a in enumerate(acts):
                    if a.op is Op.DROP:
                        continue  # a live_out variable created this step may stay resident
                    cut = list(lists)
                    cut[i] = acts[:k] + acts[k + 1:]
                    broken = Schedule(s.sequence, s.budget, s.policy, s.window,
                                      **{lists_name: tuple(cut),
                                         ("after" if lists_name == "before" else "before"):
                                             getattr(s, "after" if lists_name == "before" else "before")},
                                      initial_resident=s.initial_resident)
                    with pytest.raises(ScheduleError):
                        check(broken)


def test_check_proves_a_large_plan() -> None:
    """~9k functions and ~20k actions. How long check takes, and that it grows linearly with
    the sequence, is benchmarks/bench_plan.py's (its check column): a bar on time here would
    fail on a slower machine, not on a slower check."""
    seq = training_like_sequence(1500, style="transformer", act_bytes=1 << 16, param_bytes=1 << 12)
    s = plan(seq, seq.in_core_peak_bytes // 3)
    r = check(s)
    assert r.peak_bytes == s.peak_resident_bytes <= s.budget
    assert (r.bytes_in, r.bytes_out) == (s.bytes_in, s.bytes_out) and s.bytes_out > 0


def test_check_on_random_plans_matches_schedule_properties() -> None:
    rng = random.Random(7)
    for _ in range(50):
        seq = random_sequence(rng)
        budget = max(1, max(working_sets(seq), default=0))
        for policy in POLICIES:
            try:
                s = plan(seq, budget, policy=policy)
            except BudgetTooSmall:
                continue  # baselines may need more than the largest working set
            r = check(s)
            assert (r.bytes_in, r.bytes_out) == (s.bytes_in, s.bytes_out)
            assert r.peak_bytes == s.peak_resident_bytes <= budget
            assert len(r.resident_bytes) == len(seq.functions)
