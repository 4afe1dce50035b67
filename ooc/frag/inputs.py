"""Read what users bring to ``ooc frag`` into one list of ``vmm.replay.Event``.

Three inputs, recognised by their first bytes (then by extension):

- a PyTorch memory snapshot, the pickle ``torch.cuda.memory._dump_snapshot`` writes
  (loaded with :mod:`ooc.frag.safe_pickle`, never with plain pickle);
- an ooc trace (``ooc.sequence``) or plan (``ooc.schedule``) JSON file;
- a CSV with a header line naming the columns ``time, action, address, bytes``.

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
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from vmm.errors import OOCError
from vmm.replay import Event
from vmm.units import format_size

from ooc.frag.safe_pickle import UnsafePickleError, safe_load

__all__ = ["gc_paused", "FragInputError", "OomMarker", "Recorded", "Trace", "load", "load_snapshot",
           "snapshot_to_trace", "load_csv", "load_ooc_json", "sequence_events"]


class FragInputError(OOCError, ValueError):
    """An input ``ooc frag`` cannot read; the message names the file and where in it."""


@dataclass(frozen=True, slots=True)
class OomMarker:
    """A recorded out-of-memory: the failed request is replayed as ``events[index]``."""

    index: int
    nbytes: int
    device_free: int | None = None
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the recorded allocator itself did, when the input says (snapshots only)."""

    peak_reserved_bytes: int
    segment_allocs: int
    segment_frees: int
    # (event index, reserved bytes) after each change, for the plot.
    reserved_points: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Trace:
    """An input read into replayable events plus what it says about the run."""

    name: str
    kind: str  # "snapshot", "csv", "sequence" or "schedule"
    events: list[Event]
    ooms: tuple[OomMarker, ...] = ()
    device_memory: int | None = None
    device_memory_source: str = ""
    device: int | None = None
    recorded: Recorded | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Key -> what it is ("conv1.out (variable 12, activation)"), where the input says.
    labels: dict[Any, str] = field(default_factory=dict)
    # Recorded with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: its segments say
    # ``is_expandable`` or its trace maps pages (``segment_map``).
    expandable: bool = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit).

    Loading a snapshot builds millions of dicts and events that all stay alive; every
    collection the allocation count triggers would walk all of them again (4x slower loads
    here). Reference counting still frees everything that is not in a cycle.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load(path: str | os.PathLike[str], *, device: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read ``path`` (snapshot, ooc JSON or CSV; see the module docstring) into a Trace.

    ``device`` picks the device of a multi-device snapshot. ``progress(done, total)`` is
    called with bytes read while a snapshot is unpickled (large ones take seconds).
    """
    with gc_paused():
        return _load(os.fspath(path), device, progress)


def _load(path: str, device: int | None, progress: Callable[[int, int], None] | None) -> Trace:
    name = os.path.basename(path)
    with open(path, "rb") as fh:
        head = fh.read(64)
    stripped = head.lstrip()
    ext = os.path.splitext(path)[1].lower()
    if head[:1] == b"\x80" or ext in (".pickle", ".pkl", ".pck"):
        return snapshot_to_trace(load_snapshot(path, progress=progress), name=name, where=path,
                                 device=device)
    if stripped[:1] in (b"{", b"[") or ext == ".json":
        return load_ooc_json(path)
    return load_csv(path)


# -- snapshots ---------------------------------------------------------------------------------


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
    for s_i, seg in enumerate(segments):
        for addr, requested in _active_blocks(seg, where, s_i):
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


# -- CSV -----------------------------------------------------------------------------------------

_COLUMNS = {"time": ("time", "time_s", "t"), "action": ("action", "op"),
            "address": ("address", "addr", "key"), "bytes": ("bytes", "size", "nbytes")}


def load_csv(path: str | os.PathLike[str]) -> Trace:
    """Read a CSV of ``time, action, address, bytes`` rows (header first; action is ``alloc`` or
    ``free``; address is any key, ``0x`` hex or decimal; bytes may be empty on a free)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except UnicodeDecodeError:
        raise FragInputError(f"{path}: not a snapshot, an ooc JSON file or a text CSV "
                             f"(binary data that is not a pickle)") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise FragInputError(f"{path}: empty file") from None
    except csv.Error as exc:
        raise FragInputError(f"{path}: line 1: not CSV ({exc})") from None
    names = [h.strip().lower() for h in header]
    col: dict[str, int] = {}
    for want, aliases in _COLUMNS.items():
        for a in aliases:
            if a in names:
                col[want] = names.index(a)
                break
        else:
            raise FragInputError(
                f"{path}: line 1: the header must name the columns time, action, address, bytes "
                f"(got {', '.join(repr(h) for h in header[:6]) or 'nothing'})")
    width = max(col.values()) + 1
    events: list[Event] = []
    live: dict[Any, int] = {}
    try:
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < width:
                raise FragInputError(f"{path}: row {line}: expected {width} columns, got {len(row)}")
            action = row[col["action"]].strip().lower()
            key = _key(row[col["address"]].strip())
            if key == "":
                raise FragInputError(f"{path}: row {line}: empty address")
            t_s = row[col["time"]].strip()
            try:
                time = float(t_s) if t_s else 0.0
            except ValueError:
                raise FragInputError(f"{path}: row {line}: time {t_s!r} is not a number") from None
            b_s = row[col["bytes"]].strip()
            nbytes = None
            if b_s:
                try:
                    nbytes = int(b_s)
                except ValueError:
                    raise FragInputError(f"{path}: row {line}: bytes {b_s!r} is not an integer") from None
            if action == "alloc":
                if nbytes is None or nbytes <= 0:
                    raise FragInputError(f"{path}: row {line}: alloc needs a positive byte count, "
                                         f"got {b_s!r}")
                if key in live:
                    raise FragInputError(f"{path}: row {line}: alloc of address {row[col['address']].strip()}"
                                         f", which is already allocated")
                live[key] = nbytes
                events.append(Event("alloc", key, nbytes, time))
            elif action in ("free", "free_completed"):
                if key not in live:
                    raise FragInputError(f"{path}: row {line}: free of address {row[col['address']].strip()}"
                                         f", which is not allocated")
                size = live.pop(key)
                if nbytes not in (None, 0, size):
                    raise FragInputError(f"{path}: row {line}: free of {nbytes} bytes at "
                                         f"{row[col['address']].strip()}, which was allocated with {size}")
                events.append(Event("free", key, size, time))
            else:
                raise FragInputError(f"{path}: row {line}: action {row[col['action']].strip()!r} is "
                                     f"not 'alloc' or 'free'")
    except csv.Error as exc:
        raise FragInputError(f"{path}: row {reader.line_num}: not CSV ({exc})") from None
    if not events:
        raise FragInputError(f"{path}: no alloc or free rows after the header")
    return Trace(name=os.path.basename(path), kind="csv", events=events)


def _key(s: str) -> int | str:
    try:
        return int(s, 0)
    except ValueError:
        return s


# -- ooc trace and plan files ----------------------------------------------------------------


def load_ooc_json(path: str | os.PathLike[str]) -> Trace:
    """Events of an ooc trace (eager lifetimes) or plan (``scheduler.memory_events``)."""
    from scheduler.errors import SequenceFormatError
    from scheduler.ir import SCHEMA as SEQ_SCHEMA
    from scheduler.ir import VariableSequence
    from scheduler.schedule import SCHEMA as PLAN_SCHEMA
    from scheduler.schedule import Schedule

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            head = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FragInputError(f"{path}: not a JSON file ({_short(exc)})") from None
    schema = head.get("schema") if isinstance(head, dict) else None
    del head
    name = os.path.basename(path)
    try:
        if schema == SEQ_SCHEMA:
            seq = VariableSequence.from_json(path)
            return Trace(name=name, kind="sequence", events=sequence_events(seq),
                         labels=_labels(seq), notes=("eager lifetimes: each variable is allocated at its first use "
                                "(live_in ones at the start) and freed after its last use",))
        if schema == PLAN_SCHEMA:
            plan = Schedule.from_json(path)
            return Trace(name=name, kind="schedule", events=_plan_events(plan, path),
                         device_memory=plan.budget, device_memory_source="the plan's budget",
                         labels=_labels(plan.sequence),
                         notes=("allocations follow the plan's swap-ins, swap-outs and frees",))
    except SequenceFormatError as exc:
        raise FragInputError(str(exc)) from None
    raise FragInputError(f"{path}: a JSON file that is neither an ooc trace ({SEQ_SCHEMA}) nor an "
                         f"ooc plan ({PLAN_SCHEMA}) (schema is {schema!r})")


def _labels(seq: Any) -> dict[Any, str]:
    return {v: f"{var.name or var.kind.value} (variable {v}, {var.kind.value})"
            for v, var in seq.variables.items()}


def sequence_events(seq: Any) -> list[Event]:
    """Eager-PyTorch allocation events of a ``scheduler.VariableSequence``.

    ``live_in`` variables are allocated before the first function; any other variable just
    before the function that first uses it; a variable is freed right after its last use
    unless it is ``live_out``. Zero-byte variables take no memory and make no events. The peak
    live bytes of these events is ``seq.in_core_peak_bytes``. Times are function indices.
    """
    n = len(seq.functions)
    born: list[list[int]] = [[] for _ in range(n)]
    dies: list[list[int]] = [[] for _ in range(n)]
    start: list[int] = []
    first, last = seq.first_use, seq.last_use
    for v, var in seq.variables.items():
        if var.nbytes <= 0 or v not in first:
            continue  # no bytes, or never used: eager PyTorch never holds it during the step
        if var.live_in:
            start.append(v)
        else:
            born[first[v]].append(v)
        if not var.live_out:
            dies[last[v]].append(v)
    nb = {v: var.nbytes for v, var in seq.variables.items()}
    events = [Event("alloc", v, nb[v], 0.0) for v in start]
    for i in range(n):
        t = float(i)
        events.extend(Event("alloc", v, nb[v], t) for v in born[i])
        events.extend(Event("free", v, nb[v], t) for v in dies[i])
    return events


def _plan_events(plan: Any, path: str) -> list[Event]:
    try:
        from scheduler.memory_events import allocation_events
    except ModuleNotFoundError as exc:
        if exc.name != "scheduler.memory_events":
            raise
        raise FragInputError(
            f"{path}: an ooc plan; replaying plans needs scheduler.memory_events, which this ooc "
            f"does not have; run `ooc frag` on the trace the plan was made from") from None
    from scheduler.errors import ScheduleError

    try:
        events = allocation_events(plan)
    except ScheduleError as exc:
        raise FragInputError(f"{path}: {exc} (scheduler.check diagnoses the plan)") from None
    # Zero-byte variables take no device memory: no request reaches an allocator.
    return [e for e in events if e.nbytes > 0]


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 120 else text[:117] + "..."


def _tname(x: Any) -> str:
    return "missing" if x is None else type(x).__name__
