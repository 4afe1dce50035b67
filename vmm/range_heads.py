"""The front chunks of a live range that no block uses any more ("idle heads"), kept mapped
until a request needs their chunks.

:class:`vmm.SmallBlockAllocator` lets small blocks fill the unused end of a large range's last
chunk (its *tail*). When the large block is freed while small blocks still live in its tail,
the range cannot be freed whole: its last chunk is in use, its first k - 1 chunks are not.
:meth:`vmm.VirtualAllocator.retire_head` leaves those k - 1 chunks mapped where they are and
counts them as cache, not as in use: they leave ``mapped_bytes`` (the bytes under live blocks)
and ``live_chunks`` exactly as if they were unmapped, and, like the chunks of parked ranges,
any request may take them (:meth:`IdleHeads.steal`, oldest first, one unmap per chunk).
When the tail's last block goes, the range is freed with all its chunks still mapped and is
parked whole: the next request of k chunks reuses it with no backend call.

Why not unmap them at once (what this replaced, ``release_head``): the swap schedule of
benchmarks/bench_frag.py then made a map and an unmap call for every 3-4 events (297k maps
per 1M events), because each range freed under a live tail came back empty and the next
request of its size mapped k fresh chunks into it; kept mapped, the range comes back whole
(1,899 maps per 1M events, pure chunks 1,704: benchmarks/results/frag.md).
A device of the peak of ``mapped_bytes`` is still enough for a trace, as with parked ranges:
the budget check of :meth:`vmm.VirtualAllocator.alloc` counts idle chunks as available, and
takes them (unmapping them) before it fails; ``lean`` takes them before making new chunks.

A :class:`~vmm.free_ranges._Range` with an idle head has ``idle`` > 0: its first ``idle``
mapped chunks; those taken by a request are unmapped and counted in ``head`` (the range's
mapped chunks then start ``head`` chunks into it), and such a range is unmapped and left
empty when it is freed (parked ranges are mapped from the front).

:class:`IdleHeads` is the part of :class:`vmm.VirtualAllocator` that owns the index of those
ranges (``_idle``, oldest first). The counts it changes (``idle_chunks``, ``live_chunks``,
``mapped_bytes``, ``unmap_calls``, ``heads_retired``, ``heads_reclaimed``) are the allocator's
plain attributes; ``idle_chunks`` counts the idle chunks of sparse ranges as well
(:mod:`vmm.sparse_ranges`), which :meth:`IdleHeads.steal` takes after its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vmm.free_ranges import _Range
from vmm.pool import Chunk

if TYPE_CHECKING:
    from vmm.sparse_ranges import SparseRanges


class IdleHeads:
    """Idle heads of the live ranges of one :class:`vmm.VirtualAllocator` (see the module
    docstring): ``_idle``, the live ranges with an idle head, oldest first."""

    def __init__(self, allocator: Any, sparse: SparseRanges) -> None:
        self._va = allocator          # the vmm.VirtualAllocator: its counters
        self._sparse = sparse         # whose idle chunks :meth:`steal` takes after these
        self._pool = allocator.pool
        self._backend = allocator.backend
        self._chunk = allocator.chunk_bytes
        self._idle: dict[int, _Range] = {}

    def retire(self, allocation: Any) -> int:
        """:meth:`vmm.VirtualAllocator.retire_head`: make every chunk of a live allocation
        but its last an idle head; return those bytes (0 if it has one chunk or is idle)."""
        rng = allocation._range
        drop = len(rng.chunks) - 1
        if drop <= 0 or rng.idle:
            return 0
        va = self._va
        rng.idle = drop
        rng.fence = self._backend.fence()   # work queued before now may still use the chunks
        self._idle[rng.rid] = rng
        va.idle_chunks += drop
        va.live_chunks -= drop
        va.mapped_bytes -= drop * self._chunk
        va.heads_retired += 1
        return drop * self._chunk

    def steal(self, count: int) -> list[Chunk]:
        """Unmap ``count`` idle chunks, from the fronts of the oldest idle heads, then those of
        sparse ranges (``idle_chunks`` counts both), and return them (still handed out by the
        pool). An unmap whose fence has not passed waits for
        the device (the range is live: its address cannot be quarantined as a whole)."""
        va = self._va
        chunk = self._chunk
        out: list[Chunk] = []
        with self._backend.one_synchronization():
            while count and self._idle:
                rng = next(iter(self._idle.values()))
                take = min(count, rng.idle)
                self._backend.unmap(rng.address + rng.head * chunk, take * chunk, fence=rng.fence)
                va.unmap_calls += take
                out.extend(rng.chunks[:take])
                del rng.chunks[:take]
                rng.head += take
                rng.idle -= take
                va.idle_chunks -= take
                if not rng.idle:
                    del self._idle[rng.rid]
                count -= take
            if count:   # then the idle chunks of sparse ranges (vmm.sparse_ranges)
                out.extend(self._sparse.steal(count))
        return out

    def forget(self, rng: _Range) -> int:
        """``free`` of a range with an idle head: its idle chunks join the range's (parked
        with it, or unmapped if its front was taken); return how many there were."""
        idle = rng.idle
        del self._idle[rng.rid]
        self._va.idle_chunks -= idle
        rng.idle = 0
        if not rng.head:
            self._va.heads_reclaimed += 1
        return idle

    def free_headless(self, rng: _Range) -> None:
        """``free`` of a range whose front was taken: unmap the rest, leave it empty (the
        allocator then makes it a free range)."""
        chunk = self._chunk
        self._backend.unmap(rng.address + rng.head * chunk, len(rng.chunks) * chunk,
                            fence=self._backend.fence())
        self._va.unmap_calls += len(rng.chunks)
        self._pool.release(rng.chunks)
        rng.chunks = []
        rng.head = 0

    def check(self) -> int:
        """Verify the idle heads' invariants (for tests); return their idle chunks."""
        assert all(0 < r.idle < len(r.chunks) for r in self._idle.values())
        return sum(r.idle for r in self._idle.values())
