"""The simulator on hand-built schedules whose answers are worked out by hand.

Test hardware moves 128 B/s each way with no latency and no launch overhead, so a 128-byte
variable takes exactly 1 s to copy and the expected times below are exact.
"""

from __future__ import annotations

import json

import pytest

from scheduler.errors import ScheduleError
from scheduler.hardware import Hardware, hardware
from scheduler.ir import Cost, Kind, Variable, build_sequence
from scheduler.memory_events import allocation_events, creations
from scheduler.schedule import Action, Op, Schedule
from scheduler.simulate import SimResult, simulate

B = 128  # bytes in one second of copy on the test link


def _hw(**kw) -> Hardware:
    base = dict(name="test", device_bytes=1 << 20, peak_flops=1e12, mem_bandwidth=1e11,
                h2d_bandwidth=float(B), d2h_bandwidth=float(B), link_latency_s=0.0, op_overhead_s=0.0)
    base.update(kw)
    return Hardware(**base)


def _schedule(functions, variables, before=None, after=None, initial=(), budget=1 << 20) -> Schedule:
    """``before``/``after``: {function index: [(op, var), ...]}."""
    seq = build_sequence(functions, variables)
    n = len(seq.functions)
    acts = lambda d, i: tuple(Action(Op(op), v) for op, v in (d or {}).get(i, ()))  # noqa: E731
    return Schedule(seq, budget=budget, policy="hand", window=0,
                    before=tuple(acts(before, i) for i in range(n)),
                    after=tuple(acts(after, i) for i in range(n)),
                    initial_resident=frozenset(initial))


def _sec(s: float) -> Cost:
    return Cost(seconds=s)


def _by_track(r: SimResult, track: str) -> list[tuple[str, float, float]]:
    return [(e.name, e.start_s, e.end_s) for e in r.timeline if e.track == track]


# -- time ------------------------------------------------------------------------------------


def test_pure_compute_is_the_sum_of_function_times() -> None:
    s = _schedule([("f0", [(0, "w")], _sec(1.0)), ("f1", [(0, "r"), (1, "w")], _sec(2.0)),
                   ("f2", [(1, "r")], _sec(0.5))],
                  [Variable(0, 10, Kind.ACTIVATION), Variable(1, 20, Kind.ACTIVATION)],
                  after={1: [("free", 0)], 2: [("free", 1)]})
    r = simulate(s, _hw())
    assert (r.total_s, r.compute_s, r.stall_s, r.lower_bound_s) == (3.5, 3.5, 0.0, 3.5)
    assert (r.bytes_in, r.bytes_out, r.peak_bytes, r.peak_function) == (0, 0, 30, 1)
    assert _by_track(r, "compute") == [("f0", 0.0, 1.0), ("f1", 1.0, 3.0), ("f2", 3.0, 3.5)]
    assert r.relative_speed == 1.0


def _prefetch(x_bytes: int, f0_seconds: float) -> Schedule:
    # x lives in the slower tier; it is prefetched before f0 and needed by f1.
    return _schedule([("f0", [(1, "r")], _sec(f0_seconds)), ("f1", [(0, "r"), (1, "r")], _sec(1.0))],
                     [Variable(0, x_bytes, Kind.PARAM, "x", live_in=True, live_out=True),
                      Variable(1, 8, Kind.PARAM, "w", live_in=True, live_out=True)],
                     before={0: [("swap_in", 0)], 1: [("wait_in", 0)]},
                     after={1: [("swap_out", 0), ("wait_out", 0)]}, initial={1})


def test_swap_in_hidden_behind_compute_costs_nothing() -> None:
    r = simulate(_prefetch(B, 2.0), _hw())  # 1 s copy under a 2 s function
    assert _by_track(r, "swap-in") == [("x", 0.0, 1.0)]
    assert _by_track(r, "compute")[1] == ("f1", 2.0, 3.0)  # f1 starts on time
    # The only stall is the trailing swap-out, waited right after f1: 1 s at the end.
    assert _by_track(r, "wait") == [("wait_out x", 3.0, 4.0)]
    assert r.stall_s == 1.0 and r.total_s == pytest.approx(4.0)
    assert _by_track(r, "swap-out") == [("x", 3.0, 4.0)]


def test_swap_in_that_cannot_be_hidden_stalls_exactly_the_difference() -> None:
    s = _prefetch(5 * B, 2.0)  # 5 s copy, 2 s of compute to hide it
    r = simulate(s, _hw())
    f1 = _by_track(r, "compute")[1]
    assert f1[1] == pytest.approx(5.0)  # f1 starts when x has landed
    waits = _by_track(r, "wait")
    assert waits[0] == ("wait_in x", 2.0, pytest.approx(5.0))
    # 3 s waiting for x to come in, then 5 s waiting for it to go out.
    assert r.stall_s == pytest.approx(3.0 + 5.0)
    assert r.total_s == pytest.approx(r.compute_s + r.stall_s) == pytest.approx(11.0)
    assert r.lower_bound_s == pytest.approx(5.0)


def _duplex() -> Schedule:
    # y goes out after f0 (at t=1) while x comes in, issued at the same moment.
    return _schedule([("f0", [(1, "r")], _sec(1.0)), ("f1", [(0, "r")], _sec(1.0))],
                     [Variable(0, 2 * B, Kind.PARAM, "x", live_in=True, live_out=True),
                      Variable(1, 2 * B, Kind.PARAM, "y", live_in=True, live_out=True)],
                     before={1: [("swap_in", 0), ("wait_in", 0), ("wait_out", 1)]},
                     after={0: [("swap_out", 1)]}, initial={1})


def test_full_duplex_copies_both_ways_at_once() -> None:
    r = simulate(_duplex(), _hw())
    assert _by_track(r, "swap-out") == [("y", 1.0, 3.0)]
    assert _by_track(r, "swap-in") == [("x", 1.0, 3.0)]
    assert r.total_s == pytest.approx(4.0) and r.stall_s == pytest.approx(2.0)
    assert r.lower_bound_s == pytest.approx(2.0)


def test_half_duplex_tier_queues_both_directions_on_one_channel() -> None:
    r = simulate(_duplex(), _hw(full_duplex=False))
    assert _by_track(r, "swap-out") == [("y", 1.0, 3.0)]
    assert _by_track(r, "swap-in") == [("x", 3.0, 5.0)]  # behind the swap-out, first issued
    assert r.total_s == pytest.approx(6.0)
    assert r.lower_bound_s == pytest.approx(4.0)  # both directions share the medium


def test_one_channel_is_first_in_first_out() -> None:
    # Three prefetches issued together; waited in the opposite order.
    s = _schedule([("f0", [(0, "r"), (1, "r"), (2, "r")], _sec(0.5))],
                  [Variable(v, n, Kind.PARAM, f"p{v}", live_in=True) for v, n in ((0, B), (1, 2 * B), (2, B))],
                  before={0: [("swap_in", 0), ("swap_in", 1), ("swap_in", 2),
                              ("wait_in", 2), ("wait_in", 1), ("wait_in", 0)]},
                  after={0: [("free", 0), ("free", 1), ("free", 2)]})
    r = simulate(s, _hw())
    assert _by_track(r, "swap-in") == [("p0", 0.0, 1.0), ("p1", 1.0, 3.0), ("p2", 3.0, 4.0)]
    assert r.stall_s == pytest.approx(4.0)  # waiting on p2 covers the others
    assert [w[0] for w in _by_track(r, "wait")] == ["wait_in p2"]
    assert r.total_s == pytest.approx(4.5)
    assert r.h2d_busy_s == pytest.approx(4.0) and r.transfers_in == 3 and r.bytes_in == 4 * B


def test_swap_out_starts_when_its_function_ends_and_latency_counts() -> None:
    s = _schedule([("f0", [(0, "w")], _sec(2.0)), ("f1", [(1, "w")], _sec(1.0))],
                  [Variable(0, B, Kind.ACTIVATION, "a", live_out=True), Variable(1, 8, Kind.TEMPORARY)],
                  after={0: [("swap_out", 0)], 1: [("free", 1), ("wait_out", 0)]})
    r = simulate(s, _hw(link_latency_s=0.25))
    assert _by_track(r, "swap-out") == [("a", 2.0, 3.25)]
    assert r.total_s == pytest.approx(3.25) and r.stall_s == pytest.approx(0.25)


def test_transfers_still_running_at_the_end_extend_the_step() -> None:
    s = _schedule([("f0", [(0, "w")], _sec(1.0))], [Variable(0, 3 * B, Kind.ACTIVATION, "a", live_out=True)],
                  after={0: [("swap_out", 0)]})
    r = simulate(s, _hw())
    assert r.total_s == pytest.approx(4.0) and r.stall_s == 0.0 and r.compute_s == 1.0


# -- memory ----------------------------------------------------------------------------------


def test_peak_counts_in_flight_copies_and_new_variables() -> None:
    # p (100) resident; x (200) swapped in before f0; f0 creates a (50); a goes out after f0
    # but keeps its memory until wait_out before f2; f1 creates b (70) meanwhile.
    s = _schedule(
        [("f0", [(0, "r"), (2, "w")], _sec(1.0)), ("f1", [(1, "r"), (3, "w")], _sec(1.0)),
         ("f2", [(3, "r")], _sec(1.0))],
        [Variable(0, 100, Kind.PARAM, live_in=True, live_out=True),
         Variable(1, 200, Kind.PARAM, live_in=True, live_out=True),
         Variable(2, 50, Kind.ACTIVATION, live_out=True), Variable(3, 70, Kind.ACTIVATION)],
        before={0: [("swap_in", 1)], 1: [("wait_in", 1)], 2: [("wait_out", 2)]},
        after={0: [("swap_out", 2)], 1: [("drop", 1)], 2: [("free", 3)]},
        initial={0})
    r = simulate(s, _hw(h2d_bandwidth=1e6, d2h_bandwidth=1e6))
    assert r.peak_bytes == 100 + 200 + 50 + 70
    assert r.peak_function == 1
    assert (r.bytes_in, r.bytes_out) == (200, 50)
    assert r.fits and r.reserved_peak_bytes == r.peak_bytes and r.oom_function is None
    small = simulate(s, _hw(device_bytes=400, h2d_bandwidth=1e6, d2h_bandwidth=1e6))
    assert not small.fits and small.oom_function == 1


# -- roofline --------------------------------------------------------------------------------


def test_roofline_when_seconds_are_unknown() -> None:
    hw = _hw(peak_flops=1e12, mem_bandwidth=1e9, op_overhead_s=1e-3)
    s = _schedule([("matmul", [(0, "w")], Cost(flops=2e12, bytes=1_000_000)),     # compute-bound: 2 s
                   ("add", [(0, "r"), (1, "w")], Cost(flops=1e6, bytes=3_000_000_000)),  # memory-bound: 3 s
                   ("measured", [(1, "r")], Cost(flops=1e15, seconds=0.25))],  # measured wins, no overhead
                  [Variable(0, 8, Kind.ACTIVATION), Variable(1, 8, Kind.ACTIVATION)],
                  after={1: [("free", 0)], 2: [("free", 1)]})
    r = simulate(s, hw)
    durations = [e.end_s - e.start_s for e in r.timeline if e.track == "compute"]
    assert durations == pytest.approx([2.001, 3.001, 0.25])


# -- errors, API -----------------------------------------------------------------------------


def test_use_of_a_variable_not_on_the_device_names_it() -> None:
    s = _schedule([("f0", [(0, "r")], _sec(1.0))], [Variable(0, 64, Kind.PARAM, "w", live_in=True)])
    with pytest.raises(ScheduleError) as err:
        simulate(s, _hw())
    assert "function 0 (f0)" in str(err.value) and "variable 0 (w, 64 B)" in str(err.value)
    assert err.value.function == 0 and err.value.variable == 0


def test_wait_without_a_copy_and_use_before_wait_are_refused() -> None:
    v = [Variable(0, 64, Kind.PARAM, "w", live_in=True)]
    with pytest.raises(ScheduleError, match="no swap_in issued"):
        simulate(_schedule([("f0", [(0, "r")], _sec(1.0))], v, before={0: [("wait_in", 0)]}), _hw())
    with pytest.raises(ScheduleError, match="used while in flight in"):
        simulate(_schedule([("f0", [(0, "r")], _sec(1.0))], v, before={0: [("swap_in", 0)]}), _hw())


def test_to_dict_has_the_stable_plain_fields() -> None:
    r = simulate(_prefetch(B, 2.0), "v100-16gb-nvlink")
    d = r.to_dict()
    assert set(d) == {"total_s", "compute_s", "stall_s", "lower_bound_s", "peak_bytes", "bytes_in",
                      "bytes_out", "recompute_s", "bytes_recomputed", "copy_cpu_s", "hardware", "policy",
                      "budget", "data_parallel", "allreduce_bytes", "allreduce_s", "allreduce_stall_s",
                      "host_s", "host_wait_s"}
    assert json.loads(json.dumps(d)) == d
    assert d["hardware"] == "v100-16gb-nvlink" and d["policy"] == "hand"
    with pytest.raises(ValueError, match="allocator"):
        simulate(_prefetch(B, 2.0), _hw(), allocator="buddy")


def _host_lane_step() -> Schedule:
    """f0 makes x (1 s), f1 and f2 touch nothing managed (0.5 s each: quiet), f3 reads x (1 s)."""
    return _schedule([("f0", [(0, "w")], _sec(1.0)), ("f1", [], _sec(0.5)), ("f2", [], _sec(0.5)),
                      ("f3", [(0, "r")], _sec(1.0))],
                     [Variable(0, 10, Kind.ACTIVATION)], after={3: [("free", 0)]})


def test_the_host_lane_holds_the_compute_stream_back_only_when_it_is_slower() -> None:
    """A device that runs ops as the host queues them: an op starts no sooner than the host
    queued it (``host_op_s`` for an op the plan gives a role, ``host_quiet_op_s`` for a quiet
    one). A fast host changes nothing; a slow one makes the step host-bound, and the lower
    bound knows it."""
    s = _host_lane_step()
    off = simulate(s, _hw())
    assert (off.total_s, off.host_s, off.host_wait_s) == (3.0, 0.0, 0.0)
    fast = simulate(s, _hw(host_op_s=0.25, host_quiet_op_s=0.125))
    assert (fast.total_s, fast.compute_s, fast.host_s, fast.host_wait_s) == (3.25, 3.0, 0.75, 0.25)
    # f0 waits 0.25 s for its queuing; then the host stays ahead
    slow = simulate(s, _hw(host_op_s=2.0, host_quiet_op_s=1.0))
    # host: f0 at 2, f1 at 3, f2 at 4, f3 at 6; device: f0 2-3, f1 3-3.5, f2 4-4.5, f3 6-7
    assert (slow.total_s, slow.host_s, slow.host_wait_s) == (7.0, 6.0, 4.0)
    assert slow.lower_bound_s == 6.0 and slow.relative_speed == 3.0 / 7.0
    assert [e.name for e in slow.timeline if e.track == "wait"] == ["host"] * 3   # f1 was queued in time
    quiet_like_all = simulate(s, _hw(host_op_s=2.0, host_quiet_op_s=2.0))
    assert quiet_like_all.host_s == 8.0


def test_a_recompute_queues_each_function_it_replays() -> None:
    """The host queues a replayed chain's functions at ``host_quiet_op_s`` each."""
    v = [Variable(0, 10, Kind.ACTIVATION), Variable(1, 10, Kind.ACTIVATION)]
    fns = [("f0", [(0, "w")], _sec(1.0)), ("f1", [(0, "r"), (1, "w")], _sec(1.0), {"replayable": True}),
           ("f2", [], _sec(1.0)),
           ("f3", [(0, "r"), (1, "r")], _sec(1.0))]
    seq = build_sequence(fns, v)
    n = len(seq.functions)
    before = [() for _ in range(n)]
    after = [() for _ in range(n)]
    before[3] = (Action(Op.RECOMPUTE, 1, (1,)),)
    after[1] = (Action(Op.DISCARD, 1),)
    after[3] = (Action(Op.FREE, 0), Action(Op.FREE, 1))
    s = Schedule(seq, budget=1 << 20, policy="hand", window=0, before=tuple(before), after=tuple(after),
                 initial_resident=frozenset())
    r = simulate(s, _hw(host_op_s=0.5, host_quiet_op_s=0.25))
    # host: f0 0.5, f1 1.0, f2 (quiet) 1.25, the replay of f1 1.5, f3 2.0
    assert r.host_s == 2.0 and r.recompute_s == 1.0 and r.total_s == 5.5


# -- a whole step ----------------------------------------------------------------------------


def chain_schedule(n: int, keep: int, lookahead: int, nbytes: int = 1 << 20,
                   seconds: float = 1e-3) -> Schedule:
    """n forward layers a_j = f(a_{j-1}, p), backward g_j = b(a_j, g_{j+1}) in reverse.

    Activations but the last ``keep`` go out after their last forward use and come back
    ``lookahead`` functions before their backward use.
    """
    P, A, G = 0, (lambda j: 1 + j), (lambda j: 1 + n + j)
    vs = [Variable(P, nbytes, Kind.PARAM, "p", live_in=True, live_out=True)]
    vs += [Variable(A(j), nbytes, Kind.ACTIVATION, f"a{j}") for j in range(n)]
    vs += [Variable(G(j), nbytes, Kind.TEMPORARY, f"g{j}") for j in range(n)]
    fns = [(f"fwd{j}", [(P, "r"), (A(j), "w")] + ([(A(j - 1), "r")] if j else []), _sec(seconds))
           for j in range(n)]
    fns += [(f"bwd{j}", [(A(j), "r"), (G(j), "w")] + ([(G(j + 1), "r")] if j < n - 1 else []), _sec(seconds))
            for j in reversed(range(n))]
    N = 2 * n
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for j in range(n - keep):
        use = N - 1 - j
        after.setdefault(j + 1, []).append(("swap_out", A(j)))
        before.setdefault(j + 3, []).append(("wait_out", A(j)))
        before.setdefault(max(use - lookahead, j + 3), []).append(("swap_in", A(j)))
        before.setdefault(use, []).append(("wait_in", A(j)))
    for k in range(n):
        j = n - 1 - k
        after.setdefault(n + k, []).extend([("free", A(j))] + ([("free", G(j + 1))] if j < n - 1 else []))
    after[N - 1].append(("free", G(0)))
    return _schedule(fns, vs, before, after, initial={P}, budget=(keep + lookahead + 8) * nbytes)


def test_chain_step_overlaps_on_a_fast_link_and_stalls_on_a_slow_one() -> None:
    s = chain_schedule(200, keep=10, lookahead=4)
    fast = simulate(s, hardware("v100-16gb-nvlink"))  # 1 MiB in ~21 us, under 1 ms of compute
    assert fast.stall_s == 0.0 and fast.total_s == pytest.approx(fast.compute_s)
    slow = simulate(s, hardware("cpu-edge", storage_bandwidth=100e6))  # ~10 ms per MiB, half duplex
    assert slow.stall_s > 0.1 and slow.total_s > fast.total_s
    for r in (fast, slow):
        assert r.lower_bound_s <= r.total_s + 1e-12
        assert r.compute_s == pytest.approx(0.4) and r.bytes_in == r.bytes_out == 190 << 20
        assert r.peak_bytes <= s.budget
        # nothing trails the last wait; on the CPU preset moved bytes also cost compute time
        assert r.total_s == pytest.approx(r.compute_s + r.stall_s + r.copy_cpu_s)
    assert fast.copy_cpu_s == 0.0 and slow.copy_cpu_s == pytest.approx(380 * 2**20 * hardware("cpu-edge").moved_byte_s)
    assert simulate(s, "cpu-edge") == simulate(s, "cpu-edge")  # deterministic


def test_a_large_step_is_simulated_without_a_timeline() -> None:
    """40,000 functions, 80,000 copies. Its speed is not asserted (a unit test never reads the
    clock): the planner simulates its candidates, so benchmarks/bench_plan.py's times hold it."""
    s = chain_schedule(20_000, keep=10, lookahead=4)
    r = simulate(s, "v100-16gb-nvlink", timeline=False)
    assert r.timeline == () and r.transfers_in == 19_990


# -- allocation events -----------------------------------------------------------------------


def test_creations_are_first_writes_of_non_live_in_variables() -> None:
    s = _prefetch(B, 1.0)
    assert creations(s) == ((), ())
    c = chain_schedule(3, keep=1, lookahead=1)
    assert creations(c)[0] == (1,) and creations(c)[3] == (6,)  # fwd0 -> a0; bwd2 -> g2


def test_allocation_events_follow_the_schedule() -> None:
    pytest.importorskip("vmm.replay")
    s = _schedule(
        [("f0", [(0, "r"), (2, "w")], _sec(1.0)), ("f1", [(2, "r")], _sec(1.0))],
        [Variable(0, 100, Kind.PARAM, live_in=True, live_out=True),
         Variable(1, 200, Kind.PARAM, live_in=True, live_out=True),
         Variable(2, 50, Kind.ACTIVATION)],
        before={0: [("swap_in", 0), ("wait_in", 0)]},
        after={0: [("swap_out", 0)], 1: [("wait_out", 0), ("free", 2)]},
        initial={1})
    evs = allocation_events(s)
    assert [(e.action, e.key, e.nbytes) for e in evs] == [
        ("alloc", 1, 200), ("alloc", 0, 100), ("alloc", 2, 50),
        ("free", 0, 100), ("free", 2, 50)]
    # The replayed live peak is the simulator's peak.
    assert simulate(s, _hw()).peak_bytes == 350


def test_caching_and_vmm_replay_of_a_step() -> None:
    pytest.importorskip("vmm.replay")
    s = chain_schedule(60, keep=6, lookahead=3, nbytes=3 << 20)  # 3 MiB: not a chunk multiple
    chunk = 2 << 20
    base = simulate(s, "v100-16gb-nvlink")
    caching = simulate(s, "v100-16gb-nvlink", allocator="caching")
    va = simulate(s, "v100-16gb-nvlink", allocator="vmm", chunk_bytes=chunk)
    assert caching.fits and va.fits
    assert caching.peak_bytes == va.peak_bytes == base.peak_bytes
    from vmm import CachingAllocator, SimBackend
    from vmm.replay import replay

    # The event stream's own live peak is the simulator's peak: one memory model, two views.
    assert replay(allocation_events(s), CachingAllocator(SimBackend()), name="c").peak_live_bytes \
        == base.peak_bytes
    assert caching.reserved_peak_bytes >= base.peak_bytes
    # Virtual addressing wastes less than one chunk per live allocation.
    live_max = max(_live_counts(s))
    assert base.peak_bytes <= va.reserved_peak_bytes <= base.peak_bytes + live_max * chunk
    d = va.to_dict()
    assert d["allocator"] == "vmm" and d["chunk_bytes"] == chunk and d["fits"] is True
    # A device smaller than the step's peak does not fit, with either allocator.
    tiny = hardware("v100-16gb-nvlink", device_bytes=base.peak_bytes // 2)
    for kind in ("caching", "vmm"):
        r = simulate(s, tiny, allocator=kind, chunk_bytes=chunk)
        assert not r.fits and r.oom_function is not None


def _live_counts(s: Schedule) -> list[int]:
    live, out = 0, []
    for e in allocation_events(s):
        live += 1 if e.action == "alloc" else -1
        out.append(live)
    return out


# -- with the real planner, once it is there -------------------------------------------------


def test_planned_schedules_simulate_within_their_budget() -> None:
    planner = pytest.importorskip("scheduler.planner")
    check = pytest.importorskip("scheduler.check")
    s0 = chain_schedule(120, keep=120, lookahead=0)  # only to borrow the sequence
    seq = s0.sequence
    budget = seq.in_core_peak_bytes // 3
    in_core = simulate(planner.plan(seq, budget=seq.in_core_peak_bytes, policy="none"), "v100-16gb-nvlink")
    for policy in ("window", "vdnn", "lms"):
        sched = planner.plan(seq, budget=budget, policy=policy)
        r = simulate(sched, "v100-16gb-nvlink")
        assert r.peak_bytes == check.check(sched).peak_bytes <= budget
        assert r.lower_bound_s <= r.total_s
        assert r.compute_s == pytest.approx(in_core.compute_s)
        assert r.bytes_in == sched.bytes_in and r.bytes_out == sched.bytes_out
    assert in_core.stall_s == 0.0 and in_core.bytes_in == 0


def test_planned_schedule_replays_through_both_allocators() -> None:
    planner = pytest.importorskip("scheduler.planner")
    pytest.importorskip("vmm.replay")
    seq = chain_schedule(80, keep=80, lookahead=0, nbytes=3 << 20).sequence
    sched = planner.plan(seq, budget=seq.in_core_peak_bytes // 2, policy="window")
    base = simulate(sched, "a100-40gb-pcie4")
    for kind in ("caching", "vmm"):
        r = simulate(sched, "a100-40gb-pcie4", allocator=kind)
        assert r.fits and r.reserved_peak_bytes >= base.peak_bytes


def test_simulated_timeline_writes_a_chrome_trace(tmp_path) -> None:
    from scheduler.timeline import write_chrome_trace

    r = simulate(_prefetch(5 * B, 2.0), _hw())
    path = tmp_path / "sim.json"
    write_chrome_trace(r.timeline, path)
    trace = json.loads(path.read_text())
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert set(threads.values()) == {"step", "compute", "wait", "swap-in", "swap-out"}
    ends = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(ends) == pytest.approx(r.total_s * 1e6)
