"""Replay an allocation trace through an allocator: peaks, a memory curve, the first OOM.

The shared entry point for comparing allocators on the same trace (the simulator and
``ooc frag`` call it)::

    from vmm import CachingAllocator, ChunkPool, SimBackend, VirtualAllocator
    from vmm.replay import Event, replay

    events = [Event("alloc", "a", 3 << 20), Event("alloc", "b", 5 << 20),
              Event("free", "a", 0), Event("free", "b", 0)]
    r1 = replay(events, CachingAllocator(SimBackend()), name="caching")
    r2 = replay(events, VirtualAllocator(ChunkPool(SimBackend(), 2 << 20, 16 << 30)),
                name="vmm-2MiB")
    r1.peak_reserved_bytes, r2.peak_reserved_bytes   # 20 MiB vs 10 MiB (5 chunks)

Any allocator with ``alloc(nbytes) -> handle``, ``free(handle)``, ``stats()`` and the
plain int attributes ``mapped_bytes``, ``map_calls`` and ``unmap_calls`` can be replayed
(both :class:`vmm.CachingAllocator` and :class:`vmm.VirtualAllocator` have them). The
replay stops at the first :class:`vmm.OutOfBudget` and reports where it happened; the
allocator is left as it was at that point (live blocks are not freed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from vmm.errors import OutOfBudget, VMMError

MAX_SAMPLES = 20_000
PROGRESS_EVERY = 1 << 16


class ReplayError(VMMError):
    """The trace itself is inconsistent (free of an unknown key, alloc of a live key)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One trace event: ``action`` ("alloc" or "free") of the block ``key`` (an address,
    a variable id...), ``nbytes`` requested (ignored for "free"), optional ``time``."""

    action: str
    key: int | str
    nbytes: int
    time: float = 0.0


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured.

    - ``allocator``: the name given ("caching", "vmm-2MiB", ...).
    - ``events``: events applied (at an OOM: the events before it).
    - ``peak_live_bytes``: peak of requested bytes live (the trace's own need).
    - ``peak_reserved_bytes``: peak of the allocator's ``mapped_bytes`` during the replay
      (caching: segment bytes; vmm: chunks mapped under live allocations).
    - ``final_stats``: ``allocator.stats()`` at the end.
    - ``samples``: int64 array of shape (k, 3): event index, live bytes, reserved/mapped
      bytes after that event; every event while there are at most ``MAX_SAMPLES`` rows,
      then evenly decimated (the last event is always included).
    - ``oom_index``, ``oom_request``: the event that failed and its bytes (else None).
    - ``largest_free_at_oom``: the largest free block (caching) or largest request that
      fits (vmm) at that moment.
    - ``map_calls``, ``unmap_calls``: mappings made / removed during the replay.
    """

    allocator: str
    events: int
    peak_live_bytes: int
    peak_reserved_bytes: int
    final_stats: dict
    samples: np.ndarray
    oom_index: int | None
    oom_request: int | None
    largest_free_at_oom: int | None
    map_calls: int
    unmap_calls: int

    @property
    def overhead(self) -> float:
        """``peak_reserved_bytes / peak_live_bytes`` (1.0 is perfect; 0 if nothing was live)."""
        return self.peak_reserved_bytes / self.peak_live_bytes if self.peak_live_bytes else 0.0


def replay(events: Iterable[Event], allocator: Any, *, name: str,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Apply ``events`` in order to ``allocator`` and measure (see :class:`ReplayResult`).

    Raises :class:`ReplayError` (naming the key and the event index) for a free of a key
    that is not live or an alloc of a key that already is; an unknown action likewise.
    ``progress(n)`` is called every 65,536 events and once at the end with the count.
    """
    alloc, free = allocator.alloc, allocator.free
    map0, unmap0 = allocator.map_calls, allocator.unmap_calls
    live: dict[Any, tuple[Any, int, int]] = {}
    live_bytes = peak_live = 0
    peak_reserved = allocator.mapped_bytes
    rows_i: list[int] = []
    rows_live: list[int] = []
    rows_res: list[int] = []
    stride = 1
    try:
        total = len(events)  # type: ignore[arg-type]
        stride = max(1, -(-total // MAX_SAMPLES))
    except TypeError:
        pass
    next_sample = 0
    next_progress = PROGRESS_EVERY
    oom_index = oom_request = largest_at_oom = None
    i = -1
    for i, ev in enumerate(events):
        action = ev.action
        if action == "alloc":
            key = ev.key
            if key in live:
                raise ReplayError(f"event {i}: alloc of key {key!r}, which is already live "
                                  f"(allocated at event {live[key][2]})")
            nbytes = ev.nbytes
            try:
                handle = alloc(nbytes)
            except OutOfBudget as exc:
                oom_index, oom_request = i, nbytes
                largest = getattr(allocator, "largest_free_block", None)
                largest_at_oom = largest() if largest else getattr(exc, "largest_fit", None)
                break
            live[key] = (handle, nbytes, i)
            live_bytes += nbytes
            if live_bytes > peak_live:
                peak_live = live_bytes
            reserved = allocator.mapped_bytes
            if reserved > peak_reserved:
                peak_reserved = reserved
        elif action == "free":
            entry = live.pop(ev.key, None)
            if entry is None:
                raise ReplayError(f"event {i}: free of key {ev.key!r}, which is not live "
                                  "(never allocated, or already freed)")
            free(entry[0])
            live_bytes -= entry[1]
        else:
            raise ReplayError(f"event {i}: unknown action {action!r} (expected 'alloc' or "
                              "'free')")
        if i == next_sample:
            rows_i.append(i)
            rows_live.append(live_bytes)
            rows_res.append(allocator.mapped_bytes)
            next_sample += stride
            if len(rows_i) >= MAX_SAMPLES:  # length unknown or underestimated: halve
                del rows_i[1::2], rows_live[1::2], rows_res[1::2]
                stride *= 2
                next_sample = rows_i[-1] + stride
        if i == next_progress and progress is not None:
            progress(i)
            next_progress += PROGRESS_EVERY
    applied = oom_index if oom_index is not None else i + 1
    last = applied - 1
    if last >= 0 and (not rows_i or rows_i[-1] != last):
        rows_i.append(last)
        rows_live.append(live_bytes)
        rows_res.append(allocator.mapped_bytes)
    if progress is not None:
        progress(applied)
    samples = np.array([rows_i, rows_live, rows_res], dtype=np.int64).T.reshape(-1, 3)
    return ReplayResult(
        allocator=name, events=applied, peak_live_bytes=peak_live,
        peak_reserved_bytes=peak_reserved, final_stats=allocator.stats(), samples=samples,
        oom_index=oom_index, oom_request=oom_request, largest_free_at_oom=largest_at_oom,
        map_calls=allocator.map_calls - map0, unmap_calls=allocator.unmap_calls - unmap0)


def swap_trace(n_events: int = 1_000_000, *, layers: int = 48, resident: int = 6,
               min_bytes: int = 64 << 10, max_bytes: int = 96 << 20,
               jitter: float = 0.0, seed: int = 0) -> list[Event]:
    """A synthetic swap schedule's allocation trace, repeated step after step.

    Each step of a ``layers``-deep model: forward, layer i allocates its activation and
    a short-lived temporary; once more than ``resident`` activations are live the oldest
    is freed (swap-out). Backward walks the layers in reverse: a swapped-out activation is
    allocated again (swap-in), a gradient temporary comes and goes, and the activation is
    freed. Sizes are log-uniform in [min_bytes, max_bytes], fixed per layer (a training
    step repeats itself) and, with ``jitter`` > 0, varied by up to that fraction at every
    event (dynamic shapes). Deterministic for a given ``seed``. Returns ``n_events``
    events (``n_events - 1`` if odd), every block freed by the end.
    """
    rng = np.random.default_rng(seed)
    lo, hi = np.log(min_bytes), np.log(max_bytes)
    act = np.exp(rng.uniform(lo, hi, layers)).astype(np.int64).tolist()
    tmp = np.exp(rng.uniform(lo, hi, layers)).astype(np.int64).tolist()
    out: list[Event] = []
    key = 0
    while True:
        noise = iter((1.0 + jitter * rng.uniform(-1.0, 1.0, 5 * layers)).tolist()) \
            if jitter else None

        def sized(base: int) -> int:
            return max(1, int(base * next(noise))) if noise is not None else base

        step: list[Event] = []
        resident_now: list[int] = []
        current: dict[int, int] = {}  # layer -> key of its live activation, -1 if swapped out
        for i in range(layers):  # forward
            step.append(Event("alloc", key, sized(act[i])))
            step.append(Event("alloc", key + 1, sized(tmp[i])))
            step.append(Event("free", key + 1, 0))
            current[i] = key
            key += 2
            resident_now.append(i)
            if len(resident_now) > resident:  # swap-out of the oldest resident activation
                old = resident_now.pop(0)
                step.append(Event("free", current[old], 0))
                current[old] = -1
        for i in reversed(range(layers)):  # backward
            if current[i] == -1:  # swap-in
                current[i] = key
                step.append(Event("alloc", key, sized(act[i])))
                key += 1
            step.append(Event("alloc", key, sized(tmp[i])))
            step.append(Event("free", key, 0))
            key += 1
            step.append(Event("free", current[i], 0))
        if len(out) + len(step) > n_events:
            break
        out.extend(step)
    # Fill what is left with the start of one more step, keeping room to free its blocks.
    room = n_events - len(out)
    live: dict[Any, None] = {}
    for ev in step:
        if ev.action == "alloc":
            if room - 1 < len(live) + 1:
                break
            live[ev.key] = None
        elif ev.key in live:
            del live[ev.key]
        else:
            continue
        out.append(ev)
        room -= 1
    pad = 0
    while room - len(live) >= 2:
        out.append(Event("alloc", ("pad", pad), min_bytes))
        out.append(Event("free", ("pad", pad), 0))
        pad += 1
        room -= 2
    out.extend(Event("free", k, 0) for k in live)
    return out
