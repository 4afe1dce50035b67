"""``scheduler.anchor``: a plan's actions moved to the gaps where a hook-driven step can act."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from scheduler import Action, Op, Schedule, ScheduleError, check, plan
from scheduler.actions import replay
from scheduler.anchors import EARLIER, LATER, anchor, estimated_anchors
from scheduler.ir import Access, VariableSequence
from scheduler.managed import managed_view
from scheduler.recompute import default_hardware
from scheduler.replay import chain_inputs
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


# -- recomputation at hooks (``recompute=True``: chains rerun from templates) ---------------

PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "h100"


def _gpu_plan(case: str, fraction: float) -> tuple[Schedule, set[int], dict[int, int]]:
    """A recomputing plan of an H100 profile, and where hooks would fire in its step."""
    seq = managed_view(VariableSequence.from_json(PROFILES / f"{case}.json"))
    s = plan(seq, budget=int(seq.in_core_peak_bytes * fraction), hardware=default_hardware(seq))
    return (s, *estimated_anchors(seq))


def test_estimated_anchors_are_after_a_forward_save_and_before_a_backward_unpack() -> None:
    seq = training_like_sequence(2)
    gaps, first = estimated_anchors(seq)
    backward = seq.meta["backward_start"]
    names = {f.name: f.index for f in seq.functions}
    assert {names["fwd0.a"] + 1, names["fwd1.b"] + 1, names["bwd1.b"], names["bwd0.b"]} <= gaps
    assert names["bwd0.a"] not in gaps   # it reads the batch and a parameter: nothing saved
    assert not gaps & {names["opt0"], names["opt1"]}   # the update touches no activation
    for v, g in first.items():   # first seen right after the op that made it, in the forward
        maker = next(f.index for f in seq.functions if any(u.var == v and u.access is Access.WRITE for u in f.uses))
        assert g == maker + 1 <= backward, (seq.variables[v].name, g, maker)


def test_a_recomputing_plan_discards_later_and_recomputes_earlier_at_hooks() -> None:
    s, gaps, first = _gpu_plan("gpt2", 0.25)
    assert s.bytes_recomputed > 0 and anchor(s, gaps, first) is None   # not without templates
    moved = anchor(s, gaps, first, recompute=True)
    assert moved is not None
    n = len(s.sequence.functions)
    where = {id(a): g for g, a in _placed(moved)}
    allowed = {0, n, *gaps}
    ops = set()
    for g, a in _placed(s):
        to = where[id(a)]
        ops.add(a.op)
        assert to in allowed, (a, to)
        if a.op in LATER or a.op is Op.DISCARD:
            assert to >= g, (a, g, to)   # never let go before a use
        elif a.op is Op.RECOMPUTE:
            assert to <= g, (a, g, to)   # back before its use
    assert {Op.DISCARD, Op.RECOMPUTE} <= ops
    # valid apart from the bytes it holds longer: every chain reruns with its inputs resident
    check(dataclasses.replace(moved, budget=max(s.budget, replay(moved).peak)))
    assert (moved.bytes_recomputed, moved.bytes_in, moved.bytes_out) == (s.bytes_recomputed, s.bytes_in, s.bytes_out)


def test_a_chain_reruns_after_the_wait_that_brings_its_input_back() -> None:
    s, gaps, first = _gpu_plan("resnet50", 0.25)
    moved = anchor(s, gaps, first, recompute=True)
    placed = _placed(moved)
    seen: dict[int, int] = {}   # var -> position of its last action so far
    for k, (_, a) in enumerate(placed):
        if a.op is Op.RECOMPUTE:
            assert all(seen.get(x, -1) < k for x in chain_inputs(s.sequence, a.chain))
        seen[a.var] = k
    assert any(a.op is Op.RECOMPUTE for _, a in placed)
