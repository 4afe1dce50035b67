"""Write a replay as a PyTorch memory snapshot, for pytorch.org/memory_viz.

The file has the shape ``torch.cuda.memory._snapshot()`` returns (``segments`` +
``device_traces``, device 0, one stream, no stack frames beyond a label per allocation), so
PyTorch's viewer and ``torch.cuda._memory_viz`` (``trace_plot``, ``segment_plot``,
``segsum``, ``trace``) read it, and ``ooc frag`` reads it back with the same events.

Two pictures of the same trace, chosen by ``chunk_bytes``:

- ``None``: the caching allocator model. Its segments become ``segment_alloc`` /
  ``segment_free`` entries (``cudaMalloc`` / ``cudaFree``) and each allocation lives at
  the block address the model chose, so the viewer shows the fragmentation.
- a chunk size: virtual addressing, drawn the way PyTorch draws its own expandable
  segments: each allocation's range is mapped (``segment_map``, whole chunks) just before
  its ``alloc`` and unmapped (``segment_unmap``) right after its free. The rounding to
  chunks shows as the block's unrequested tail. (The allocator runs with
  ``keep_mapped=False`` here, so the picture is exactly map-on-alloc / unmap-on-free; the
  peaks are the same as with parking, only the map-call counts differ.) The picture is of
  pure chunks (``chunks-N`` in the report): ooc's allocator packs small requests into shared
  chunks, which this one-range-per-allocation drawing cannot show.

If the allocator runs out of memory (``device_memory``), the trace ends with an ``oom``
entry there, like a run that crashed.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any

from vmm.errors import OutOfBudget

from ooc.frag.allocator_replay import allocator_name, make_allocator
from ooc.frag.trace_data import Trace, gc_paused

__all__ = ["ExportInfo", "build_snapshot", "export_snapshot"]


@dataclass(frozen=True, slots=True)
class ExportInfo:
    path: str
    allocator: str
    entries: int
    oom_event: int | None


def build_snapshot(trace: Trace, *, chunk_bytes: int | None = None,
                   device_memory: int | None = None) -> tuple[dict[str, Any], int | None]:
    """The snapshot dict of ``trace`` replayed through one allocator (see the module doc),
    and the index of the event that ran out of memory (None if all fit)."""
    caching = chunk_bytes is None
    allocator = make_allocator(chunk_bytes, device_memory, keep_mapped=False, pure=True)
    labels = trace.labels
    entries: list[dict[str, Any]] = []
    add = entries.append
    live: dict[Any, tuple[Any, int, int, int]] = {}  # key -> (handle, address, nbytes, mapped)
    segs: dict[int, int] = {}  # caching: segment address -> size, as the trace has shown them
    frames_of: dict[int, list[dict[str, Any]]] = {}  # live block address -> frames
    skipped: set[Any] = set()
    oom_event = None

    def frames(key: Any) -> list[dict[str, Any]]:
        label = labels.get(key) if labels else None
        if label is None:
            return []
        return [{"filename": trace.name, "line": 0, "name": label}]

    for i, ev in enumerate(trace.events):
        t = int(ev.time * 1e6)
        key = ev.key
        if ev.action == "alloc":
            if ev.nbytes <= 0:  # PyTorch records no zero-byte allocations
                skipped.add(key)
                continue
            m0, u0 = allocator.map_calls, allocator.unmap_calls
            try:
                h = allocator.alloc(ev.nbytes)
            except OutOfBudget:
                free = (device_memory - allocator.mapped_bytes) if device_memory is not None else 0
                add({"action": "oom", "size": ev.nbytes, "stream": 0, "time_us": t,
                     "device_free": max(0, free), "frames": frames(key)})
                oom_event = i
                break
            fr = frames(key)
            if caching:
                if allocator.unmap_calls != u0:  # segments released to make room (empty_cache)
                    now = {s["address"] for s in allocator.segments()}
                    for a in [a for a in segs if a not in now]:
                        add({"action": "segment_free", "addr": a, "size": segs.pop(a), "stream": 0,
                             "time_us": t, "frames": []})
                if allocator.map_calls != m0:
                    seg = h.segment
                    segs[seg.address] = seg.size
                    add({"action": "segment_alloc", "addr": seg.address, "size": seg.size,
                         "stream": 0, "time_us": t, "frames": fr})
                mapped = 0
            else:
                mapped = h.mapped_bytes
                add({"action": "segment_map", "addr": h.address, "size": mapped, "stream": 0,
                     "time_us": t, "frames": fr})
            live[key] = (h, h.address, ev.nbytes, mapped)
            frames_of[h.address] = fr
            add({"action": "alloc", "addr": h.address, "size": ev.nbytes, "stream": 0,
                 "time_us": t, "frames": fr})
        else:
            if key in skipped:
                skipped.discard(key)
                continue
            h, addr, nbytes, mapped = live.pop(key)
            fr = frames_of.pop(addr)
            add({"action": "free_requested", "addr": addr, "size": nbytes, "stream": 0,
                 "time_us": t, "frames": fr})
            allocator.free(h)
            add({"action": "free_completed", "addr": addr, "size": nbytes, "stream": 0,
                 "time_us": t, "frames": fr})
            if not caching:
                add({"action": "segment_unmap", "addr": addr, "size": mapped, "stream": 0,
                     "time_us": t, "frames": []})

    segments = _segments_caching(allocator, frames_of) if caching else _segments_virtual(live, frames_of)
    snap = {
        "segments": segments,
        "device_traces": [entries],
        "allocator_settings": {},
        # Read back by ``ooc frag`` (and ignored by PyTorch's tools): the device size replayed.
        "ooc": {"allocator": allocator_name(chunk_bytes, pure=True), "input": trace.name,
                "device_memory": device_memory},
    }
    return snap, oom_event


def _segment(address: int, total: int, blocks: list[dict[str, Any]], kind: str,
             expandable: bool) -> dict[str, Any]:
    active = [b for b in blocks if b["state"] == "active_allocated"]
    return {"device": 0, "address": address, "total_size": total, "stream": 0,
            "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": expandable,
            "allocated_size": sum(b["size"] for b in active),
            "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active),
            "frames": [], "blocks": blocks}


def _segments_caching(allocator: Any, frames_of: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for seg in allocator.segments():
        blocks = []
        for b in seg["blocks"]:
            active = b["state"] == "active_allocated"
            blocks.append({"address": b["address"], "size": b["size"],
                           "requested_size": b["requested"] if active else 0,
                           "state": b["state"],
                           "frames": frames_of.get(b["address"], []) if active else []})
        out.append(_segment(seg["address"], seg["total_size"], blocks, seg["pool"], False))
    return out


def _segments_virtual(live: dict[Any, tuple[Any, int, int, int]],
                      frames_of: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for _, address, nbytes, mapped in sorted(live.values(), key=lambda v: v[1]):
        block = {"address": address, "size": mapped, "requested_size": nbytes,
                 "state": "active_allocated", "frames": frames_of.get(address, [])}
        out.append(_segment(address, mapped, [block], "large", True))
    return out


def export_snapshot(trace: Trace, path: str | os.PathLike[str], *, chunk_bytes: int | None = None,
                    device_memory: int | None = None) -> ExportInfo:
    """Write :func:`build_snapshot` to ``path`` as a pickle (written whole, then renamed)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with gc_paused():  # millions of trace-entry dicts, all kept: see inputs.gc_paused
        snap, oom_event = build_snapshot(trace, chunk_bytes=chunk_bytes, device_memory=device_memory)
        with open(tmp, "wb") as fh:
            pickle.dump(snap, fh, protocol=4)
    os.replace(tmp, path)
    return ExportInfo(path, allocator_name(chunk_bytes, pure=True), len(snap["device_traces"][0]), oom_event)
