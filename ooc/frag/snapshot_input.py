"""Read a PyTorch memory snapshot (the pickle ``torch.cuda.memory._dump_snapshot`` writes,
loaded with :mod:`ooc.frag.safe_pickle`, never with plain pickle) into a
:class:`~ooc.frag.trace_data.Trace`.

How a snapshot's trace becomes events (one device; streams are not modelled):

- ``alloc`` -> an ``alloc`` event keyed by address, of the requested size (the trace
  records the size the caller asked for, before the allocator's rounding);
- ``free_completed`` (or ``free`` in older snapshots) -> a ``free`` event. ``free_requested``
  alone does not free: with several streams the block stays in use until the streams are
  done. A ``free_requested`` that never sees its ``free_completed`` (the trace ended first)
  is treated as a free at the time it was requested;
- ``oom`` -> a marker, and the request that failed is replayed as an allocation there
  (freed right after), so each allocator shows whether it would have fit;
- ``segment_*`` -> not events (they are the recorded allocator's decisions, which the
  replay re-makes); they give the recorded reserved bytes over time for comparison.
  ``segment_map`` / ``segment_unmap`` (pages of an expandable segment), or a segment whose
  ``is_expandable`` is True, mark the run as recorded with ``expandable_segments:True``
  (``Trace.expandable``), which ``ooc frag`` then takes as its baseline;
- a free of an address the trace never allocated, and a block still active at the end
  that the trace never mentions, existed before recording started (the trace is a ring
  buffer): they are allocated at the start.

The device memory is taken from the snapshot when it says: the ``ooc.device_memory`` key
of snapshots ooc exported, else, at a recorded OOM, the bytes reserved then plus the
``device_free`` the driver reported (what this process could have had).

Apart from the other readers because the snapshot is by far the richest input: the rules
above, the ring buffer's missing start, several streams and devices, and its own errors.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Iterable

from vmm.replay import Event
from vmm.units import format_size

from ooc.frag.safe_pickle import UnsafePickleError, safe_load
from ooc.frag.trace_data import FragInputError, OomMarker, Recorded, Trace, _short, _tname

__all__ = ["load_snapshot", "snapshot_to_trace"]


def load_snapshot(path: str | os.PathLike[str], *,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Unpickle a snapshot with the allow-listing unpickler; one clear error if it is not one."""
    path = os.fspath(path)
    with open(path, "rb", buffering=1 << 20) as fh:
        src: Any = fh if progress is None else _Reporting(fh, os.fstat(fh.fileno()).st_size, progress)
        try:
            data = safe_load(src, where=path)
        except UnsafePickleError:
            raise
        except EOFError:
            raise FragInputError(f"{path}: truncated pickle (the file ends in the middle)") from None
        except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError,
                AttributeError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            if "truncated" in str(exc):
                raise FragInputError(f"{path}: truncated pickle (the file ends in the middle)") from None
            raise FragInputError(f"{path}: not a readable pickle ({_short(exc)})") from None
    if not isinstance(data, dict):
        raise FragInputError(
            f"{path}: not a memory snapshot: expected a dict with 'segments' and 'device_traces', "
            f"got {type(data).__name__}")
    return data


class _Reporting:
    """A binary file that reports how far the unpickler has read (every 4 MiB or so)."""

    def __init__(self, fh: Any, total: int, progress: Callable[[int, int], None]) -> None:
        self._fh, self._total, self._progress = fh, total, progress
        self._next = 0

    def _report(self) -> None:
        pos = self._fh.tell()
        if pos >= self._next:
            self._progress(pos, self._total)
            self._next = pos + (4 << 20)

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self._report()
        return data

    def readinto(self, b: Any) -> int:
        n = self._fh.readinto(b)
        self._report()
        return n

    def readline(self, n: int = -1) -> bytes:
        return self._fh.readline(n)

    def peek(self, n: int = 0) -> bytes:
        return self._fh.peek(n)


def snapshot_to_trace(snap: dict[str, Any], *, name: str = "snapshot", where: str = "snapshot",
                      device: int | None = None) -> Trace:
    """Turn a snapshot dict into events (rules in the module docstring)."""
    for key in ("segments", "device_traces"):
        if key not in snap:
            hint = (" (record one with torch.cuda.memory._record_memory_history() before "
                    "_dump_snapshot)") if key == "device_traces" else ""
            raise FragInputError(f"{where}: not a memory snapshot: missing key {key!r}{hint}")
        if not isinstance(snap[key], list):
            raise FragInputError(f"{where}: {key}: expected a list, got {type(snap[key]).__name__}")
    traces = snap["device_traces"]
    notes: list[str] = []
    for d, tr in enumerate(traces):
        if not isinstance(tr, list):
            raise FragInputError(f"{where}: device_traces[{d}]: expected a list of trace entries, "
                                 f"got {type(tr).__name__}")
    nonempty = [d for d, tr in enumerate(traces) if tr]
    if device is None:
        if not nonempty:
            raise FragInputError(
                f"{where}: the snapshot has no trace entries (record them with "
                f"torch.cuda.memory._record_memory_history() before _dump_snapshot)")
        device = max(nonempty, key=lambda d: len(traces[d]))
        if len(nonempty) > 1:
            notes.append(f"the snapshot traces devices {nonempty}; this is device {device} "
                         f"(the longest trace); choose another with --device")
    elif not 0 <= device < len(traces):
        raise FragInputError(f"{where}: device {device} is not in the snapshot "
                             f"(device_traces has {len(traces)} entries)")
    entries = traces[device]
    segments = [s for s in snap["segments"] if _segment_device(s, where) in (device, None)]

    events: list[Event] = []
    ooms: list[OomMarker] = []
    live: dict[int, int] = {}  # addr -> requested bytes
    pending: dict[int, tuple[int, float]] = {}  # addr -> (position in events, time) of a
    # free_requested not yet completed
    late_frees: list[tuple[int, Event]] = []
    before: list[Event] = []  # allocations made before the trace started
    seen: set[int] = set()
    seg_delta: list[tuple[int, int]] = []  # (event position, +/- bytes)
    seg_allocs = seg_frees = 0
    expandable = any(s.get("is_expandable") is True for s in segments)
    streams: set[Any] = set()
    append = events.append
    for i, e in enumerate(entries):
        if type(e) is not dict:
            raise FragInputError(f"{where}: device_traces[{device}][{i}]: expected a trace entry "
                                 f"(dict), got {type(e).__name__}")
        get = e.get
        action = get("action")
        if action == "alloc" or action == "free_completed" or action == "free":
            # The hot path (every allocation and free): checks inline, errors from _addr_size.
            addr = get("addr")
            size = get("size")
            if type(addr) is not int or type(size) is not int or size < 0:
                _addr_size(e, where, device, i)
            t = get("time_us")
            time = t * 1e-6 if type(t) is int or type(t) is float else 0.0
            if action == "alloc":
                if addr in live:
                    raise FragInputError(f"{where}: device_traces[{device}][{i}]: alloc at "
                                         f"{addr:#x} while the block there is still allocated")
                live[addr] = size
                seen.add(addr)
                append(Event("alloc", addr, size, time))
                continue
            if pending:
                pending.pop(addr, None)
            n = live.pop(addr, None)
            if n is not None:
                append(Event("free", addr, n, time))
            elif addr not in seen:
                # Allocated before the ring buffer started: it existed from the start.
                seen.add(addr)
                before.append(Event("alloc", addr, size, 0.0))
                append(Event("free", addr, size, time))
            else:
                raise FragInputError(f"{where}: device_traces[{device}][{i}]: {action} of {addr:#x},"
                                     f" which is not allocated at that point")
            continue
        t = get("time_us")
        time = t * 1e-6 if type(t) is int or type(t) is float else 0.0
        if action == "free_requested":
            addr, size = _addr_size(e, where, device, i)
            pending[addr] = (len(events), time)
            if addr not in seen:
                seen.add(addr)
                before.append(Event("alloc", addr, size, 0.0))
                live[addr] = size
        elif action == "oom":
            size = e.get("size")
            if type(size) is not int or size < 0:
                raise FragInputError(f"{where}: device_traces[{device}][{i}].size: expected the "
                                     f"requested bytes (int), got {_tname(size)}")
            free = e.get("device_free")
            key = f"oom:{len(ooms)}"
            ooms.append(OomMarker(len(events), size, free if type(free) is int else None, time))
            if size > 0:
                append(Event("alloc", key, size, time))
                append(Event("free", key, size, time))
        elif action in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            _, size = _addr_size(e, where, device, i)
            if action == "segment_map" or action == "segment_unmap":
                expandable = True
            if action in ("segment_alloc", "segment_map"):
                streams.add(get("stream"))
                seg_allocs += 1
                seg_delta.append((len(events), size))
            else:
                seg_frees += 1
                seg_delta.append((len(events), -size))
        elif not isinstance(action, str):
            raise FragInputError(f"{where}: device_traces[{device}][{i}].action: expected a string, "
                                 f"got {_tname(action)}")
        # "snapshot" and actions of newer PyTorch versions carry no allocation: skipped.

    # free_requested without free_completed: the free happens where it was requested.
    for addr, (pos, when) in pending.items():
        if addr in live:
            late_frees.append((pos, Event("free", addr, live.pop(addr), when)))
    if late_frees:
        notes.append(f"{len(late_frees)} free_requested without free_completed (the trace ended "
                     f"first) are treated as freed when requested")
        events = _insert(events, late_frees)
        # Markers and segment positions after an insertion shift with it.
        shift = sorted(p for p, _ in late_frees)
        ooms = [OomMarker(m.index + _count_le(shift, m.index), m.nbytes, m.device_free, m.time)
                for m in ooms]
        seg_delta = [(p + _count_le(shift, p - 1), d) for p, d in seg_delta]

    # Blocks active at the end that the trace never mentions were allocated before it.
    active_end = {addr: requested for s_i, seg in enumerate(segments)
                  for addr, requested in _active_blocks(seg, where, s_i)}
    note = _end_state_note(live, seen, active_end) if segments else ""
    for addr, requested in active_end.items():
        if addr not in seen:
            seen.add(addr)
            before.append(Event("alloc", addr, requested, 0.0))
    if before:
        notes.append(f"{len(before)} allocations made before the trace started are allocated "
                     f"at the start")
        n0 = len(before)
        events = before + events
        ooms = [OomMarker(m.index + n0, m.nbytes, m.device_free, m.time) for m in ooms]
        seg_delta = [(p + n0, d) for p, d in seg_delta]

    if note:
        notes.append(note)
    streams.update(s.get("stream") for s in segments)
    if len(streams - {None}) > 1:
        notes.append(f"the run allocated on {len(streams - {None})} streams; the replay puts every "
                     f"allocation on one (PyTorch caches blocks per stream, so the recorded run can "
                     f"fragment more than the model)")
    recorded, reserved_at = _recorded(segments, seg_delta, seg_allocs, seg_frees, where)
    device_memory, source = None, ""
    ooc_meta = snap.get("ooc")
    if isinstance(ooc_meta, dict) and type(ooc_meta.get("device_memory")) is int \
            and ooc_meta["device_memory"] > 0:
        device_memory, source = ooc_meta["device_memory"], "recorded in the snapshot by ooc"
    elif reserved_at is not None:
        for m in ooms:
            if m.device_free is not None:
                device_memory = reserved_at(m.index) + m.device_free
                source = (f"estimated: reserved at the recorded OOM plus the "
                          f"{format_size(m.device_free)} the driver still reported free")
                break
    if not events:
        raise FragInputError(f"{where}: device_traces[{device}] has no alloc or free entries")
    labels = {f"oom:{k}": "the request that ran out of memory" for k in range(len(ooms))}
    return Trace(name=name, kind="snapshot", events=events, ooms=tuple(ooms),
                 device_memory=device_memory, device_memory_source=source, device=device,
                 recorded=recorded, notes=tuple(notes), labels=labels, expandable=expandable)


def _end_state_note(live: dict[int, int], seen: set[int], active_end: dict[int, int]) -> str:
    """The replay starts from the snapshot's state (blocks allocated before the trace began,
    from its segments and from frees of blocks it never saw allocated), so it must end in the
    state the segments record: the same blocks allocated. Where it does not, say by how much,
    so that a reader knows the replay's live bytes are not the snapshot's (issue 40: a real
    snapshot whose replay peaked below the live bytes it held at its end).

    ``live``: what the trace left allocated (late frees taken out), ``seen``: every address the
    trace mentions, before the segments' blocks it never mentions are added at the start.
    Those blocks are allocated at the replay's end by construction, so only the blocks the
    trace mentions can differ: no second pass over the events."""
    missing = sum(n for a, n in active_end.items() if a in seen and a not in live)
    extra = sum(n for a, n in live.items() if a not in active_end)
    if not missing and not extra:
        return ""
    ends_with = sum(live.values()) + sum(n for a, n in active_end.items() if a not in seen)
    return (f"the replay does not end in the snapshot's state: it ends with {format_size(ends_with)} "
            f"allocated, the snapshot's segments hold {format_size(sum(active_end.values()))} "
            f"({format_size(missing)} allocated there that the replay freed or never saw, "
            f"{format_size(extra)} the replay holds that the segments do not)")


def _segment_device(seg: Any, where: str) -> int | None:
    if not isinstance(seg, dict):
        raise FragInputError(f"{where}: segments: expected segment dicts, got {type(seg).__name__}")
    d = seg.get("device")
    return d if type(d) is int else None


def _active_blocks(seg: dict[str, Any], where: str, s_i: int) -> Iterable[tuple[int, int]]:
    base = seg.get("address")
    blocks = seg.get("blocks", [])
    if type(base) is not int or not isinstance(blocks, list):
        raise FragInputError(f"{where}: segments[{s_i}]: expected 'address' (int) and 'blocks' (list)")
    addr = base
    for b_i, b in enumerate(blocks):
        if not isinstance(b, dict) or type(b.get("size")) is not int:
            raise FragInputError(f"{where}: segments[{s_i}].blocks[{b_i}]: expected a block with "
                                 f"an int 'size'")
        if b.get("state") == "active_allocated":
            req = b.get("requested_size", b["size"])
            yield (b["address"] if type(b.get("address")) is int else addr,
                   req if type(req) is int and req > 0 else b["size"])
        addr += b["size"]


def _recorded(segments: list[dict[str, Any]], seg_delta: list[tuple[int, int]], n_alloc: int,
              n_free: int, where: str) -> tuple[Recorded | None, Any]:
    """Reserved bytes over time, counted back from the final segments (exact even when the
    ring buffer dropped the start of the run)."""
    end = 0
    for s_i, seg in enumerate(segments):
        size = seg.get("total_size")
        if type(size) is not int:
            raise FragInputError(f"{where}: segments[{s_i}].total_size: expected int, got {_tname(size)}")
        end += size
    if not seg_delta:  # no segment traffic recorded: reserved stayed what it is at the end
        return None, (lambda index: end)
    total = sum(d for _, d in seg_delta)
    start = end - total
    if start < 0:  # the segments do not match the trace; do not invent numbers
        return None, None
    points, cur = [(0, start)], start
    for pos, d in seg_delta:
        cur += d
        points.append((pos, cur))
    peak = max(r for _, r in points)

    def reserved_at(index: int) -> int:
        value = start
        for pos, r in points[1:]:
            if pos > index:
                break
            value = r
        return value

    return Recorded(peak, n_alloc, n_free, tuple(points)), reserved_at


def _addr_size(e: dict[str, Any], where: str, device: int, i: int) -> tuple[int, int]:
    addr = e.get("addr")
    size = e.get("size")
    if type(addr) is not int:
        what = "missing key 'addr'" if "addr" not in e else f"'addr' is {_tname(addr)}, expected int"
        raise FragInputError(f"{where}: device_traces[{device}][{i}] ({e.get('action')}): {what}")
    if type(size) is not int or size < 0:
        what = "missing key 'size'" if "size" not in e else f"'size' is {_tname(size)}, expected a byte count"
        raise FragInputError(f"{where}: device_traces[{device}][{i}] ({e.get('action')}): {what}")
    return addr, size


def _insert(events: list[Event], extra: list[tuple[int, Event]]) -> list[Event]:
    """``events`` with each (position, event) of ``extra`` inserted before ``events[position]``."""
    extra = sorted(extra, key=lambda pe: pe[0])
    out: list[Event] = []
    j = 0
    for pos, ev in extra:
        out.extend(events[j:pos])
        out.append(ev)
        j = max(j, pos)
    out.extend(events[j:])
    return out


def _count_le(sorted_positions: list[int], x: int) -> int:
    import bisect

    return bisect.bisect_right(sorted_positions, x)
