"""Replay one trace through PyTorch's caching allocator model and through virtual addressing
at several chunk sizes, measure fragmentation, and say what would have changed.

The numbers are data (:class:`FragReport`, :meth:`FragReport.to_dict` for ``--json``); the
table and the recommendation are text made from them. Definitions, per allocator:

- *peak live*: the peak of bytes requested and not yet freed (the trace's own need; the
  same for every allocator that gets through the trace);
- *peak reserved*: the peak of device memory the allocator holds for live data: segment
  bytes for the caching model (PyTorch's "reserved"), chunks mapped under live allocations
  for virtual addressing (chunks it caches beyond that can serve any request, so a device of
  that size is enough);
- *fragmentation ratio*: reserved / live, at the peak (peak reserved / peak live) and over
  the run (mean and max over the replay's samples where something is live);
- *internal / external fragmentation*, at the moment reserved bytes peak (or at the OOM):
  internal = bytes handed out beyond the request (rounding to 512 B blocks or whole
  chunks, unsplit block remainders); external = reserved bytes in free blocks (the caching
  model's cache, which a request can only use if one free block is large enough). Virtual
  addressing has no external fragmentation: any free chunk serves any request;
- *map / unmap*: chunk mappings made / removed (virtual), segments allocated / freed
  (``cudaMalloc`` / ``cudaFree``, caching model).
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from vmm.replay import Event, ReplayResult, replay
from vmm.units import format_size

from ooc.frag.inputs import Trace, gc_paused

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNKS", "GRANULARITY", "Moment", "AllocatorReport", "FragReport", "analyze",
           "make_allocator", "allocator_name", "format_table", "recommendation"]

GRANULARITY = 2 << 20  # CUDA VMM granularity on current GPUs; chunks are multiples of it
DEFAULT_CHUNKS = (2 << 20, 20 << 20, 40 << 20)
# Pool capacity standing for "unlimited" (a pool makes chunks lazily: nothing is allocated).
_UNLIMITED = 1 << 60
ENVELOPE_BINS = 1200  # the plot's resolution along the events (about one bin per pixel)
SCHEMA = "ooc.frag"
VERSION = 1


def allocator_name(chunk_bytes: int | None) -> str:
    """``"caching"`` or ``"vmm-20MiB"``: the names the report, JSON and plot use."""
    return "caching" if chunk_bytes is None else "vmm-" + format_size(chunk_bytes).replace(" ", "")


def make_allocator(chunk_bytes: int | None, capacity: int | None, *, keep_mapped: bool = True) -> Any:
    """A fresh allocator on the sim backend: the caching model (``chunk_bytes`` None) or a
    virtual allocator with chunks of ``chunk_bytes`` (``capacity`` None: unlimited)."""
    import vmm

    if chunk_bytes is None:
        return vmm.CachingAllocator(vmm.SimBackend(granularity=GRANULARITY), capacity_bytes=capacity)
    pool = vmm.ChunkPool(vmm.SimBackend(granularity=GRANULARITY), chunk_bytes=chunk_bytes,
                         capacity_bytes=capacity if capacity is not None else _UNLIMITED)
    return vmm.VirtualAllocator(pool, keep_mapped=keep_mapped)


@dataclass(frozen=True, slots=True)
class Moment:
    """The allocator's memory at one point of the replay: just before event ``event`` is
    applied (for an OOM: the event that failed), i.e. after ``event`` events."""

    event: int
    live_bytes: int
    reserved_bytes: int
    internal_bytes: int
    external_bytes: int
    largest_free_bytes: int | None = None  # largest free block / largest request that fits

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "live_bytes": self.live_bytes,
                "reserved_bytes": self.reserved_bytes, "internal_bytes": self.internal_bytes,
                "external_bytes": self.external_bytes, "largest_free_bytes": self.largest_free_bytes}


@dataclass(frozen=True)
class AllocatorReport:
    """One allocator's replay of the trace (definitions in the module docstring)."""

    name: str
    kind: str  # "caching" or "virtual"
    chunk_bytes: int | None
    events: int  # events applied (all of them unless an OOM stopped the replay)
    peak_live_bytes: int
    peak_reserved_bytes: int
    ratio_at_peak: float | None
    ratio_mean: float | None
    ratio_max: float | None
    at_peak: Moment | None
    oom: Moment | None  # where this allocator ran out of memory
    oom_request: int | None
    at_recorded_oom: Moment | None  # state just before the recorded OOM's request
    recorded_oom_fits: bool | None  # did that request succeed here?
    map_calls: int
    unmap_calls: int
    seconds: float  # wall-clock time of the replay
    cpu_seconds: float  # CPU time of this process during it (steadier on a shared machine)
    result: ReplayResult = field(repr=False, compare=False)
    # int64 (k, 4): first event of the bin, max live, max reserved, min reserved (every
    # state of the replay, not decimated: what the plot draws for long traces).
    envelope: np.ndarray = field(repr=False, compare=False, default=None)

    @property
    def completed(self) -> bool:
        return self.oom is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "chunk_bytes": self.chunk_bytes,
            "events_replayed": self.events, "completed": self.completed,
            "peak_live_bytes": self.peak_live_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fragmentation_at_peak": self.ratio_at_peak,
            "fragmentation_mean": self.ratio_mean, "fragmentation_max": self.ratio_max,
            "at_peak": self.at_peak.to_dict() if self.at_peak else None,
            "oom": None if self.oom is None else {**self.oom.to_dict(), "request_bytes": self.oom_request},
            "at_recorded_oom": self.at_recorded_oom.to_dict() if self.at_recorded_oom else None,
            "recorded_oom_fits": self.recorded_oom_fits,
            "map_calls": self.map_calls, "unmap_calls": self.unmap_calls,
            "replay_seconds": round(self.seconds, 4),
            "events_per_second": round(self.events / self.seconds) if self.seconds > 0 else None,
        }


@dataclass(frozen=True)
class FragReport:
    """Everything ``ooc frag`` prints, as data."""

    trace: Trace = field(repr=False)
    device_memory: int | None
    device_memory_source: str
    allocators: tuple[AllocatorReport, ...]
    best: str | None  # the virtual allocator the recommendation picks
    recommendation: str

    def by_name(self, name: str) -> AllocatorReport:
        for a in self.allocators:
            if a.name == name:
                return a
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with stable keys (what ``ooc frag --json`` prints)."""
        t = self.trace
        rec = t.recorded
        return {
            "schema": SCHEMA, "version": VERSION,
            "input": t.name, "input_kind": t.kind, "device": t.device, "events": len(t.events),
            "device_memory_bytes": self.device_memory,
            "device_memory_source": self.device_memory_source,
            "recorded": {
                "ooms": [{"event": m.index, "request_bytes": m.nbytes,
                          "device_free_bytes": m.device_free} for m in t.ooms],
                "peak_reserved_bytes": rec.peak_reserved_bytes if rec else None,
                "segment_allocs": rec.segment_allocs if rec else None,
                "segment_frees": rec.segment_frees if rec else None,
            },
            "allocators": [a.to_dict() for a in self.allocators],
            "best": self.best,
            "recommendation": self.recommendation,
            "notes": list(t.notes),
        }


# -- the analysis ---------------------------------------------------------------------------


def analyze(trace: Trace, *, chunks: Sequence[int] = DEFAULT_CHUNKS, device_memory: int | None = None,
            progress: Callable[[int], None] | None = None) -> FragReport:
    """Replay ``trace`` through the caching model and a virtual allocator per chunk size.

    ``device_memory`` (bytes) caps every allocator; ``None`` takes the trace's own
    (``trace.device_memory``, e.g. estimated from a snapshot's OOM), else unlimited.
    ``progress(n)`` is called with the total events replayed so far, over all allocators.
    """
    source = "given"
    if device_memory is None:
        device_memory, source = trace.device_memory, trace.device_memory_source
        if device_memory is None:
            source = "unlimited"
    reports = []
    done = 0
    for chunk in (None, *chunks):
        base = done

        def step(n: int, _base: int = base) -> None:
            if progress is not None:
                progress(_base + n)

        reports.append(_replay_one(trace, chunk, device_memory, step))
        done += len(trace.events)
    best = _pick_best(reports)
    rep = FragReport(trace=trace, device_memory=device_memory, device_memory_source=source,
                     allocators=tuple(reports), best=best.name if best else None,
                     recommendation="")
    return dataclasses.replace(rep, recommendation=recommendation(rep))


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
        best = -1
        marks = self.marks
        next_mark = marks[0] if marks else -1
        mi = 0
        width = max(1, -(-len(self.events) // ENVELOPE_BINS))
        cut = width
        first = 0
        hi_r = hi_m = -1
        lo_m = 1 << 62
        env = self.envelope
        i = 0
        try:
            # State i is the allocator after events[:i], seen just before events[i] is applied.
            for i, ev in enumerate(self.events):
                m = a.mapped_bytes
                if m > best:
                    best = m
                    self.peak = (i, a.requested_bytes, a.allocated_bytes if caching else m, m)
                r = a.requested_bytes
                if i == cut:
                    env.append((first, hi_r, hi_m, lo_m))
                    first, cut = i, cut + width
                    hi_r, hi_m, lo_m = r, m, m
                else:
                    if m > hi_m:
                        hi_m = m
                    if m < lo_m:
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
        finally:
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


def _replay_one(trace: Trace, chunk: int | None, capacity: int | None,
                progress: Callable[[int], None]) -> AllocatorReport:
    name = allocator_name(chunk)
    kind = "caching" if chunk is None else "virtual"
    allocator = make_allocator(chunk, capacity)
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
        if kind == "virtual" and capacity is None:
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
        envelope=np.array(watched.envelope, dtype=np.int64).reshape(-1, 4))


def _pick_best(reports: Sequence[AllocatorReport]) -> AllocatorReport | None:
    """The virtual allocator to recommend: gets furthest (no OOM first), then the lowest peak;
    within 2% of that peak, the largest chunk (fewest map calls)."""
    virtual = [r for r in reports if r.kind == "virtual"]
    if not virtual:
        return None
    furthest = max(r.events for r in virtual)
    cands = [r for r in virtual if r.events == furthest]
    low = min(r.peak_reserved_bytes for r in cands)
    near = [r for r in cands if r.peak_reserved_bytes <= low * 1.02 + 1]
    return max(near, key=lambda r: (r.chunk_bytes or 0, -r.peak_reserved_bytes))


# -- text ------------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _swap_advice(rep: FragReport) -> str:
    """What to do when the live bytes alone exceed the device: swap, with the budget to give.
    A last step, not a pointer to another diagnosis (``ooc simulate`` sends allocator trouble
    here; this must not send it back)."""
    below = f" below {format_size(rep.device_memory)}" if rep.device_memory else ""
    if rep.trace.kind == "schedule":
        return f"re-plan the step with a lower budget (`ooc plan TRACE --budget SIZE`{below})"
    if rep.trace.kind == "sequence":
        return f"swap: plan this trace with `ooc plan {rep.trace.name} --budget SIZE`{below}"
    return (f"swap: train with ooc.OutOfCore(model, optimizer, budget=...){below}, or trace the "
            f"step (`ooc trace` or ooc.trace) and plan it with `ooc plan TRACE --budget SIZE`{below}")


def recommendation(rep: FragReport) -> str:
    """One paragraph: what virtual addressing would change for this run, in numbers."""
    caching = rep.by_name("caching")
    best = rep.by_name(rep.best) if rep.best else None
    n = len(rep.trace.events)
    rec_oom = rep.trace.ooms[0] if rep.trace.ooms else None
    parts: list[str] = []
    if best is None:
        return "No virtual-addressing allocator was replayed (give --chunks)."
    chunk_txt = f"{format_size(best.chunk_bytes or 0)} chunks"
    cap_txt = f"the {format_size(rep.device_memory)} device" if rep.device_memory else "an unlimited device"

    # The recorded OOM, if any: what the caching model says about it, and whether chunks fit it.
    if rec_oom is not None:
        at = caching.at_recorded_oom
        reason = ""
        if at is not None:
            unused = at.reserved_bytes - at.live_bytes
            reason = (f" With {format_size(at.reserved_bytes)} reserved for {format_size(at.live_bytes)} "
                      f"live, {format_size(unused)} ({_pct(unused, at.reserved_bytes)}) was reserved "
                      f"but not in use and the largest free block was {_gib(at.largest_free_bytes)}.")
        parts.append(f"The recorded run ran out of memory at event {rec_oom.index:,} asking for "
                     f"{format_size(rec_oom.nbytes)}.{reason}")
        if caching.recorded_oom_fits is False and caching.oom is not None \
                and caching.oom.event == rec_oom.index:
            parts.append("The caching model fails at the same request, so the model reproduces "
                         "the crash.")
        elif caching.recorded_oom_fits:
            parts.append(f"The caching model fits that request on {cap_txt}, so part of the "
                         f"recorded reserve was held elsewhere (other streams, other pools, or "
                         f"memory outside PyTorch).")
        if best.recorded_oom_fits:
            parts.append(f"With {chunk_txt} the request fits: the OOM at event {rec_oom.index:,} "
                         f"would not have happened.")
        elif best.recorded_oom_fits is False:
            parts.append(f"Even with {chunk_txt} the request does not fit: the live bytes "
                         f"themselves exceed the device, so fragmentation is not the (only) "
                         f"cause; reduce what is live: a smaller batch, or {_swap_advice(rep)}.")

    # Peaks.
    if caching.completed and best.completed:
        saved = caching.peak_reserved_bytes - best.peak_reserved_bytes
        if saved > 0:
            parts.append(
                f"With {chunk_txt} this run peaks at {format_size(best.peak_reserved_bytes)} mapped "
                f"instead of {format_size(caching.peak_reserved_bytes)} reserved by the caching "
                f"allocator ({format_size(saved)} or {_pct(saved, caching.peak_reserved_bytes)} "
                f"less, for {format_size(caching.peak_live_bytes)} live), at the cost of "
                f"{best.map_calls:,} map and {best.unmap_calls:,} unmap calls over {n:,} events.")
        else:
            parts.append(
                f"The caching allocator already peaks at {format_size(caching.peak_reserved_bytes)} "
                f"for {format_size(caching.peak_live_bytes)} live; {chunk_txt} would peak at "
                f"{format_size(best.peak_reserved_bytes)}: virtual addressing saves nothing here.")
        if caching.peak_live_bytes and saved <= 0.05 * caching.peak_reserved_bytes and saved > 0:
            parts.append("Fragmentation is low in this run; the saving is small.")
    elif not caching.completed and best.completed:
        oom = caching.oom
        assert oom is not None
        if rec_oom is None or oom.event != rec_oom.index or not best.recorded_oom_fits:
            parts.append(
                f"On {cap_txt} the caching allocator runs out of memory at event {oom.event:,} "
                f"({format_size(caching.oom_request or 0)} requested, "
                f"{format_size(oom.reserved_bytes - oom.live_bytes)} reserved but not in use, "
                f"largest free block {_gib(oom.largest_free_bytes)}); with {chunk_txt} the whole "
                f"run fits, peaking at {format_size(best.peak_reserved_bytes)} mapped for "
                f"{format_size(best.peak_live_bytes)} live.")
        else:
            parts.append(f"The whole run then fits, peaking at "
                         f"{format_size(best.peak_reserved_bytes)} mapped for "
                         f"{format_size(best.peak_live_bytes)} live.")
    elif not best.completed:
        oom = best.oom
        assert oom is not None
        if rec_oom is None or oom.event != rec_oom.index:
            parts.append(
                f"On {cap_txt} even {chunk_txt} run out of memory at event {oom.event:,} with "
                f"{format_size(oom.live_bytes)} live: the run needs more memory than the device "
                f"has whatever the allocator: {_swap_advice(rep)}.")

    # Chunk size trade-off across the other virtual allocators.
    others = sorted((r for r in rep.allocators if r.kind == "virtual" and r is not best),
                    key=lambda r: r.chunk_bytes or 0)
    done = [r for r in others if r.completed]
    if done and best.completed:
        alt = min(done, key=lambda r: r.peak_reserved_bytes)
        diff = best.peak_reserved_bytes - alt.peak_reserved_bytes
        if diff > 0:
            parts.append(f"{format_size(alt.chunk_bytes or 0)} chunks would save "
                         f"{format_size(diff)} more but make {alt.map_calls:,} map calls "
                         f"instead of {best.map_calls:,}.")
    if others and best.completed:
        desc = []
        for r in others:
            if r.completed:
                desc.append(f"{format_size(r.chunk_bytes or 0)} chunks peak at "
                            f"{format_size(r.peak_reserved_bytes)} ({r.map_calls:,} map calls)")
            else:
                desc.append(f"{format_size(r.chunk_bytes or 0)} chunks run out of memory at event "
                            f"{r.oom.event if r.oom else r.events:,}")
        parts.append(f"Other chunk sizes: {'; '.join(desc)}. Each allocation wastes less than "
                     f"one chunk, so larger chunks cost memory and save map calls.")
    return " ".join(parts)


def format_table(rep: FragReport, *, width: int = 100) -> str:
    """The human report: header, one row per allocator, the recommendation, notes."""
    t = rep.trace
    kinds = {"snapshot": "PyTorch memory snapshot", "csv": "CSV trace", "sequence": "ooc trace",
             "schedule": "ooc plan"}
    lines = [f"ooc frag: {t.name} ({kinds.get(t.kind, t.kind)}"
             + (f", device {t.device}" if t.device is not None else "")
             + f"): {len(t.events):,} events"]
    if rep.device_memory is not None:
        lines.append(f"device memory: {format_size(rep.device_memory)} ({rep.device_memory_source})")
    else:
        lines.append("device memory: unlimited (give --device-memory to replay against a device size)")
    for m in t.ooms:
        free = f", {format_size(m.device_free)} free on the device" if m.device_free is not None else ""
        lines.append(f"recorded OOM: event {m.index:,}, {format_size(m.nbytes)} requested{free}")
    if t.recorded is not None:
        r = t.recorded
        lines.append(f"recorded allocator: peak reserved {format_size(r.peak_reserved_bytes)}, "
                     f"{r.segment_allocs:,} segment allocs, {r.segment_frees:,} segment frees")
    lines.append("")
    head = ("allocator", "peak live", "peak resv", "resv/live", "mean", "max", "internal",
            "external", "map/unmap", "out of memory")
    rows = [head]
    for a in rep.allocators:
        p = a.oom or a.at_peak
        if a.oom is not None:
            oom = (f"event {a.oom.event:,}: {format_size(a.oom_request or 0)}; largest free "
                   f"{_gib(a.oom.largest_free_bytes)}")
        else:
            oom = "no"
        rows.append((
            a.name, _gib(a.peak_live_bytes), _gib(a.peak_reserved_bytes),
            f"{a.ratio_at_peak:.2f}x" if a.ratio_at_peak else "-",
            f"{a.ratio_mean:.2f}x" if a.ratio_mean is not None else "-",
            f"{a.ratio_max:.2f}x" if a.ratio_max is not None else "-",
            _gib(p.internal_bytes) if p else "-", _gib(p.external_bytes) if p else "-",
            f"{a.map_calls:,}/{a.unmap_calls:,}", oom))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(head) - 1)]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths[:-1]) + "  " + "-" * len(head[-1]))
    lines.append("")
    lines.append(textwrap.fill(
        "resv/live: peak reserved over peak live; mean, max: reserved/live over the run. "
        "internal/external: at the peak of reserved bytes (or at the OOM). caching: reserved = "
        "segments (cudaMalloc), map/unmap = segments allocated/freed, largest free = largest free "
        "block; vmm-N: reserved = chunks mapped under live allocations, map/unmap = chunk "
        "mappings, largest free = largest request that fits.", width=width))
    lines.append("")
    lines.append(textwrap.fill("Recommendation: " + rep.recommendation, width=width))
    if t.notes:
        lines.append("")
        lines.extend(textwrap.fill("note: " + n, width=width, subsequent_indent="  ") for n in t.notes)
    return "\n".join(lines)
