"""Replay one trace through PyTorch's caching allocator model (as recorded, and under the
``PYTORCH_CUDA_ALLOC_CONF`` settings a user can switch on) and through virtual addressing at
several chunk sizes, measure fragmentation, and say what to set and what it saves.

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
  (``cudaMalloc`` / ``cudaFree``, caching model), pages mapped / unmapped (expandable
  segments);
- *unused*: reserved bytes that hold no live data (reserved - live): free blocks, rounding
  and split remainders; ``max_unused_bytes`` is its largest value over the run, the space the
  allocator held but could not give to the program.

The PyTorch models are named by their ``PYTORCH_CUDA_ALLOC_CONF`` line
(``expandable_segments:True``...; ``caching`` is the default setting): :mod:`vmm.alloc_conf`.
:class:`Advice` answers "what should I set, and what does it save?" (rules in
:func:`advise`).
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from vmm.alloc_conf import AllocConf
from vmm.replay import Event, ReplayResult, replay
from vmm.units import format_size

from ooc.frag.inputs import Trace, gc_paused

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNKS", "DEFAULT_CONFS", "GRANULARITY", "Moment", "AllocatorReport", "Advice",
           "FragReport", "advise", "analyze", "make_allocator", "allocator_name", "format_table",
           "recommendation"]

GRANULARITY = 2 << 20  # CUDA VMM granularity on current GPUs; chunks are multiples of it
DEFAULT_CHUNKS = (2 << 20, 20 << 20, 40 << 20)
# The PYTORCH_CUDA_ALLOC_CONF settings replayed by default, beside the default allocator.
DEFAULT_CONFS = ("expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
                 "garbage_collection_threshold:0.8")
ADVICE_MIN_GAIN = 0.05  # ooc's allocator is advised over a PyTorch setting only if it saves
# this fraction of the baseline's peak more (a setting is one line; ooc changes the program)
# Pool capacity standing for "unlimited" (a pool makes chunks lazily: nothing is allocated).
_UNLIMITED = 1 << 60
ENVELOPE_BINS = 1200  # the plot's resolution along the events (about one bin per pixel)
SCHEMA = "ooc.frag"
VERSION = 1


def allocator_name(chunk_bytes: int | None, conf: AllocConf | None = None) -> str:
    """``"caching"``, ``"vmm-20MiB"`` or a ``PYTORCH_CUDA_ALLOC_CONF`` line such as
    ``"expandable_segments:True"``: the names the report, JSON and plot use."""
    if chunk_bytes is None:
        return (conf.line() if conf is not None else "") or "caching"
    return "vmm-" + format_size(chunk_bytes).replace(" ", "")


def make_allocator(chunk_bytes: int | None, capacity: int | None, *, keep_mapped: bool = True,
                   conf: AllocConf | None = None) -> Any:
    """A fresh allocator on the sim backend: the caching model (``chunk_bytes`` None) under
    ``conf`` (None: PyTorch's defaults) or a virtual allocator with chunks of ``chunk_bytes``
    (``capacity`` None: unlimited)."""
    import vmm

    if chunk_bytes is None:
        if conf is not None:
            return conf.make(capacity, vmm.SimBackend(granularity=GRANULARITY))
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
    alloc_conf: str | None = None  # PyTorch models: the PYTORCH_CUDA_ALLOC_CONF line ("": default)
    max_unused_bytes: int = 0  # the largest reserved - live over the run (module docstring)

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
            "alloc_conf": self.alloc_conf,
            "max_unused_bytes": self.max_unused_bytes,
        }


@dataclass(frozen=True, slots=True)
class Advice:
    """The answer to "what should I set, and what does it save?" (see :func:`advise`).

    - ``baseline``: the model standing for the recorded run (``caching``, or
      ``expandable_segments:True`` when the snapshot's segments are expandable);
    - ``peak_live_bytes``, ``recorded_reserved_bytes`` (snapshots that say), and
      ``baseline_reserved_bytes``: the baseline replay's peak reserved (up to its OOM, if
      it has one); ``replay_matches_recorded``: whether that peak is the recorded one (None
      when nothing was recorded);
    - ``choice``: the model advised (None: keep what you have), ``kind`` ``"alloc_conf"``,
      ``"ooc"`` or ``"keep"``, ``setting``: what to write (an environment line, or ooc's
      allocator with its chunk size);
    - ``reserved_bytes``: the choice's peak reserved; ``saved_bytes`` / ``saved_percent``: the
      baseline's peak minus it, and that as a percentage of the baseline's peak.
    """

    baseline: str
    peak_live_bytes: int
    recorded_reserved_bytes: int | None
    baseline_reserved_bytes: int
    replay_matches_recorded: bool | None
    choice: str | None
    kind: str
    setting: str
    reserved_bytes: int | None
    saved_bytes: int
    saved_percent: float
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "peak_live_bytes": self.peak_live_bytes,
                "recorded_reserved_bytes": self.recorded_reserved_bytes,
                "baseline_reserved_bytes": self.baseline_reserved_bytes,
                "replay_matches_recorded": self.replay_matches_recorded,
                "choice": self.choice, "kind": self.kind, "setting": self.setting,
                "reserved_bytes": self.reserved_bytes, "saved_bytes": self.saved_bytes,
                "saved_percent": self.saved_percent, "text": self.text}


@dataclass(frozen=True)
class FragReport:
    """Everything ``ooc frag`` prints, as data."""

    trace: Trace = field(repr=False)
    device_memory: int | None
    device_memory_source: str
    allocators: tuple[AllocatorReport, ...]
    best: str | None  # the virtual allocator the recommendation picks
    recommendation: str
    advice: Advice | None = None
    plotted: tuple[str, ...] = ()  # the models the plot draws (baseline, choice, best vmm)
    notes: tuple[str, ...] = ()  # the analysis' own notes (the input's: ``trace.notes``)

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
            "notes": list(t.notes) + list(self.notes),
            "advice": self.advice.to_dict() if self.advice else None,
        }


# -- the analysis ---------------------------------------------------------------------------


def analyze(trace: Trace, *, chunks: Sequence[int] = DEFAULT_CHUNKS, device_memory: int | None = None,
            progress: Callable[[int], None] | None = None,
            confs: Sequence[str | AllocConf] = DEFAULT_CONFS) -> FragReport:
    """Replay ``trace`` through the caching model, the caching model under each
    ``PYTORCH_CUDA_ALLOC_CONF`` setting of ``confs`` and a virtual allocator per chunk size.

    ``device_memory`` (bytes) caps every allocator; ``None`` takes the trace's own
    (``trace.device_memory``, e.g. estimated from a snapshot's OOM), else unlimited.
    A setting with ``garbage_collection_threshold`` needs that cap (PyTorch collects only
    under ``set_per_process_memory_fraction``): without one it is left out, with a note.
    When the snapshot was recorded with expandable segments, ``expandable_segments:True`` is
    replayed even if not asked for: it is the baseline. ``progress(n)`` is called with the
    total events replayed so far, over all allocators.
    """
    source = "given"
    if device_memory is None:
        device_memory, source = trace.device_memory, trace.device_memory_source
        if device_memory is None:
            source = "unlimited"
    notes: list[str] = []
    models: list[AllocConf] = []
    for c in confs:
        conf = AllocConf.parse(c) if isinstance(c, str) else c
        if not conf.line() or conf in models:
            continue  # the default setting is "caching", always replayed
        if conf.needs_cap and device_memory is None:
            notes.append(f"{conf.line()} was not modelled: PyTorch collects garbage only under a "
                         f"memory cap (torch.cuda.set_per_process_memory_fraction); give "
                         f"--device-memory to model it")
            continue
        models.append(conf)
    expandable = AllocConf(expandable_segments=True)
    if trace.expandable and expandable not in models:
        models.insert(0, expandable)
    runs: list[tuple[int | None, AllocConf | None]] = [(None, None)]
    runs += [(None, conf) for conf in models]
    runs += [(chunk, None) for chunk in chunks]
    reports = []
    done = 0
    for chunk, conf in runs:
        base = done

        def step(n: int, _base: int = base) -> None:
            if progress is not None:
                progress(_base + n)

        reports.append(_replay_one(trace, chunk, device_memory, step, conf))
        done += len(trace.events)
    best = _pick_best(reports)
    rep = FragReport(trace=trace, device_memory=device_memory, device_memory_source=source,
                     allocators=tuple(reports), best=best.name if best else None,
                     recommendation="", notes=tuple(notes))
    adv = advise(rep)
    plotted = tuple(dict.fromkeys(n for n in (adv.baseline, adv.choice, rep.best) if n))
    return dataclasses.replace(rep, recommendation=recommendation(rep), advice=adv,
                               plotted=plotted)


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
        best = -1
        marks = self.marks
        next_mark = marks[0] if marks else -1
        mi = 0
        width = max(1, -(-len(self.events) // ENVELOPE_BINS))
        cut = width
        first = 0
        hi_r = hi_m = -1
        lo_m = 1 << 62
        unused = 0
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
                if m - r > unused:
                    unused = m - r
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


def _replay_one(trace: Trace, chunk: int | None, capacity: int | None,
                progress: Callable[[int], None], conf: AllocConf | None = None) -> AllocatorReport:
    name = allocator_name(chunk, conf)
    kind = "caching" if chunk is None else "virtual"
    allocator = make_allocator(chunk, capacity, conf=conf)
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
        envelope=np.array(watched.envelope, dtype=np.int64).reshape(-1, 4),
        alloc_conf=None if chunk is not None else (conf.line() if conf is not None else ""),
        max_unused_bytes=watched.max_unused)


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


def advise(rep: FragReport) -> Advice:
    """What to set, and what it saves, for the run of ``rep`` (rules, in order):

    1. the *baseline* is the model of what was recorded: ``expandable_segments:True`` if the
       snapshot's segments are expandable, else ``caching`` (PyTorch's defaults);
    2. a model "gets further" than another if it replays more events (the other ran out of
       memory first); among those that get furthest, the lowest peak reserved wins. The best
       ``PYTORCH_CUDA_ALLOC_CONF`` setting and the best ooc chunk size are found that way;
    3. if the baseline completes: the setting is advised when it lowers the peak; ooc's
       allocator instead when it saves more than the setting by at least
       ``ADVICE_MIN_GAIN`` (5%) of the baseline's peak (a setting is one line, ooc a change
       to the program); nothing when neither lowers the peak;
    4. if the baseline runs out of memory: the setting that completes, else ooc's allocator if
       it completes, else nothing (no allocator fits: the live bytes need swapping).
    """
    t = rep.trace
    base_name = "expandable_segments:True" if t.expandable else "caching"
    base = rep.by_name(base_name)
    rec = t.recorded
    matches = None
    if rec is not None:
        matches = base.peak_reserved_bytes == rec.peak_reserved_bytes
    total = len(t.events)

    def rank(r: AllocatorReport) -> tuple[int, int]:
        return (-r.events, r.peak_reserved_bytes)

    confs = [r for r in rep.allocators if r.kind == "caching" and r is not base]
    conf = min(confs, key=rank) if confs else None
    vmm = rep.by_name(rep.best) if rep.best else None
    peak = base.peak_reserved_bytes
    choice: AllocatorReport | None = None
    if base.completed:
        conf_gain = peak - conf.peak_reserved_bytes if conf is not None and conf.completed else 0
        vmm_gain = peak - vmm.peak_reserved_bytes if vmm is not None and vmm.completed else 0
        if vmm_gain > max(conf_gain, 0) + ADVICE_MIN_GAIN * peak:
            choice = vmm
        elif conf_gain > 0:
            choice = conf
    else:
        for cand in (conf, vmm):
            if cand is not None and cand.events == total and cand.completed:
                choice = cand
                break
    live = base.peak_live_bytes
    if choice is None:
        kind, setting, reserved, saved = "keep", "", None, 0
    elif choice.kind == "virtual":
        kind, reserved = "ooc", choice.peak_reserved_bytes
        setting = f"ooc.OutOfCore(model, optimizer, budget=..., chunk={choice.chunk_bytes})"
        saved = peak - reserved
    else:
        kind, reserved = "alloc_conf", choice.peak_reserved_bytes
        setting = f"PYTORCH_CUDA_ALLOC_CONF={choice.alloc_conf}"
        saved = peak - reserved
    pct = round(100.0 * saved / peak, 1) if peak and choice is not None else 0.0
    return Advice(baseline=base_name, peak_live_bytes=live,
                  recorded_reserved_bytes=rec.peak_reserved_bytes if rec else None,
                  baseline_reserved_bytes=peak, replay_matches_recorded=matches,
                  choice=choice.name if choice else None, kind=kind, setting=setting,
                  reserved_bytes=reserved, saved_bytes=saved, saved_percent=pct,
                  text=_advice_text(rep, base, choice, setting, saved, pct, matches))


def _advice_text(rep: FragReport, base: AllocatorReport, choice: AllocatorReport | None,
                 setting: str, saved: int, pct: float, matches: bool | None) -> str:
    rec = rep.trace.recorded
    what = ("PyTorch's defaults" if base.name == "caching"
            else f"PYTORCH_CUDA_ALLOC_CONF={base.name}")
    parts = []
    if rec is not None and matches:
        parts.append(f"The replay of {what} reproduces the recorded peak reserved "
                     f"({format_size(rec.peak_reserved_bytes)}).")
    elif rec is not None:
        parts.append(f"The replay of {what} peaks at {format_size(base.peak_reserved_bytes)} "
                     f"reserved where the run recorded {format_size(rec.peak_reserved_bytes)} "
                     f"(other streams or memory outside the trace are not modelled).")
    if choice is None:
        if base.completed:
            parts.append(f"Keep {what}: no modelled setting lowers its peak of "
                         f"{format_size(base.peak_reserved_bytes)} reserved for "
                         f"{format_size(base.peak_live_bytes)} live.")
        else:
            parts.append(f"No modelled setting or chunk size fits this run on the "
                         f"{_gib(rep.device_memory)} device: {_swap_advice(rep)}.")
        return " ".join(parts)
    label = f"Set {setting}" if choice.kind == "caching" else         f"Use ooc's allocator with {format_size(choice.chunk_bytes or 0)} chunks ({setting})"
    if base.completed:
        parts.append(f"{label}: this run then peaks at {format_size(choice.peak_reserved_bytes)} "
                     f"reserved instead of {format_size(base.peak_reserved_bytes)} "
                     f"({format_size(saved)} or {pct:g}% less, for "
                     f"{format_size(base.peak_live_bytes)} live; at most "
                     f"{format_size(choice.max_unused_bytes)} reserved but unused instead of "
                     f"{format_size(base.max_unused_bytes)}).")
    else:
        parts.append(f"{label}: the whole run then fits on the {_gib(rep.device_memory)} "
                     f"device, peaking at {format_size(choice.peak_reserved_bytes)} reserved, "
                     f"where {what} runs out of memory at event "
                     f"{base.oom.event if base.oom else base.events:,}.")
    return " ".join(parts)


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
            "external", "max unused", "map/unmap", "out of memory")
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
            _gib(a.max_unused_bytes), f"{a.map_calls:,}/{a.unmap_calls:,}", oom))
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
        "mappings, largest free = largest request that fits. Names with a colon: PyTorch's "
        "caching allocator under that PYTORCH_CUDA_ALLOC_CONF (expandable segments: reserved = "
        "pages mapped). max unused: the most bytes reserved but not live during the run.",
        width=width))
    lines.append("")
    if rep.advice is not None:
        lines.append(textwrap.fill("What to set: " + rep.advice.text, width=width))
        lines.append("")
    lines.append(textwrap.fill("Recommendation: " + rep.recommendation, width=width))
    notes = (*t.notes, *rep.notes)
    if notes:
        lines.append("")
        lines.extend(textwrap.fill("note: " + n, width=width, subsequent_indent="  ") for n in notes)
    return "\n".join(lines)
