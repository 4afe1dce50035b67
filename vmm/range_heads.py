"""The front chunks of a live range that no block uses any more ("idle heads"), kept mapped
until a request needs their chunks.

:class:`vmm.SmallBlockAllocator` lets small blocks fill the unused end of a large range's last
chunk (its *tail*). When the large block is freed while small blocks still live in its tail,
the range cannot be freed whole: its last chunk is in use, its first k - 1 chunks are not.
:meth:`IdleHeads.retire_head` leaves those k - 1 chunks mapped where they are and counts them
as cache, not as in use: they leave ``mapped_bytes`` (the bytes under live blocks) and
``live_chunks`` exactly as if they were unmapped, and, like the chunks of parked ranges, any
request may take them (:meth:`IdleHeads._steal_idle`, oldest first, one unmap per chunk).
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

A :class:`~vmm.range_reuse._Range` with an idle head has ``idle`` > 0: its first ``idle``
mapped chunks; those taken by a request are unmapped and counted in ``head`` (the range's
mapped chunks then start ``head`` chunks into it), and such a range is unmapped and left
empty when it is freed (parked ranges are mapped from the front). A mixin of
:class:`vmm.VirtualAllocator`, as :class:`~vmm.range_reuse.RangeReuse` is.
"""

from __future__ import annotations

from typing import Any

from vmm.pool import Chunk, ChunkPool


class IdleHeads:
    """Idle heads of live ranges (see the module docstring). Its state (``_idle``: the live
    ranges with an idle head, oldest first; ``idle_chunks``; the counters) is created by the
    allocator's constructor."""

    pool: ChunkPool
    backend: Any
    chunk_bytes: int
    live_chunks: int
    mapped_bytes: int
    unmap_calls: int
    idle_chunks: int          # idle heads' chunks and sparse ranges' (vmm.sparse_ranges)
    heads_retired: int
    heads_reclaimed: int
    _idle: dict[int, Any]
    _steal_sparse: Any
    _check_sparse: Any

    def retire_head(self, allocation: Any) -> int:
        """Count every chunk of a live allocation but its last as no longer in use, keeping
        it mapped (an idle head); return those bytes. The last chunk stays in use at its
        address (small blocks live there); ``free`` of the allocation later parks the range
        whole if no request took the idle chunks meanwhile. The allocation keeps its
        ``nbytes``; the allocator's ``mapped_bytes`` and ``live_chunks`` drop."""
        rng = allocation._range
        drop = len(rng.chunks) - 1
        if drop <= 0 or rng.idle:
            return 0
        rng.idle = drop
        rng.fence = self.backend.fence()   # work queued before now may still use the chunks
        self._idle[rng.rid] = rng
        self.idle_chunks += drop
        self.live_chunks -= drop
        self.mapped_bytes -= drop * self.chunk_bytes
        self.heads_retired += 1
        return drop * self.chunk_bytes

    def _steal_idle(self, count: int) -> list[Chunk]:
        """Unmap ``count`` idle chunks, from the fronts of the oldest idle heads, then those of
        sparse ranges (``idle_chunks`` counts both), and return them (still handed out by the
        pool). An unmap whose fence has not passed waits for
        the device (the range is live: its address cannot be quarantined as a whole)."""
        chunk = self.chunk_bytes
        out: list[Chunk] = []
        with self.backend.one_synchronization():
            while count and self._idle:
                rng = next(iter(self._idle.values()))
                take = min(count, rng.idle)
                self.backend.unmap(rng.address + rng.head * chunk, take * chunk, fence=rng.fence)
                self.unmap_calls += take
                out.extend(rng.chunks[:take])
                del rng.chunks[:take]
                rng.head += take
                rng.idle -= take
                self.idle_chunks -= take
                if not rng.idle:
                    del self._idle[rng.rid]
                count -= take
            if count:   # then the idle chunks of sparse ranges (vmm.sparse_ranges)
                out.extend(self._steal_sparse(count))
        return out

    def _forget_idle(self, rng: Any) -> int:
        """``free`` of a range with an idle head: its idle chunks join the range's (parked
        with it, or unmapped if its front was taken); return how many there were."""
        idle = rng.idle
        del self._idle[rng.rid]
        self.idle_chunks -= idle
        rng.idle = 0
        if not rng.head:
            self.heads_reclaimed += 1
        return idle

    def _free_headless(self, rng: Any) -> None:
        """``free`` of a range whose front was taken: unmap the rest, keep it free, empty."""
        chunk = self.chunk_bytes
        self.backend.unmap(rng.address + rng.head * chunk, len(rng.chunks) * chunk,
                           fence=self.backend.fence())
        self.unmap_calls += len(rng.chunks)
        self.pool.release(rng.chunks)
        rng.chunks = []
        rng.head = 0

    def _check_idle(self) -> None:
        assert self.idle_chunks == sum(r.idle for r in self._idle.values()) + self._check_sparse()[0]
        assert all(0 < r.idle < len(r.chunks) for r in self._idle.values())
