"""What ``ooc frag`` reports, as data: each allocator's replay (:class:`AllocatorReport`, with
its :class:`Moment` at the peak and at an OOM), the :class:`Advice` and the whole
:class:`FragReport`, each with ``to_dict()`` for ``--json`` (schema ``ooc.frag``, version 1).

The definitions of the numbers are in :mod:`ooc.frag.report`'s docstring. Apart from the
analysis and the text so that a tool reading the JSON, the plot and the tests depend on the
data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vmm.replay import ReplayResult

from ooc.frag.trace_data import Trace

__all__ = ["SCHEMA", "VERSION", "Moment", "AllocatorReport", "Advice", "FragReport"]

SCHEMA = "ooc.frag"
VERSION = 1


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

