"""Fragmentation diagnostics (``ooc frag``): why a run hit "CUDA out of memory" with plenty
of memory reserved, and what virtual addressing would have saved, before changing anything.

Read an allocation trace (a PyTorch memory snapshot, an ooc trace or plan, or a CSV), replay
it through a model of PyTorch's caching allocator and through the virtual-addressing
allocator at several chunk sizes, and compare::

    from ooc import frag
    trace = frag.load("snapshot.pickle")            # never runs code from the pickle
    rep = frag.analyze(trace, chunks=[2 << 20, 20 << 20], device_memory=16 << 30)
    print(frag.format_table(rep))                    # or rep.to_dict() for JSON
    frag.plot_timeline(rep, "frag.png")
    frag.export_snapshot(trace, "caching.pickle")    # open in pytorch.org/memory_viz

Modules: ``safe_pickle`` (the allow-listing unpickler), ``inputs`` (the three formats ->
``vmm.replay.Event``), ``report`` (replays, metrics, recommendation), ``plot`` (the PNG
timeline), ``export`` (a replay as a PyTorch snapshot).
"""

from __future__ import annotations

from typing import Any

from ooc.frag.export import ExportInfo, build_snapshot, export_snapshot
from ooc.frag.inputs import FragInputError, OomMarker, Trace, load
from ooc.frag.report import (DEFAULT_CHUNKS, PURE_CHUNKS, AllocatorReport, FragReport, analyze, format_table,
                             recommendation)
from ooc.frag.safe_pickle import UnsafePickleError, safe_load

__all__ = ["DEFAULT_CHUNKS", "PURE_CHUNKS", "AllocatorReport", "ExportInfo", "FragInputError", "FragReport",
           "OomMarker", "Trace", "UnsafePickleError", "analyze", "build_snapshot",
           "export_snapshot", "format_table", "load", "plot_timeline", "recommendation",
           "safe_load"]


def plot_timeline(rep: FragReport, path: Any, **kwargs: Any) -> None:
    """See :func:`ooc.frag.plot.plot_timeline` (imported on use: matplotlib is slow to load)."""
    from ooc.frag.plot import plot_timeline as _plot

    _plot(rep, path, **kwargs)
