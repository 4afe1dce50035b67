"""One meaning per memory action: the transition table, and every consumer agreeing with it.

``check``, ``simulate``, ``memory_events`` and the table's own ``Ledger`` replay the same
schedules (the planners' output, hand-built ones, and random mutations of both, valid and
invalid) and must give the same verdict (accept, or refuse the same action of the same
variable at the same function) and the same peak device bytes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (Action, BudgetTooSmall, Cost, Kind, Op, Schedule, ScheduleError, Variable, build_sequence, check,
                       plan, simulate)
from scheduler.actions import NEEDS, TRANSITIONS, USE, Ledger, Refused, Residency, refusal, replay
from scheduler.memory_events import allocation_events
from scheduler.window import working_sets

from strategies import random_sequence, sequences, training_like_sequence

HUGE = 1 << 60
C = Cost(flops=1.0)
ON_DEVICE = {Residency.IN, Residency.RESIDENT, Residency.OUT}


# -- the table itself ---------------------------------------------------------------------------


def test_every_action_has_a_row_and_a_reason() -> None:
    assert {op for op, _ in TRANSITIONS} == set(Op) == set(NEEDS)


def test_rows_move_bytes_as_the_states_hold_them() -> None:
    """A row's device delta is exactly the change in "holds device bytes" between its states,
    and its in-flight delta the change in "is being copied"."""
    flying = {Residency.IN, Residency.OUT}
    for (op, frm), eff in TRANSITIONS.items():
        assert eff.device == (eff.to in ON_DEVICE) - (frm in ON_DEVICE), op
        assert eff.in_flight == (eff.to in flying) - (frm in flying), op
        if eff.to is Residency.HOST:
            assert eff.tier is True, op   # whatever ends in the slower tier only has its bytes there


def test_refusal_names_the_precondition() -> None:
    assert refusal(Op.SWAP_IN, Residency.HOST, True) is None
    assert "not in host memory" in refusal(Op.SWAP_IN, Residency.RESIDENT, False)
    assert refusal(Op.DROP, Residency.RESIDENT, True) is None
    assert "current bytes" in refusal(Op.DROP, Residency.RESIDENT, False)
    assert refusal(Op.FREE, Residency.HOST, True) is None
    assert "only a resident or host-only" in refusal(Op.FREE, Residency.IN, True)


def _seq():
    # w: a parameter (live in/out); a: an activation; g: a gradient.
    return build_sequence(
        [("fwd", [(0, "r"), (1, "w")], C), ("mid", [(0, "r")], C), ("bwd", [(1, "r"), (2, "w")], C),
         ("opt", [(2, "r"), (0, "w")], C)],
        [Variable(0, 10, Kind.PARAM, "w", live_in=True, live_out=True),
         Variable(1, 20, Kind.ACTIVATION, "a"), Variable(2, 10, Kind.GRAD, "g")])


def test_ledger_counts_bytes_and_refuses_with_action_variable_and_function() -> None:
    led = Ledger(_seq(), {0})
    assert (led.device, led.state[0], led.state[1]) == (10, Residency.RESIDENT, Residency.ABSENT)
    assert led.run(0) == [1] and led.device == 30
    led.apply(Op.SWAP_OUT, 1, 0, "after")
    assert (led.device, led.in_flight) == (30, 20)
    led.apply(Op.WAIT_OUT, 1, 1, "before")
    assert (led.device, led.in_flight, led.tier_current[1]) == (10, 0, True)
    led.apply(Op.SWAP_IN, 1, 1, "after")
    assert (led.device, led.in_flight, led.peak) == (30, 20, 30)
    with pytest.raises(Refused) as err:
        led.apply(Op.DROP, 1, 1, "after")   # still in flight
    e = err.value
    assert e.verdict == ("drop", 1, 1, "after") and e.state is Residency.IN
    assert "drop of variable 1 (activation 'a', 20 B) after function 1 (mid)" in str(e)
    with pytest.raises(Refused) as err:
        led.run(2)                          # reads a before its wait_in
    assert err.value.verdict == (USE, 1, 2, "during") and "add wait_in of variable 1" in str(err.value)


def test_free_needs_a_dead_variable() -> None:
    led = Ledger(_seq(), {0})
    led.run(0)
    with pytest.raises(Refused, match="uses it later"):
        led.apply(Op.FREE, 1, 0, "after")
    with pytest.raises(Refused, match="live_out"):
        led.apply(Op.FREE, 0, 0, "after")


# -- every consumer, the same verdicts ---------------------------------------------------------


def _verdicts(s: Schedule):
    """(verdict, peak) of the table, check, simulate and memory_events; verdict None = accepted.

    The budget is lifted (check's own rule), and check's end-of-step rules (a ScheduleError
    that is not a Refused) are not the table's: the table accepts what they reject."""
    big = dataclasses.replace(s, budget=HUGE)
    out = {}
    for name, run in (("table", lambda: replay(big).peak),
                      ("check", lambda: _check_peak(big)),
                      ("simulate", lambda: simulate(big, "v100-16gb-nvlink", timeline=False).peak_bytes),
                      ("events", lambda: _events_peak(big))):
        try:
            out[name] = (None, run())
        except Refused as e:
            out[name] = (e.verdict, None)
    return out


def _check_peak(s: Schedule) -> int | None:
    try:
        return check(s).peak_bytes
    except Refused:
        raise
    except ScheduleError:
        return replay(s).peak   # an end-of-step rule: the replay itself was accepted


def _events_peak(s: Schedule) -> int:
    live = peak = 0
    size: dict = {}   # a free's own nbytes is ignored (vmm.replay.Event): the alloc's counts
    for e in allocation_events(s):
        if e.action == "alloc":
            size[e.key] = e.nbytes
            live += e.nbytes
        else:
            live -= size.pop(e.key)
        peak = max(peak, live)
    return max(peak, 0)


def _agree(s: Schedule) -> tuple:
    v = _verdicts(s)
    assert len(set(v.values())) == 1, v
    return v["table"]


def _mutants(s: Schedule, rng: random.Random, k: int):
    """Schedules one edit away from ``s``: an action removed, duplicated, moved, or changed."""
    slots = [(side, i, j) for side in ("before", "after") for i, acts in enumerate(getattr(s, side))
             for j in range(len(acts))]
    for _ in range(k if slots else 0):
        side, i, j = rng.choice(slots)
        lists = [list(x) for x in getattr(s, side)]
        a = lists[i][j]
        how = rng.randrange(4)
        if how == 0:
            del lists[i][j]
        elif how == 1:
            lists[i].insert(j, a)
        elif how == 2:
            del lists[i][j]
            lists[rng.randrange(len(lists))].append(a)
        else:
            lists[i][j] = Action(rng.choice(list(Op)), a.var)
        yield dataclasses.replace(s, **{side: tuple(map(tuple, lists))})


@pytest.mark.parametrize("style", ["cnn", "transformer"])
@pytest.mark.parametrize("policy", ["window", "window-paper", "lms", "vdnn", "none"])
def test_planned_schedules_and_their_mutants_get_one_verdict(style, policy) -> None:
    seq = training_like_sequence(12, style=style)
    budget = max(max(working_sets(seq)), seq.in_core_peak_bytes // 3)
    try:
        s = plan(seq, budget, policy=policy)
    except BudgetTooSmall as e:   # the baselines need more than the largest working set
        s = plan(seq, e.minimum, policy=policy)
    verdict, peak = _agree(s)
    assert verdict is None and peak == check(s).peak_bytes == s.peak_resident_bytes
    rng = random.Random(f"{style}/{policy}")
    refused = 0
    for m in _mutants(s, rng, 60):
        refused += _agree(m)[0] is not None
    assert refused > 10   # the mutants do exercise the refusals


def test_hand_built_schedules_get_one_verdict() -> None:
    seq = _seq()
    sched = lambda before, after, initial=frozenset({0}): Schedule(  # noqa: E731
        seq, HUGE, "hand", 0,
        tuple(tuple(Action(Op(o), v) for o, v in before.get(i, ())) for i in range(4)),
        tuple(tuple(Action(Op(o), v) for o, v in after.get(i, ())) for i in range(4)),
        frozenset(initial))
    good = sched({2: [("wait_out", 1), ("swap_in", 1), ("wait_in", 1)]},
                 {0: [("swap_out", 1)], 2: [("free", 1)], 3: [("free", 2)]})
    assert _agree(good) == (None, 40)   # w, a and g while bwd runs
    cases = {
        ("wait_in", 1, 2, "before"): ({2: [("wait_in", 1)]}, {0: [("swap_out", 1)]}),
        ("swap_in", 1, 2, "before"): ({2: [("swap_in", 1)]}, {}),
        ("drop", 1, 0, "after"): ({}, {0: [("drop", 1)]}),
        ("free", 0, 3, "after"): ({}, {3: [("free", 0)]}),
        ("free", 1, 1, "after"): ({}, {1: [("free", 1), ("free", 1)]}),
        (USE, 1, 2, "during"): ({}, {0: [("swap_out", 1)], 1: [("wait_out", 1)]}),
    }
    for want, (before, after) in cases.items():
        assert _agree(sched(before, after))[0] == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences(max_functions=12), st.integers(0, 2**32 - 1), st.sampled_from(["window", "window-paper"]))
def test_random_plans_and_mutants_get_one_verdict(seq, seed, policy) -> None:
    ws = max(working_sets(seq), default=0)
    s = plan(seq, max(1, (ws + seq.in_core_peak_bytes) // 2), policy=policy)
    assert _agree(s)[0] is None
    for m in _mutants(s, random.Random(seed), 8):
        _agree(m)


def test_check_raises_the_tables_error_for_a_refused_action() -> None:
    rng = random.Random(3)
    seq = random_sequence(rng, max_functions=15)
    s = plan(seq, max(1, max(working_sets(seq), default=0)))
    for m in _mutants(s, rng, 40):
        try:
            replay(m)
        except Refused as table:
            with pytest.raises(Refused) as checked:
                check(dataclasses.replace(m, budget=HUGE))
            assert str(checked.value) == str(table)
