"""Waits for swap-outs placed by time (``scheduler.release``): safe anywhere between a victim's
last use and its overflow point, the same bytes moved, and kept by the default planner only
where ``simulate`` predicts a faster step."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Cost, Kind, Op, Schedule, Variable, build_sequence, check, plan, simulate
from scheduler.hardware import hardware
from scheduler.release import timed_release
from scheduler.window import plan_window, working_sets
from strategies import sequences, training_like_sequence

MiB = 1 << 20
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _waits(s: Schedule) -> dict[int, list[int]]:
    """Variable -> the functions before which its swap-outs are waited for (the step's end
    counts as function n)."""
    n = len(s.sequence.functions)
    out: dict[int, list[int]] = {}
    for i, acts in enumerate(s.before):
        for a in acts:
            if a.op is Op.WAIT_OUT:
                out.setdefault(a.var, []).append(i)
    for a in s.after[n - 1] if n else ():
        if a.op is Op.WAIT_OUT:
            out.setdefault(a.var, []).append(n)
    return out


def _random_rule(rng: random.Random, seen: list[tuple[int, int, int, int]]):
    def release(v: int, last: int, at: int) -> int:
        back = rng.randint(last + 1, at)
        seen.append((v, last, at, back))
        return back
    return release


@FAST
@given(sequences(), st.integers(0, 2**32 - 1))
def test_any_place_between_last_use_and_overflow_is_safe_and_moves_the_same_bytes(seq, seed) -> None:
    ws = max(working_sets(seq), default=0)
    peak = seq.in_core_peak_bytes
    for budget in sorted({max(1, ws), max(1, (ws + peak) // 2)}):
        lazy = plan_window(seq, budget)
        seen: list[tuple[int, int, int, int]] = []
        early = plan_window(seq, budget, release=_random_rule(random.Random(seed), seen))
        r = check(early)                       # every use resident, never above the budget
        assert r.peak_bytes <= budget
        assert (early.bytes_in, early.bytes_out) == (lazy.bytes_in, lazy.bytes_out)
        # Each wait the rule placed is where it said, never after the lazy plan's.
        lazy_waits, early_waits = _waits(lazy), _waits(early)
        for v, last, at, back in seen:
            assert last < back <= at
        for v, places in early_waits.items():
            assert len(places) == len(lazy_waits.get(v, ()))
            assert all(e <= z for e, z in zip(sorted(places), sorted(lazy_waits[v])))


def _forward_weight_after_an_early_eviction():
    """f0 makes a big activation ``a`` that the backward needs last; f1 reads it (its last use
    in the forward); f2, f3 compute; f4 needs the weight ``w``, which the budget sends to the
    slower tier at f0, and overflows the budget: ``a`` is the victim. Lazily, ``a``'s bytes come back only at f4,
    so ``w`` cannot be read before f4; by time, ``a``'s copy is done before f3 and ``w`` is
    read during f3."""
    fns = [
        ("fwd0", [(0, "r"), (1, "w")], Cost(seconds=0.01)),
        ("fwd1", [(1, "r"), (2, "w")], Cost(seconds=0.01)),
        ("fwd2", [(2, "r"), (3, "w")], Cost(seconds=0.01)),
        ("fwd3", [(3, "r"), (4, "w")], Cost(seconds=0.01)),
        ("fwd4", [(4, "r"), (5, "r"), (6, "w")], Cost(seconds=0.01)),
        ("bwd4", [(6, "r"), (5, "r")], Cost(seconds=0.01)),
        ("bwd0", [(1, "r")], Cost(seconds=0.01)),
    ]
    vs = [Variable(0, MiB, Kind.INPUT, "x", live_in=True),
          Variable(1, 8 * MiB, Kind.ACTIVATION, "a"),
          Variable(2, MiB, Kind.ACTIVATION, "b"), Variable(3, MiB, Kind.ACTIVATION, "c"),
          Variable(4, MiB, Kind.ACTIVATION, "d"),
          Variable(5, 4 * MiB, Kind.PARAM, "w", live_in=True, live_out=True),
          Variable(6, MiB, Kind.ACTIVATION, "e")]
    return build_sequence(fns, vs, {"device": "cpu"})


def test_the_rule_waits_where_the_copy_is_done_and_no_later_than_the_overflow() -> None:
    seq = _forward_weight_after_an_early_eviction()
    hw = hardware("cpu-edge", d2h_bandwidth=1e9, link_latency_s=0.0)   # 8 MiB out: 8.4 ms
    release = timed_release(seq, hw)
    assert release(1, 1, 4) == 3      # issued after f1 (at 20 ms): done at 28.4 ms, f3 starts at 30
    assert release(1, 1, 2) == 2      # never after the overflow point
    slow = timed_release(seq, hardware("cpu-edge", d2h_bandwidth=1e8, link_latency_s=0.0))
    assert slow(1, 1, 4) == 4         # 84 ms: not done before f4 starts
    assert release(2, 1, 4) == 3      # 1 MiB issued at 20 ms is done before f2 ends (30 ms)


def test_an_earlier_wait_lets_the_next_read_hide_and_the_planner_keeps_it() -> None:
    seq = _forward_weight_after_an_early_eviction()
    hw = hardware("cpu-edge", h2d_bandwidth=1e9, d2h_bandwidth=1e9, link_latency_s=0.0, moved_byte_s=0.0)
    budget = 12 * MiB   # w leaves at f0 (a arrives); a leaves at f4 (w and e arrive)
    lazy = plan_window(seq, budget)
    early = plan_window(seq, budget, release=timed_release(seq, hw))
    assert _waits(lazy)[1] == [4] and _waits(early)[1] == [3]
    reads_w = [next(i for i, acts in enumerate(s.before) for a in acts if a.op is Op.SWAP_IN and a.var == 5)
               for s in (lazy, early)]
    assert reads_w == [4, 3]                                   # w's read starts a function sooner
    lazy_s, early_s = simulate(lazy, hw), simulate(early, hw)
    assert early_s.stall_s < lazy_s.stall_s
    chosen = plan(seq, budget=budget, hardware=hw)
    assert _waits(chosen)[1] == [3] and simulate(chosen, hw).total_s == early_s.total_s
    # Without hardware to price on and nothing to replay: the plan of old, byte for byte.
    assert plan(seq, budget=budget) == lazy


def test_the_planner_keeps_lazy_waits_where_they_predict_faster() -> None:
    """On a training-like step with a slow link, every plan it returns is one of the two and
    never predicted slower than the lazy one."""
    seq = training_like_sequence(6, act_bytes=MiB, param_bytes=MiB // 2)
    hw = hardware("cpu-edge")
    for fraction in (2, 3, 4):
        budget = max(max(working_sets(seq)), seq.in_core_peak_bytes // fraction)
        chosen = plan(seq, budget=budget, hardware=hw, recompute="never")
        lazy = plan_window(seq, budget)
        early = plan_window(seq, budget, release=timed_release(seq, hw))
        assert chosen in (lazy, early)
        assert simulate(chosen, hw).total_s <= simulate(lazy, hw).total_s
