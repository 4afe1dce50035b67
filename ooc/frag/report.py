"""Replay one trace through PyTorch's caching allocator model (as recorded, and under the
``PYTORCH_CUDA_ALLOC_CONF`` settings a user can switch on) and through ooc's allocator
(``vmm.SmallBlockAllocator``: small requests packed into chunks, large ones as virtual ranges
of whole chunks) at several chunk sizes, measure fragmentation, and say what to set and what
it saves.

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

Where the pieces are: the report as data in :mod:`ooc.frag.report_data`, one allocator's replay
and what is watched during it in :mod:`ooc.frag.allocator_replay`, the advice and the
recommendation in :mod:`ooc.frag.advice`; here the analysis that runs them and the table.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Callable, Sequence

from vmm.alloc_conf import AllocConf
from vmm.units import format_size

from ooc.frag.advice import ADVICE_MIN_GAIN, _gib, advise, pick_best, recommendation
from ooc.frag.allocator_replay import (ENVELOPE_BINS, GRANULARITY, allocator_name, make_allocator,
                                       replay_one)
from ooc.frag.report_data import SCHEMA, VERSION, Advice, AllocatorReport, FragReport, Moment
from ooc.frag.trace_data import Trace

__all__ = ["DEFAULT_CHUNKS", "PURE_CHUNKS", "DEFAULT_CONFS", "GRANULARITY", "Moment", "AllocatorReport", "Advice",
           "FragReport", "advise", "analyze", "make_allocator", "allocator_name", "format_table",
           "recommendation", "ADVICE_MIN_GAIN", "ENVELOPE_BINS", "SCHEMA", "VERSION"]

DEFAULT_CHUNKS = (2 << 20, 20 << 20, 40 << 20)
# Pure chunks (every request rounded up to whole chunks, no small-block pool): a comparison
# row that shows what ooc's allocator gains by packing small requests (benchmarks/bench_frag.py
# replays it; ``ooc frag`` does not by default).
PURE_CHUNKS = (2 << 20,)
# The PYTORCH_CUDA_ALLOC_CONF settings replayed by default, beside the default allocator.
DEFAULT_CONFS = ("expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
                 "garbage_collection_threshold:0.8")


def analyze(trace: Trace, *, chunks: Sequence[int] = DEFAULT_CHUNKS, device_memory: int | None = None,
            progress: Callable[[int], None] | None = None,
            confs: Sequence[str | AllocConf] = DEFAULT_CONFS,
            pure_chunks: Sequence[int] = ()) -> FragReport:
    """Replay ``trace`` through the caching model, the caching model under each
    ``PYTORCH_CUDA_ALLOC_CONF`` setting of ``confs``, ooc's allocator per chunk size of
    ``chunks`` (``vmm-N``: small blocks packed into chunks, :class:`vmm.SmallBlockAllocator`)
    and, for comparison, pure chunks per size of ``pure_chunks`` (``chunks-N``).

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
    runs: list[tuple[int | None, AllocConf | None, bool]] = [(None, None, False)]
    runs += [(None, conf, False) for conf in models]
    runs += [(chunk, None, False) for chunk in chunks]
    runs += [(chunk, None, True) for chunk in pure_chunks]
    reports = []
    done = 0
    for chunk, conf, pure in runs:
        base = done

        def step(n: int, _base: int = base) -> None:
            if progress is not None:
                progress(_base + n)

        reports.append(replay_one(trace, chunk, device_memory, step, conf, pure=pure))
        done += len(trace.events)
    best = pick_best(reports)
    rep = FragReport(trace=trace, device_memory=device_memory, device_memory_source=source,
                     allocators=tuple(reports), best=best.name if best else None,
                     recommendation="", notes=tuple(notes))
    adv = advise(rep)
    plotted = tuple(dict.fromkeys(n for n in (adv.baseline, adv.choice, rep.best) if n))
    return dataclasses.replace(rep, recommendation=recommendation(rep), advice=adv,
                               plotted=plotted)


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
        "block; vmm-N: ooc's allocator (requests up to half a chunk packed into shared chunks, "
        "larger ones in whole chunks), chunks-N: whole chunks only; both: reserved = chunks "
        "mapped under live allocations, map/unmap = chunk "
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
