"""``scheduler.anchor``: a plan's actions moved to the gaps where a hook-driven step can act."""

from __future__ import annotations

import random

import pytest

from scheduler import Action, Op, Schedule, ScheduleError, check, plan
from scheduler.actions import replay
from scheduler.anchors import EARLIER, LATER, anchor
from tests.scheduler.strategies import training_like_sequence


def _planned(style: str, fraction: float) -> Schedule:
    seq = training_like_sequence(8, style=style)
    return plan(seq, budget=int(seq.in_core_peak_bytes * fraction), policy="window")


def _placed(s: Schedule) -> list[tuple[int, Action]]:
    """(gap, action) of every action, in order: before function i is gap i, after it i + 1."""
    n = len(s.sequence.functions)
    return [(g, a) for i in range(n) for g, acts in ((i, s.before[i]), (i + 1, s.after[i])) for a in acts]


@pytest.mark.parametrize("style", ["cnn", "transformer"])
def test_anchoring_at_every_gap_changes_nothing_that_check_measures(style) -> None:
    s = _planned(style, 0.5)
    n = len(s.sequence.functions)
    moved = anchor(s, range(n + 1))
    assert moved is not None and _placed(moved) and [a for _, a in _placed(moved)] == [a for _, a in _placed(s)]
    check(moved)
    assert (moved.peak_resident_bytes, moved.bytes_in, moved.bytes_out) == (
        s.peak_resident_bytes, s.bytes_in, s.bytes_out)


@pytest.mark.parametrize("style", ["cnn", "transformer"])
def test_actions_move_only_to_anchors_and_only_in_their_safe_direction(style) -> None:
    s = _planned(style, 0.5)
    n = len(s.sequence.functions)
    gaps = sorted(random.Random(0).sample(range(1, n), n // 4))
    moved = anchor(s, gaps)
    assert moved is not None
    where = {id(a): g for g, a in _placed(moved)}
    allowed = {0, n, *gaps}
    for g, a in _placed(s):
        to = where[id(a)]
        assert to in allowed, (a, to)
        if a.op in LATER:
            assert to >= g, (a, g, to)   # never released before a use
    order: dict[int, list[int]] = {}
    for g, a in _placed(moved):
        order.setdefault(a.var, []).append(g)
    assert all(gs == sorted(gs) for gs in order.values())   # each variable's actions keep their order
    assert {a.op for _, a in _placed(s)} & EARLIER and {a.op for _, a in _placed(s)} & LATER
    try:   # the proof decides: anchored, the bytes may be held longer than the budget allows
        check(moved)
    except ScheduleError:
        assert replay(moved).peak > s.budget


def test_a_wait_out_moves_earlier_so_that_room_is_made_before_a_large_output() -> None:
    s = _planned("transformer", 0.5)
    waits = [(g, a) for g, a in _placed(s) if a.op is Op.WAIT_OUT]
    g, a = waits[len(waits) // 2]
    moved = anchor(s, [g - 1])
    to = next(gg for gg, b in _placed(moved) if b is a)
    swap_out = max(gg for gg, b in _placed(moved) if b.var == a.var and b.op is Op.SWAP_OUT)
    assert to == max(g - 1, swap_out)


def test_a_plan_that_recomputes_has_no_anchored_form() -> None:
    s = _planned("cnn", 0.5)
    n = len(s.sequence.functions)
    i = next(i for i in range(n) if s.after[i])
    after = list(s.after)
    after[i] = (*after[i], Action(Op.DISCARD, s.after[i][0].var))
    hand = Schedule(s.sequence, s.budget, s.policy, s.window, s.before, tuple(after), s.initial_resident)
    assert anchor(hand, range(n + 1)) is None
