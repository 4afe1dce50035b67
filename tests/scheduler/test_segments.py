"""Segment recompute (``scheduler.segments``): chains that share one replay, so each function of
a discarded segment reruns once per backward; and the link's queue in the price of a swap
(``scheduler.link_clock``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Cost, Kind, Op, Schedule, Variable, VariableSequence, build_sequence, check, simulate
from scheduler.hardware import hardware
from scheduler.link_clock import LinkClock
from scheduler.pins import Pins, pinned_rule
from scheduler.recompute import swap_or_recompute
from scheduler.window import plan_window
from strategies import training_sequences

R = {"replayable": True}
MiB = 1 << 20
# A link so slow that every swap costs more than any chain: the plan recomputes what it can.
DEAR = dataclasses.replace(hardware("cpu-edge"), h2d_bandwidth=1e6, d2h_bandwidth=1e6, moved_byte_s=0.0)


def _two_blocks() -> VariableSequence:
    """x -> conv1 -> c1 -> bn1 -> b1 (relu_ in place) -> conv2 -> c2 -> bn2 -> b2 (relu_) -> head,
    then the backward in reverse: each block's backward reads its outputs, then its input."""
    fns = [("conv1", [(0, "r"), (1, "w")], Cost(seconds=1e-3), R),
           ("bn1", [(1, "r"), (2, "w")], Cost(seconds=1e-4), R),
           ("relu1_", [(2, "r"), (2, "w")], Cost(seconds=1e-4), R),
           ("conv2", [(2, "r"), (3, "w")], Cost(seconds=1e-3), R),
           ("bn2", [(3, "r"), (4, "w")], Cost(seconds=1e-4), R),
           ("relu2_", [(4, "r"), (4, "w")], Cost(seconds=1e-4), R),
           ("head", [(4, "r"), (5, "w")], Cost(seconds=1e-3)),
           ("back_head", [(5, "r"), (4, "r"), (6, "w")], Cost(seconds=1e-3)),
           ("back2", [(6, "r"), (3, "r"), (2, "r"), (7, "w")], Cost(seconds=1e-3)),
           ("back1", [(7, "r"), (2, "r"), (1, "r"), (0, "r")], Cost(seconds=1e-3))]
    vs = [Variable(0, MiB // 4, Kind.INPUT, "x", live_in=True)] + [
        Variable(v, MiB, Kind.ACTIVATION, n) for v, n in ((1, "c1"), (2, "b1"), (3, "c2"), (4, "b2"), (5, "h"))] + [
        Variable(6, MiB // 4, Kind.TEMPORARY, "g2"), Variable(7, MiB // 4, Kind.TEMPORARY, "g1")]
    return build_sequence(fns, vs, {"device": "meta"})


def _plan(seq: VariableSequence, budget: int, shared: bool) -> Schedule:
    rule = swap_or_recompute(seq, DEAR, 1.0, True, shared=shared)
    return plan_window(seq, budget, recompute=pinned_rule(seq, Pins(), rule))


def _reruns(s: Schedule) -> Counter:
    return Counter(w for acts in s.before for a in acts if a.op is Op.RECOMPUTE for w in a.chain)


def test_shared_replays_rerun_each_function_once_where_chains_through_rerun_it_twice() -> None:
    """At 4 MiB the forward drops c1 and b1 (and swaps x). Through chains recompute b1 before
    back2 by rerunning conv1 as a temporary, and c1 before back1 by rerunning conv1 again;
    shared replays recompute c1 before back2 (which does not read it), then b1 from it, each
    function once, and keep c1 for back1."""
    seq, budget = _two_blocks(), 4 * MiB
    through = _plan(seq, budget, shared=False)
    shared = _plan(seq, budget, shared=True)
    for s in (through, shared):
        assert check(s).peak_bytes <= budget
    assert _reruns(through)[0] == 2                      # conv1 ran again for b1, and for c1
    assert max(_reruns(shared).values()) == 1
    assert set(_reruns(shared)) == set(_reruns(through)) == {0, 1, 2}   # the same functions
    assert [(a.var, a.chain) for a in shared.before[8] if a.op is Op.RECOMPUTE] == [(1, (0,)), (2, (1, 2))]
    assert not any(a.op is Op.RECOMPUTE for a in shared.before[9])   # c1 is still resident
    assert simulate(shared, DEAR).recompute_s < simulate(through, DEAR).recompute_s


def test_the_link_clock_queues_copies_on_the_in_core_clock() -> None:
    seq = _two_blocks()                       # f_0 starts at 0, f_1 at 1 ms, f_2 at 1.1 ms, ...
    hw = dataclasses.replace(DEAR, d2h_bandwidth=MiB / 1e-3, link_latency_s=0.0)   # 1 MiB per ms
    clock = LinkClock(seq, hw)
    assert clock.start[1] == 1e-3
    assert clock.stall_s(MiB, 0, 6) == 0.0                 # out after f_0 at 1 ms, done at 2 ms
    assert abs(clock.stall_s(MiB, 0, 2) - 0.9e-3) < 1e-12   # needed back at 1.1 ms
    clock.book(MiB, 0, 6)
    assert abs(clock.stall_s(MiB, 0, 3) - (3e-3 - 1.2e-3)) < 1e-12   # queued behind it
    clock.book(MiB, 0, 2)                                   # the stream waits 0.9 ms before f_2 ...
    assert abs(clock.delay - (3e-3 - 1.1e-3)) < 1e-12      # (the second copy ends at 3 ms)
    assert clock.stall_s(MiB, 2, 4) < 1.2e-3 + 1e-12       # ... so f_4 starts later too


def test_a_swap_that_would_wait_on_a_busy_link_is_priced_with_that_wait() -> None:
    """The rule with ``stall_s``: a chain dearer than the bare copy wins once the copy would
    keep the compute stream waiting."""
    seq = _two_blocks()
    hw = dataclasses.replace(hardware("cpu-edge"), moved_byte_s=0.0)
    rule = swap_or_recompute(seq, hw, 0.1, True, shared=True)
    assert rule.link is hw
    assert rule(3, 8) is None                       # conv2 (1 ms) dearer than 0.1 x 2 copies of 1 MiB
    assert rule(3, 8, stall_s=1.0).functions == (3,)


# -- properties -------------------------------------------------------------------------------


def _replayable_forward(seq: VariableSequence) -> VariableSequence:
    """Every function that writes only what it creates is replayable (the recorder's verdict
    for a forward op without side effects)."""
    from scheduler.replay import mark_replayable

    def rule(f):
        fresh = all(seq.producer.get(u.var) == f.index for u in f.uses if u.access.value == "write")
        return {"replayable": fresh}

    return mark_replayable(seq, rule)


@given(training_sequences(), st.floats(0.2, 1.0), st.sampled_from([1e6, 1e9, 1e11]), st.sampled_from([0.02, 0.1, 1.0]))
@settings(max_examples=60, deadline=None)
def test_shared_plans_are_safe_and_within_budget(seq, fraction, bandwidth, exposure) -> None:
    """Whatever the sequence, the budget and the prices: a plan with shared replays (moved
    recomputes, pinned inputs discarded, swaps priced on the link's queue) is either refused
    (Infeasible / BudgetTooSmall) or proven safe by ``check`` within its budget."""
    from scheduler.errors import BudgetTooSmall
    from scheduler.working_sets import Infeasible

    seq = _replayable_forward(seq)
    hw = dataclasses.replace(DEAR, h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth)
    budget = max(1, int(seq.in_core_peak_bytes * fraction))
    rule = pinned_rule(seq, Pins(), swap_or_recompute(seq, hw, exposure, True, shared=True))
    try:
        s = plan_window(seq, budget, recompute=rule)
    except (Infeasible, BudgetTooSmall):
        return
    assert check(s).peak_bytes <= budget
    assert simulate(s, hw, timeline=False).peak_bytes <= budget
