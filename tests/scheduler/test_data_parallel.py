"""Data-parallel steps in the simulator (issue 19 item 6): DDP's buckets, the ring all-reduce's
bytes, and whether the all-reduce contends with the swaps for the host link.

A hand-built step: a forward (f0, f1), a backward that writes three gradients (g0 at f2,
g1 at f3, g2 at f4; 128 B each: one second of the test link each), and an optimizer that
reads them (f5). Variable 9 is an activation swapped out after f0 and back in for f3.
"""

from __future__ import annotations

import pytest

from scheduler.data_parallel import gradient_buckets, ring_bytes
from scheduler.hardware import Hardware, hardware
from scheduler.ir import Cost, Kind, Variable, build_sequence
from scheduler.schedule import Action, Op, Schedule
from scheduler.simulate import simulate
from scheduler.timeline import ALLREDUCE

B = 128   # bytes the test link moves in a second, each way


def _hw(**kw) -> Hardware:
    base = dict(name="test", device_bytes=1 << 20, peak_flops=1e12, mem_bandwidth=1e11,
                h2d_bandwidth=float(B), d2h_bandwidth=float(B), link_latency_s=0.0, op_overhead_s=0.0)
    return Hardware(**{**base, **kw})


def _step(swap: bool) -> Schedule:
    sec = lambda s: Cost(seconds=s)   # noqa: E731
    seq = build_sequence(
        [("f0", [(0, "r"), (9, "w")], sec(1.0)), ("f1", [(0, "r")], sec(1.0)),
         ("f2", [(10, "w")], sec(1.0)), ("f3", [(9, "r"), (11, "w")], sec(1.0)),
         ("f4", [(12, "w")], sec(1.0)), ("f5", [(0, "w"), (10, "r"), (11, "r"), (12, "r")], sec(1.0))],
        [Variable(0, 64, Kind.PARAM, "w", live_in=True, live_out=True), Variable(9, B, Kind.ACTIVATION, "a"),
         Variable(10, B, Kind.GRAD, "g0"), Variable(11, B, Kind.GRAD, "g1"), Variable(12, B, Kind.GRAD, "g2")])
    n = len(seq.functions)
    before = [()] * n
    after = [()] * n
    after[3] = (Action(Op.FREE, 9),)
    after[5] = tuple(Action(Op.FREE, v) for v in (10, 11, 12))
    if swap:
        after[0] = (Action(Op.SWAP_OUT, 9),)
        before[1] = (Action(Op.WAIT_OUT, 9),)
        before[2] = (Action(Op.SWAP_IN, 9),)
        before[3] = (Action(Op.WAIT_IN, 9),)
    return Schedule(seq, budget=1 << 20, policy="hand", window=0, before=tuple(before),
                    after=tuple(after), initial_resident=frozenset({0}))


def test_ring_all_reduce_sends_two_r_minus_one_over_r():
    assert ring_bytes(1000, 1) == 0
    assert ring_bytes(1000, 2) == 1000
    assert ring_bytes(1000, 4) == 1500
    assert ring_bytes(1001, 3) == 1335   # rounded up


def test_buckets_follow_readiness_and_the_optimizer_waits_for_them():
    seq = _step(swap=False).sequence
    one = gradient_buckets(seq, bucket_bytes=1)   # one gradient per bucket
    assert [(b.variables, b.ready_after, b.needed_before) for b in one] == [
        ((10,), 2, 5), ((11,), 3, 5), ((12,), 4, 5)]
    (whole,) = gradient_buckets(seq, bucket_bytes=10 * B)   # all in one, issued at the last
    assert (whole.variables, whole.nbytes, whole.ready_after, whole.needed_before) == ((10, 11, 12), 3 * B, 4, 5)


def test_one_rank_is_the_plain_step():
    s = _step(swap=True)
    assert simulate(s, _hw()).to_dict() == {**simulate(s, _hw(), data_parallel=1).to_dict()}
    r = simulate(s, _hw(), data_parallel=1)
    assert (r.allreduce_bytes, r.allreduce_s, r.allreduce_stall_s) == (0, 0.0, 0.0)


def test_on_its_own_link_the_all_reduce_hides_behind_the_backward():
    """Two ranks send each gradient once (128 B = 1 s on a 128 B/s interconnect): g0 at t=3,
    g1 at t=4, g2 at t=5 -> done at 6; the optimizer (f5, from t=5) waits 1 s for g2."""
    r = simulate(_step(swap=False), _hw(collective_bandwidth=float(B)), data_parallel=2, bucket_bytes=1)
    assert r.allreduce_bytes == 3 * B and r.allreduce_s == pytest.approx(3.0)
    assert r.allreduce_stall_s == pytest.approx(1.0) and r.stall_s == pytest.approx(1.0)
    assert r.total_s == pytest.approx(7.0) and r.compute_s == pytest.approx(6.0)
    spans = [(e.start_s, e.end_s) for e in r.timeline if e.track == ALLREDUCE]
    assert spans == [(3.0, 4.0), (4.0, 5.0), (5.0, 6.0)]


def test_over_the_host_link_the_all_reduce_queues_with_the_swaps():
    """The activation comes back just before f3, right after g0's all-reduce was issued (at
    t=4, when f2 ends). On its own link (NVLink) the swap-in runs 4-5 beside it; over the host
    link (the PCIe presets) the all-reduce holds both copy channels 4-5 and the swap-in waits
    for it, 5-6: one more second of stall, and every later collective starts later too."""
    s = _step(swap=True)
    before = list(s.before)
    before[2] = ()
    before[3] = (Action(Op.SWAP_IN, 9), Action(Op.WAIT_IN, 9))
    late = Schedule(s.sequence, budget=s.budget, policy="hand", window=0, before=tuple(before),
                    after=s.after, initial_resident=s.initial_resident)
    own = simulate(late, _hw(collective_bandwidth=float(B)), data_parallel=2, bucket_bytes=1)
    shared = simulate(late, _hw(), data_parallel=2, bucket_bytes=1)
    swap_in = lambda r: [(e.start_s, e.end_s) for e in r.timeline if e.track == "swap-in"]   # noqa: E731
    assert swap_in(own) == [(4.0, 5.0)] and swap_in(shared) == [(5.0, 6.0)]
    assert (own.total_s, own.stall_s, own.allreduce_stall_s) == (9.0, 3.0, 1.0)   # 1 s wait_out too
    assert (shared.total_s, shared.stall_s, shared.allreduce_stall_s) == (10.0, 4.0, 1.0)
    assert own.allreduce_bytes == shared.allreduce_bytes == 3 * B
    assert shared.lower_bound_s >= shared.h2d_busy_s + shared.allreduce_s


def test_presets_say_which_link_carries_the_all_reduce():
    assert hardware("v100-16gb-nvlink").collective_bandwidth > 0        # NVLink between GPUs
    assert hardware("a100-40gb-pcie4").collective_bandwidth == 0        # over its PCIe lanes
    assert hardware("h100-80gb-pcie5").collective_bandwidth == 0
    assert hardware("cpu-edge").collective_bandwidth > 0                # Ethernet beside flash


def test_bad_rank_counts_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel"):
            simulate(_step(swap=False), _hw(), data_parallel=bad)
