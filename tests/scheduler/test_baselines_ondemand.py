"""The "on-demand" baseline (NNTrainer's swap without lookahead): safe on every sequence,
synchronous (each swap-in waited for right before its use, each swap-out at once), and
keeping nothing between two uses that are not adjacent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ has no __init__.py

from scheduler import Access, BudgetTooSmall, Op, Schedule, plan  # noqa: E402
from scheduler.check import check  # noqa: E402
from scheduler.planner import POLICIES  # noqa: E402
from strategies import sequences, training_like_sequence, training_sequences  # noqa: E402

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _on_demand(seq) -> Schedule:
    """Plan at the rule's own peak (the budget does not change what on-demand does)."""
    unlimited = max(1, seq.total_bytes)
    s = plan(seq, unlimited, policy="on-demand")
    return plan(seq, max(1, check(s).peak_bytes), policy="on-demand")


def _assert_on_demand_shape(s: Schedule) -> None:
    """Every swap-in is waited for in the same list, right after it, before the use; every
    swap-out likewise; a variable is off the device exactly between non-adjacent uses."""
    seq = s.sequence
    for lists in (s.before, s.after):
        for acts in lists:
            for k, a in enumerate(acts):
                if a.op is Op.SWAP_IN:
                    assert acts[k + 1] == type(a)(Op.WAIT_IN, a.var)
                if a.op is Op.SWAP_OUT:
                    assert acts[k + 1] == type(a)(Op.WAIT_OUT, a.var)
    for i, acts in enumerate(s.before):
        used = set(seq.functions[i].var_ids)
        for a in acts:
            assert a.op in (Op.SWAP_IN, Op.WAIT_IN), a
            assert a.var in used, f"swap-in of {a.var} before function {i}, which does not use it"
    for i, acts in enumerate(s.after):
        used = set(seq.functions[i].var_ids)
        for a in acts:
            assert a.op in (Op.SWAP_OUT, Op.WAIT_OUT, Op.DROP, Op.FREE), a
            assert a.var in used, f"{a.op.value} of {a.var} after function {i}, which does not use it"
    for v, var in seq.variables.items():
        uses = seq.uses_of[v]
        ins = [i for i, acts in enumerate(s.before) for a in acts if a.op is Op.SWAP_IN and a.var == v]
        gaps = [n for j, n in zip(uses, uses[1:]) if n > j + 1]
        expected = ([uses[0]] if var.live_in and uses else []) + gaps
        assert ins == expected, (v, ins, expected)
    assert s.initial_resident == frozenset()


@FAST
@given(training_sequences())
def test_on_demand_is_safe_on_training_like_sequences(seq) -> None:
    s = _on_demand(seq)
    r = check(s)
    assert r.peak_bytes <= s.budget and s.policy == "on-demand"
    _assert_on_demand_shape(s)
    # Between steps, everything lives in the slower tier (NNTrainer keeps weights in its
    # swap file); nothing stays resident at the end.
    assert r.final_resident == frozenset()
    # It never needs more than in-core training, plus the bytes of swapped-in parameters
    # which in-core keeps anyway: the in-core peak bounds it.
    assert r.peak_bytes <= seq.in_core_peak_bytes


@FAST
@given(sequences())
def test_on_demand_is_safe_on_random_sequences(seq) -> None:
    s = _on_demand(seq)
    check(s)
    _assert_on_demand_shape(s)


@pytest.mark.parametrize("style", ["cnn", "transformer"])
def test_on_demand_moves_more_and_keeps_less_than_in_core(style) -> None:
    seq = training_like_sequence(8, style=style, act_bytes=1 << 20, param_bytes=1 << 14)
    s = _on_demand(seq)
    r = check(s)
    assert r.peak_bytes < seq.in_core_peak_bytes // 2
    # Every saved activation crosses the gap between forward and backward: written once.
    saved = [v for v, var in seq.variables.items() if var.name[:1] in "ah" and var.kind.value == "activation"]
    outs = {a.var for acts in s.after for a in acts if a.op is Op.SWAP_OUT}
    assert set(saved) <= outs
    # Parameters are only read until the optimizer step: after their first trip they are
    # dropped (the host copy is current), written back only after the update.
    params = [v for v, var in seq.variables.items() if var.kind.value == "param"]
    for p in params:
        last_write = max(i for i, f in enumerate(seq.functions)
                         for u in f.uses if u.var == p and u.access is Access.WRITE)
        outs_p = [i for i, acts in enumerate(s.after) for a in acts if a.op is Op.SWAP_OUT and a.var == p]
        drops_p = [i for i, acts in enumerate(s.after) for a in acts if a.op is Op.DROP and a.var == p]
        assert outs_p == [last_write] and all(i < last_write for i in drops_p)


def test_on_demand_is_registered_and_reports_its_minimum() -> None:
    assert "on-demand" in POLICIES
    seq = training_like_sequence(6, act_bytes=1000, param_bytes=10)
    peak = check(_on_demand(seq)).peak_bytes
    with pytest.raises(BudgetTooSmall) as info:
        plan(seq, peak - 1, policy="on-demand")
    assert info.value.minimum == peak
    with pytest.raises(TypeError, match="does not take option"):
        plan(seq, peak, policy="on-demand", swapin_ahead=1)
