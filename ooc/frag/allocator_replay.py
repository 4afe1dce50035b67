"""Replaying a trace through one allocator while watching it: the caching model under a
``PYTORCH_CUDA_ALLOC_CONF`` setting, or ooc's allocator (or pure chunks) of one chunk size,
on the sim backend (nothing is allocated).

:func:`replay_one` drives ``vmm.replay`` over the events and reads the allocator between them
(:class:`_Watched`): the moment its reserved bytes peak, its state at each recorded OOM, and
the envelope of live and reserved bytes the plot draws. Apart from :mod:`ooc.frag.report`
(which replays, and what it says about the results) because this is the measuring, and
``bench_frag`` and ``ooc frag --export`` make the same allocators (:func:`make_allocator`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from vmm.alloc_conf import AllocConf
from vmm.replay import Event, replay
from vmm.units import format_size

from ooc.frag.report_data import AllocatorReport, Moment
from ooc.frag.trace_data import Trace, gc_paused

log = logging.getLogger(__name__)

__all__ = ["GRANULARITY", "ENVELOPE_BINS", "allocator_name", "make_allocator", "replay_one"]

GRANULARITY = 2 << 20  # CUDA VMM granularity on current GPUs; chunks are multiples of it
# Pool capacity standing for "unlimited" (a pool makes chunks lazily: nothing is allocated).
_UNLIMITED = 1 << 60
ENVELOPE_BINS = 1200  # the plot's resolution along the events (about one bin per pixel)


def allocator_name(chunk_bytes: int | None, conf: AllocConf | None = None, *,
                   pure: bool = False) -> str:
    """``"caching"``, ``"vmm-20MiB"`` (ooc's allocator: small blocks packed into 20 MiB
    chunks, larger requests as virtual ranges of whole chunks), ``"chunks-2MiB"`` (pure
    chunks: every request rounded up to whole chunks, the comparison row) or a
    ``PYTORCH_CUDA_ALLOC_CONF`` line such as ``"expandable_segments:True"``: the names the
    report, JSON and plot use."""
    if chunk_bytes is None:
        return (conf.line() if conf is not None else "") or "caching"
    return ("chunks-" if pure else "vmm-") + format_size(chunk_bytes).replace(" ", "")


def make_allocator(chunk_bytes: int | None, capacity: int | None, *, keep_mapped: bool = True,
                   conf: AllocConf | None = None, pure: bool = False) -> Any:
    """A fresh allocator on the sim backend: the caching model (``chunk_bytes`` None) under
    ``conf`` (None: PyTorch's defaults), or ooc's allocator with chunks of ``chunk_bytes``
    (``capacity`` None: unlimited): :class:`vmm.SmallBlockAllocator` over a virtual
    allocator with :func:`vmm.default_tiers`, the configuration the runtime's device pools
    run (``pure``: the virtual allocator alone, every request in whole chunks)."""
    import vmm

    if chunk_bytes is None:
        if conf is not None:
            return conf.make(capacity, vmm.SimBackend(granularity=GRANULARITY))
        return vmm.CachingAllocator(vmm.SimBackend(granularity=GRANULARITY), capacity_bytes=capacity)
    pool = vmm.ChunkPool(vmm.SimBackend(granularity=GRANULARITY), chunk_bytes=chunk_bytes,
                         capacity_bytes=capacity if capacity is not None else _UNLIMITED)
    virtual = vmm.VirtualAllocator(pool, keep_mapped=keep_mapped)
    return virtual if pure else vmm.SmallBlockAllocator(virtual)


class _Watched:
    """The events, handed to ``replay`` one by one while watching the allocator between
    them: the moment its reserved bytes peak, its state at each recorded OOM, and the
    envelope of live and reserved bytes (max and min per bin of events) for the plot:
    ``replay``'s own samples are decimated, and would miss short spikes on long traces.

    ``replay`` stays the only driver of the allocator; this only reads plain counters
    (O(1) per event) and calls ``largest_free_block`` at the few marked events.
    Call :meth:`close` after the replay (it may stop early at an OOM).
    """

    def __init__(self, events: list[Event], allocator: Any, kind: str, marks: Sequence[int]):
        self.events = events
        self.allocator = allocator
        self.kind = kind
        self.marks = sorted(set(marks))
        self.peak: tuple[int, int, int, int] | None = None  # event, requested, allocated, mapped
        self.max_unused = 0  # the largest mapped - requested seen between events
        self.at_marks: dict[int, Moment] = {}
        self.envelope: list[tuple[int, int, int, int]] = []  # (first event, live max, resv max, resv min)
        self._gen: Any = None

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        self._gen = self._run()
        return self._gen

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()  # runs the generator's ``finally``: the last bin is kept

    def _run(self) -> Iterator[Event]:
        a = self.allocator
        caching = self.kind == "caching"
        marks = self.marks
        next_mark = marks[0] if marks else -1
        mi = 0
        width = max(1, -(-len(self.events) // ENVELOPE_BINS))
        cut = width
        first = 0
        # The peak and the bin's extremes start at the state before the first event (the
        # loop's first comparisons then change nothing), so that a new high is tested before
        # a new low, and a new peak only under a new high of the bin (best >= hi_m): the
        # fewest comparisons per event.
        hi_m = lo_m = best = a.mapped_bytes
        hi_r = a.requested_bytes
        self.peak = (0, hi_r, a.allocated_bytes if caching else best, best)
        unused = 0
        env = self.envelope
        i = 0
        try:
            # State i is the allocator after events[:i], seen just before events[i] is applied.
            for i, ev in enumerate(self.events):
                m = a.mapped_bytes
                r = a.requested_bytes
                if m - r > unused:
                    unused = m - r
                if i == cut:
                    env.append((first, hi_r, hi_m, lo_m))
                    first, cut = i, cut + width
                    hi_r, hi_m, lo_m = r, m, m
                    if m > best:
                        best = m
                        self.peak = (i, r, a.allocated_bytes if caching else m, m)
                else:
                    if m > hi_m:
                        hi_m = m
                        if m > best:
                            best = m
                            self.peak = (i, r, a.allocated_bytes if caching else m, m)
                    elif m < lo_m:
                        lo_m = m
                    if r > hi_r:
                        hi_r = r
                if i == next_mark:
                    self.at_marks[i] = self._moment(i)
                    mi += 1
                    next_mark = marks[mi] if mi < len(marks) else -1
                yield ev
            i = len(self.events)  # all events applied: the final state
            m, r = a.mapped_bytes, a.requested_bytes
            if m > best:
                self.peak = (i, r, a.allocated_bytes if caching else m, m)
            hi_m, lo_m, hi_r = max(hi_m, m), min(lo_m, m), max(hi_r, r)
            unused = max(unused, m - r)
        finally:
            self.max_unused = unused
            if hi_m >= 0:
                env.append((first, hi_r, hi_m, lo_m))

    def _moment(self, i: int) -> Moment:
        a = self.allocator
        req, mapped = a.requested_bytes, a.mapped_bytes
        if self.kind == "caching":
            alloc = a.allocated_bytes
            return Moment(i, req, mapped, alloc - req, mapped - alloc, a.largest_free_block())
        fit = a.largest_fit() if a.pool.capacity_bytes < _UNLIMITED else None
        return Moment(i, req, mapped, mapped - req, 0, fit)



def replay_one(trace: Trace, chunk: int | None, capacity: int | None,
                progress: Callable[[int], None], conf: AllocConf | None = None, *,
                pure: bool = False) -> AllocatorReport:
    name = allocator_name(chunk, conf, pure=pure)
    kind = "caching" if chunk is None else "chunks" if pure else "virtual"
    allocator = make_allocator(chunk, capacity, conf=conf, pure=pure)
    watched = _Watched(trace.events, allocator, kind, [m.index for m in trace.ooms])
    with gc_paused():  # the events and blocks all stay alive: nothing for the collector to find
        t0, c0 = time.perf_counter(), time.process_time()
        res = replay(watched, allocator, name=name, progress=progress)
        watched.close()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    log.info("%s: %d events in %.2f s", name, res.events, seconds)

    samples = res.samples
    ratio_mean = ratio_max = None
    if len(samples):
        live = samples[:, 1].astype(np.float64)
        mask = live > 0
        if mask.any():
            ratio = samples[mask, 2] / live[mask]
            ratio_mean, ratio_max = float(ratio.mean()), float(ratio.max())
    at_peak = None
    if watched.peak is not None and watched.peak[3] > 0:
        i, req, alloc, mapped = watched.peak
        at_peak = Moment(i, req, mapped, alloc - req, mapped - alloc)
    oom = None
    if res.oom_index is not None:
        st = res.final_stats
        req, mapped = st["requested_bytes"], st["mapped_bytes"]
        alloc = st.get("allocated_bytes", mapped)
        largest = res.largest_free_at_oom
        if kind != "caching" and capacity is None:
            largest = None
        oom = Moment(res.oom_index, req, mapped, alloc - req, mapped - alloc, largest)
    at_rec = fits = None
    if trace.ooms:
        m0 = trace.ooms[0]
        at_rec = watched.at_marks.get(m0.index)
        if m0.nbytes > 0:
            fits = res.oom_index is None or res.oom_index > m0.index
            if res.oom_index is not None and res.oom_index < m0.index:
                fits = None  # never got there
    return AllocatorReport(
        name=name, kind=kind, chunk_bytes=chunk, events=res.events,
        peak_live_bytes=res.peak_live_bytes, peak_reserved_bytes=res.peak_reserved_bytes,
        ratio_at_peak=(res.peak_reserved_bytes / res.peak_live_bytes) if res.peak_live_bytes else None,
        ratio_mean=ratio_mean, ratio_max=ratio_max, at_peak=at_peak, oom=oom,
        oom_request=res.oom_request, at_recorded_oom=at_rec, recorded_oom_fits=fits,
        map_calls=res.map_calls, unmap_calls=res.unmap_calls, seconds=seconds,
        cpu_seconds=cpu_seconds, result=res,
        envelope=np.array(watched.envelope, dtype=np.int64).reshape(-1, 4),
        alloc_conf=None if chunk is not None else (conf.line() if conf is not None else ""),
        max_unused_bytes=watched.max_unused)
