"""What a schedule costs on given hardware: a discrete-event simulation of one training step.

The machine has one compute stream and two copy channels, host-to-device ("swap-in") and
device-to-host ("swap-out"), running at the same time (full duplex; a half-duplex tier, such
as one flash device, puts both directions on one queue). The schedule is executed as the
runtime executes it, in program order on the compute stream:

- a function takes its measured ``cost.seconds`` when known, else a roofline estimate
  ``max(flops / peak_flops, bytes / mem_bandwidth) + op_overhead_s``;
- ``swap_in v`` is issued when the compute stream reaches it, and its copy starts as soon as
  the swap-in channel is free (copies on one channel run one after another, first issued
  first served); it takes ``link_latency_s + bytes / h2d_bandwidth``;
- ``swap_out v`` after f_i is issued when f_i finishes (the stream is in order, so a copy of
  f_i's output never starts before f_i has produced it), and waits for its channel likewise;
- ``wait_in v`` / ``wait_out v`` stall the compute stream until that copy has finished: this
  is the only way transfers slow the step down;
- ``recompute v`` runs its chain on the compute stream: the chain's functions take their
  times as above (``recompute_s``), and the chain's temporaries count in the peak;
- on a CPU device each moved byte also costs the compute stream ``moved_byte_s`` (the
  copies and I/O threads take cycles from the compute threads), charged when the copy is
  issued (``copy_cpu_s``);
- ``drop``, ``discard`` and ``free`` take no time;
- on a device that runs ops as the host queues them (``Hardware.host_op_s`` or
  ``host_quiet_op_s`` set: a GPU), the host queues function i through the engine's per-op
  path in ``host_op_s`` (``host_quiet_op_s`` for one its plan gives no role,
  ``scheduler.schedule.quiet_functions``, and for each function a recompute replays), and
  the compute stream cannot start it before: ``host_s`` is that lane's length, ``host_wait_s``
  the compute stream's idle time behind it (a host-bound step);
- with ``data_parallel=r`` ranks, the gradients' all-reduce (``scheduler.data_parallel``:
  DDP's buckets, ring all-reduce) is issued after a bucket's last gradient is written and
  waited for before the first function that reads one of them again; it runs on its own
  channel, or on both copy channels when ``Hardware.collective_bandwidth`` is 0 (the host
  link), where it queues with the swaps (``allreduce_s``, ``allreduce_stall_s``).

Device memory is counted by ``scheduler.actions``' transition table, the one ``check`` and the
runtime follow: a swap-in takes its bytes when issued, a swap-out gives them back at its
``wait_out``, a function's new variables take theirs while it runs, ``drop``/``free`` give
them back. Every change happens on the compute stream,
so the peak over simulated time is the peak over program order, the figure ``check`` proves.

``lower_bound_s`` is the step time with perfect overlap, ``max(compute + recompute +
copy_cpu, swap-in busy, swap-out busy)`` (compute vs the sum of both directions on a half-duplex tier): no schedule
of the same transfers can beat it, and ``total_s - lower_bound_s`` is what the ordering costs.

The simulator trusts the schedule's budget (``check`` proves it) but refuses to make up an
answer for one it cannot execute: an action or a use the transition table refuses (a use of
a variable that is not resident, a wait for a copy never issued) raises
:class:`scheduler.actions.Refused`, with the same ``verdict`` as ``check``'s, naming the
function and the variable.
"""

from __future__ import annotations

import logging

from scheduler.actions import IN, USE, Ledger, Refused, Residency
from scheduler.data_parallel import DDP_BUCKET_BYTES, Bucket, gradient_buckets, ring_bytes
from scheduler.errors import ScheduleError
from scheduler.hardware import Hardware, hardware
from scheduler.memory_events import replay_allocator
from scheduler.schedule import Schedule, quiet_functions
from scheduler.sim_result import SimResult
from scheduler.timeline import ALLREDUCE, COMPUTE, RECOMPUTE, SWAP_IN, SWAP_OUT, WAIT, Event

log = logging.getLogger(__name__)

ALLOCATORS = ("caching", "vmm")
DEFAULT_CHUNK_BYTES = 2 << 20  # CUDA VMM's allocation granularity on current GPUs: 2 MiB

# How simulate's errors name the states of scheduler.actions.Residency.
_WORDS = {Residency.ABSENT: "not created yet", Residency.HOST: "not on the device",
          Residency.IN: "in flight in", Residency.RESIDENT: "resident",
          Residency.OUT: "in flight out", Residency.DEAD: "freed",
          Residency.DISCARDED: "discarded, to be recomputed"}


def simulate(
    schedule: Schedule,
    hw: Hardware | str,
    *,
    allocator: str | None = None,
    chunk_bytes: int | None = None,
    timeline: bool = True,
    data_parallel: int = 1,
    bucket_bytes: int = DDP_BUCKET_BYTES,
) -> SimResult:
    """Predict the time and device memory of one step of ``schedule`` on ``hw``.

    Args:
        schedule: a plan (``scheduler.plan``) or any hand-built :class:`Schedule`.
        hw: a :class:`Hardware` or a preset name (``scheduler.hardware.PRESETS``).
        allocator: also replay the step's allocations through an allocator model with
            ``hw.device_bytes`` of capacity: ``"caching"`` (PyTorch's best-fit caching
            allocator) or ``"vmm"`` (fixed chunks mapped onto virtual ranges, ``chunk_bytes``
            each, 2 MiB by default). Needs the ``vmm`` package's sim backend.
        timeline: record a :class:`scheduler.timeline.Event` per function, copy and stall
            (``write_chrome_trace(result.timeline, path)`` shows it); off for big sweeps.
        data_parallel: ranks of a DistributedDataParallel job running this step; from 2 on,
            the gradients' all-reduce runs beside the transfers (``bucket_bytes`` per DDP
            bucket).

    Deterministic: the same inputs give the same result, bit for bit. One step of 100,000
    functions takes about a second.

    Example::

        >>> from scheduler import plan, simulate
        >>> r = simulate(plan(seq, budget=8 << 30), "v100-16gb-nvlink")   # doctest: +SKIP
        >>> r.relative_speed, r.stall_s, r.peak_bytes                      # doctest: +SKIP
    """
    hw = hardware(hw)
    if allocator is not None and allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be None or one of {ALLOCATORS}, got {allocator!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive int (ranks), got {data_parallel!r}")
    seq = schedule.sequence
    variables = seq.variables
    nbytes = {v: var.nbytes for v, var in variables.items()}
    label = {v: (var.name or f"v{v}") for v, var in variables.items()}

    latency = hw.link_latency_s
    inv_bw = (1.0 / hw.h2d_bandwidth, 1.0 / hw.d2h_bandwidth)
    # chan[c]: when copy channel c is next free. A half-duplex tier has one channel for both.
    chan = [0.0, 0.0]
    ch_out = 1 if hw.full_duplex else 0
    busy = [0.0, 0.0]  # busy seconds by direction (in, out)
    moved = [0, 0]
    count = [0, 0]

    # What each action does to memory is the transition table's (scheduler.actions); this
    # function adds only *when* copies start and end.
    ledger = Ledger(seq, schedule.initial_resident)
    done: dict[int, float] = {}  # variable -> end of its copy in flight
    capacity = hw.device_bytes
    over_fn: int | None = None if ledger.device <= capacity else 0
    t = compute = stall = recompute = copy_cpu = 0.0
    recomputed = 0
    moved_byte_s = hw.moved_byte_s
    functions = seq.functions
    tl: list[Event] | None = [] if timeline else None
    # The host's lane (a device that runs ops as the host queues them): when it has queued
    # the ops so far, and the compute stream's time waiting for it.
    host_op, host_quiet = hw.host_op_s, hw.host_quiet_op_s
    host_lane = bool(host_op or host_quiet)
    quiet = quiet_functions(schedule) if host_lane and host_op != host_quiet else frozenset()
    host = host_wait = 0.0

    def queued(by: float, i: int) -> None:
        # The host queues what the compute stream runs next: it starts no sooner.
        nonlocal t, host, host_wait
        host += by
        if host > t:
            host_wait += host - t
            if tl is not None:
                tl.append(Event(WAIT, "host", t, host, 0, {"function": i}))
            t = host

    def fail(i: int, v: int, what: str) -> ScheduleError:
        f = seq.functions[i]
        return ScheduleError(
            f"simulate: function {i} ({f.name}): variable {v} ({label[v]}, {nbytes[v]} B) {what}; "
            f"run scheduler.check(schedule) for a full diagnosis", function=i, variable=v)

    def refused(err: Refused) -> Refused:
        # The table's verdict, in simulate's words (check's message is the full diagnosis).
        i, v, st = err.function, err.variable, err.state
        if err.action == USE:
            what = f"is used while {_WORDS[st]}"
        else:
            what = f"cannot {err.action.value} {err.phase} it: {err.reason}"
        f = seq.functions[i]
        return Refused(
            f"simulate: function {i} ({f.name}): variable {v} ({label[v]}, {nbytes[v]} B) {what}; "
            f"run scheduler.check(schedule) for a full diagnosis",
            action=err.action, variable=v, function=i, phase=err.phase, state=st, reason=err.reason)

    def copy(v: int, i: int, direction: int) -> None:
        # Issue a copy now (time t): it starts when its channel is free, first come first served.
        nonlocal t, copy_cpu
        n = nbytes[v]
        if moved_byte_s:   # a CPU device: moving the bytes takes compute time
            t += n * moved_byte_s
            copy_cpu += n * moved_byte_s
        c = ch_out if direction else 0
        start = chan[c] if chan[c] > t else t
        dur = latency + n * inv_bw[direction]
        end = start + dur
        chan[c] = end
        busy[direction] += dur
        moved[direction] += n
        count[direction] += 1
        done[v] = end
        if tl is not None:
            tl.append(Event(SWAP_OUT if direction else SWAP_IN, label[v], start, end, 0,
                            {"var": v, "bytes": n, "issued_s": t, "function": i}))

    def wait(v: int, i: int, op: str) -> None:
        # The compute stream blocks until v's copy is done: the only source of stall.
        nonlocal t, stall
        end = done.pop(v)
        if end > t:
            stall += end - t
            if tl is not None:
                tl.append(Event(WAIT, f"{op} {label[v]}", t, end, 0, {"var": v, "function": i}))
            t = end

    def rerun(v: int, i: int, chain: tuple[int, ...]) -> None:
        # recompute: the chain's functions run again, on the compute stream.
        nonlocal t, recompute, recomputed
        if host_lane:
            queued(host_quiet * len(chain), i)
        d = sum(hw.function_s(functions[k].cost) for k in chain)
        if tl is not None:
            tl.append(Event(RECOMPUTE, f"recompute {label[v]}", t, t + d, 0,
                            {"var": v, "bytes": nbytes[v], "chain": list(chain), "function": i}))
        t += d
        recompute += d
        recomputed += nbytes[v]

    # Data-parallel: buckets issued after function i, waited for before function j.
    buckets = gradient_buckets(seq, bucket_bytes) if data_parallel > 1 else []
    issue_after: dict[int, list[Bucket]] = {}
    wait_before: dict[int | None, list[Bucket]] = {}
    for b in buckets:
        issue_after.setdefault(b.ready_after, []).append(b)
        wait_before.setdefault(b.needed_before, []).append(b)
    shared = hw.collective_bandwidth == 0
    coll = [0.0]   # when the collective channel is next free (own link only)
    reduced: dict[Bucket, float] = {}
    ar = [0, 0.0, 0.0]   # bytes sent, busy seconds, stall seconds

    def all_reduce(b: Bucket) -> None:
        n = ring_bytes(b.nbytes, data_parallel)
        if shared:   # sends on the device-to-host lanes, receives on the host-to-device ones
            start = max(t, chan[0], chan[ch_out])
            end = start + latency + n * max(inv_bw)
            chan[0] = chan[ch_out] = end
        else:
            start = max(t, coll[0])
            end = start + hw.collective_latency_s + n / hw.collective_bandwidth
            coll[0] = end
        reduced[b] = end
        ar[0] += n
        ar[1] += end - start
        if tl is not None:
            tl.append(Event(ALLREDUCE, f"all-reduce {len(b.variables)} grads", start, end, 0,
                            {"bytes": n, "gradients": list(b.variables), "issued_s": t}))

    def await_reduced(bs: list[Bucket], i: int) -> None:
        nonlocal t, stall
        end = max(reduced.pop(b) for b in bs)
        if end > t:
            stall += end - t
            ar[2] += end - t
            if tl is not None:
                tl.append(Event(WAIT, "all-reduce", t, end, 0, {"function": i}))
            t = end

    def run(acts: tuple, i: int, phase: str) -> None:
        nonlocal over_fn
        for a in acts:
            v = a.var
            eff = apply(a.op, v, i, phase, a.chain)
            if eff.in_flight > 0:     # swap_in / swap_out: a copy is issued
                copy(v, i, 0 if eff.to is IN else 1)
            elif eff.in_flight < 0:   # wait_in / wait_out: the compute stream waits for it
                wait(v, i, a.op.value)
            elif eff.needs_chain:
                rerun(v, i, a.chain)
            if eff.device > 0 and over_fn is None and ledger.peak > capacity:
                over_fn = i

    apply = ledger.apply
    before, after = schedule.before, schedule.after
    try:
        for i, f in enumerate(seq.functions):
            if before[i]:
                run(before[i], i, "before")
            if i in wait_before:
                await_reduced(wait_before[i], i)
            # (the function) every variable it touches must be resident; first writes create.
            ledger.run(i)
            if over_fn is None and ledger.device > capacity:
                over_fn = i
            if host_lane:
                queued(host_quiet if i in quiet else host_op, i)
            # measured seconds, else the roofline (arithmetic or memory traffic, plus the launch)
            d = hw.function_s(f.cost)
            if tl is not None:
                tl.append(Event(COMPUTE, f.name, t, t + d, 0, {"function": i}))
            t += d
            compute += d
            if after[i]:
                run(after[i], i, "after")
            for b in issue_after.get(i, ()):
                all_reduce(b)
        if None in wait_before:   # read by nothing in the step: its end waits for them
            await_reduced(wait_before[None], len(functions))
    except Refused as err:
        raise refused(err) from None
    peak = ledger.peak
    peak_fn = ledger.peak_function or 0

    total = max(t, chan[0], chan[1], coll[0])
    busy_compute = max(compute + recompute + copy_cpu, host)
    link = (ar[1], ar[1]) if shared else (0.0, 0.0)   # the all-reduce on the copy channels
    if hw.full_duplex:
        lower = max(busy_compute, busy[0] + link[0], busy[1] + link[1], 0.0 if shared else ar[1])
    else:
        lower = max(busy_compute, busy[0] + busy[1] + link[0], 0.0 if shared else ar[1])

    if allocator is None:
        reserved, fits, oom_fn = peak, over_fn is None, over_fn
    else:
        chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
        reserved, fits, oom_fn = replay_allocator(schedule, hw, allocator, chunk_bytes)

    return SimResult(
        total_s=total, compute_s=compute, stall_s=stall, lower_bound_s=lower,
        peak_bytes=peak, peak_function=peak_fn, bytes_in=moved[0], bytes_out=moved[1],
        transfers_in=count[0], transfers_out=count[1], h2d_busy_s=busy[0], d2h_busy_s=busy[1],
        hardware=hw, policy=schedule.policy, budget=schedule.budget,
        timeline=tuple(tl) if tl is not None else (),
        allocator=allocator, chunk_bytes=chunk_bytes if allocator is not None else None,
        reserved_peak_bytes=reserved, fits=fits, oom_function=oom_fn,
        recompute_s=recompute, bytes_recomputed=recomputed, copy_cpu_s=copy_cpu,
        data_parallel=data_parallel, allreduce_bytes=ar[0], allreduce_s=ar[1], allreduce_stall_s=ar[2],
        host_s=host, host_wait_s=host_wait)
