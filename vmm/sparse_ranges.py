"""Reserved ranges whose chunks are mapped one by one, only where a block lies ("sparse
ranges"): what :class:`vmm.SmallBlockAllocator` packs blocks of one to a few chunks into.

A block of n bytes placed so that it touches exactly ceil(n / chunk) chunks of a
:class:`SparseRange` (it starts at most ``k x chunk - n`` bytes into a chunk) costs no more
chunks than a range of its own would, and two such blocks that share a chunk cost one chunk
less: four 2.25 MiB blocks side by side in a 5-chunk range map 5 chunks, not 4 x 2. Chunk j
of the range is mapped while ``touch[j]`` (the live blocks that touch it) is above zero and
unmapped, back to the pool, when it drops to zero. So, at every moment,

    mapped chunks of the range <= sum over its live blocks of ceil(n / chunk)

which is what a plan made with every size rounded up to whole chunks counted: a pool that runs
the plan never needs more (tests/ooc/test_pool_protocol.py). A 5-chunk slab mapped whole
(what ooc's medium tier did before) keeps 5 chunks for one live 2-chunk block once the others
are freed, and a planned swap-in of GPT-2 at a quarter of its peak ran out of the pool that way.

A mixin of :class:`vmm.VirtualAllocator` (as :class:`~vmm.range_reuse.RangeReuse` and
:class:`~vmm.range_heads.IdleHeads` are): the chunks come from the same budget, by the same
steps (cache, new, stolen from parked ranges or idle heads), and count in its
``mapped_bytes``, ``live_chunks``, ``map_calls`` and ``unmap_calls``. The range's address
space stays reserved when its last block goes (empty, nothing mapped) and is handed out again;
:meth:`vmm.VirtualAllocator.trim` frees it.
"""

from __future__ import annotations

from typing import Any

from vmm.pool import Chunk, ChunkPool


class SparseRange:
    """``capacity`` chunks of reserved address space at ``address``: ``chunks[j]`` is the chunk
    mapped at position j (None where none is), ``touch[j]`` the live blocks over it,
    ``mapped`` how many are mapped; ``live`` while a caller holds it."""

    __slots__ = ("owner", "address", "capacity", "chunks", "touch", "mapped", "live")

    def __init__(self, owner: Any, address: int, capacity: int) -> None:
        self.owner = owner
        self.address = address
        self.capacity = capacity
        self.chunks: list[Chunk | None] = [None] * capacity
        self.touch = [0] * capacity
        self.mapped = 0
        self.live = False

    def missing(self, first: int, last: int) -> int:
        """How many chunks of positions ``first..last`` (inclusive) are not mapped yet."""
        return self.touch[first:last + 1].count(0)

    def buffer(self, offset: int, nbytes: int) -> Any:
        """A host buffer over ``[offset, offset + nbytes)`` (host backend; mapped chunks only)."""
        buf = self.owner.backend.buffer(self.address + offset, nbytes)
        buf._ooc_range = self
        return buf


class SparseRanges:
    """Sparse ranges of a :class:`vmm.VirtualAllocator` (see the module docstring). Its state
    (``_spare``: empty ranges by capacity; ``_sparse_live``: those held, by id) is created by
    the allocator's constructor."""

    pool: ChunkPool
    backend: Any
    chunk_bytes: int
    live_chunks: int
    mapped_bytes: int
    peak_mapped_bytes: int
    peak_chunks_in_use: int
    map_calls: int
    unmap_calls: int
    reserved_bytes: int
    peak_reserved_bytes: int
    reserve_calls: int
    free_range_calls: int
    parked_chunks: int
    idle_chunks: int
    ooms: int
    _spare: dict[int, list[SparseRange]]
    _sparse_live: dict[int, SparseRange]

    def sparse_range(self, capacity: int) -> SparseRange:
        """A live sparse range of ``capacity`` chunks with nothing mapped (an empty one kept
        from before if there is one: reserving address space is a driver call on CUDA)."""
        spare = self._spare.get(capacity)
        if spare:
            rng = spare.pop()
        else:
            address = self.backend.reserve_range(capacity * self.chunk_bytes)
            self.reserve_calls += 1
            self.reserved_bytes += capacity * self.chunk_bytes
            if self.reserved_bytes > self.peak_reserved_bytes:
                self.peak_reserved_bytes = self.reserved_bytes
            rng = SparseRange(self, address, capacity)
        rng.live = True
        self._sparse_live[id(rng)] = rng
        return rng

    def release_sparse(self, rng: SparseRange) -> None:
        """Give back a sparse range with no block left on it (nothing mapped)."""
        assert rng.live and not rng.mapped, "a sparse range goes back empty"
        rng.live = False
        del self._sparse_live[id(rng)]
        self._spare.setdefault(rng.capacity, []).append(rng)

    def touch(self, rng: SparseRange, first: int, last: int, nbytes: int) -> int:
        """Count a new block over positions ``first..last``: map those no block touched yet,
        and return how many. Raises :class:`vmm.pool.BudgetExceeded` (changing nothing) when
        the budget lacks them."""
        touch = rng.touch
        need = touch[first:last + 1].count(0)
        if need:
            if need > self.pool.available + self.parked_chunks + self.idle_chunks:
                self.ooms += 1
                raise self._oom(nbytes, need)
            self._flush_quarantine()
            got = self._gather(need)
            chunk = self.chunk_bytes
            it = iter(got)
            try:
                j = first
                while j <= last:        # map each run of missing positions with one call
                    if touch[j]:
                        j += 1
                        continue
                    end = j
                    while end <= last and not touch[end]:
                        end += 1
                    run = [next(it) for _ in range(end - j)]
                    start = rng.address + j * chunk
                    self.backend.map_many(start, [c.handle for c in run], chunk)
                    rng.chunks[j:end] = run
                    rng.mapped += end - j
                    self.map_calls += end - j
                    self.backend.set_access(start, (end - j) * chunk)
                    j = end
            except BaseException:
                # A backend failure: what this call mapped goes back, the rest to the pool.
                self._unmap_positions(rng, [j for j in range(first, last + 1)
                                            if not touch[j] and rng.chunks[j] is not None])
                self.pool.release(list(it))
                raise
            self.live_chunks += need
            total = self.mapped_bytes = self.mapped_bytes + need * chunk
            if total > self.peak_mapped_bytes:
                self.peak_mapped_bytes = total
                self.peak_chunks_in_use = self.live_chunks
        for j in range(first, last + 1):
            touch[j] += 1
        return need

    def untouch(self, rng: SparseRange, first: int, last: int) -> int:
        """A block over positions ``first..last`` is gone: unmap the chunks no block touches
        any more (back to the pool) and return how many."""
        touch = rng.touch
        drop = []
        for j in range(first, last + 1):
            t = touch[j] = touch[j] - 1
            if not t:
                drop.append(j)
        if drop:
            self._unmap_positions(rng, drop)
            self.live_chunks -= len(drop)
            self.mapped_bytes -= len(drop) * self.chunk_bytes
        return len(drop)

    def _unmap_positions(self, rng: SparseRange, positions: list[int]) -> None:
        """Unmap the chunks at ``positions`` (ascending) and return them to the pool. The
        device may still use them (work queued before the free): the backend waits for the
        fence taken now, as for any range unmapped at its free."""
        chunk = self.chunk_bytes
        fence = self.backend.fence()
        out: list[Chunk] = []
        with self.backend.one_synchronization():
            i = 0
            while i < len(positions):
                j = end = positions[i]
                while i < len(positions) and positions[i] == end:
                    i += 1
                    end += 1
                self.backend.unmap(rng.address + j * chunk, (end - j) * chunk, fence=fence)
                out.extend(rng.chunks[j:end])   # type: ignore[arg-type]
                rng.chunks[j:end] = [None] * (end - j)
        self.unmap_calls += len(out)
        rng.mapped -= len(out)
        self.pool.release(out)

    def _trim_sparse(self) -> None:
        """Free the address space of every empty sparse range."""
        for spare in self._spare.values():
            for rng in spare:
                self.backend.free_range(rng.address, rng.capacity * self.chunk_bytes)
                self.free_range_calls += 1
                self.reserved_bytes -= rng.capacity * self.chunk_bytes
        self._spare.clear()

    def _check_sparse(self) -> int:
        """Verify the sparse ranges' invariants; return their reserved bytes."""
        for rng in self._sparse_live.values():
            assert rng.live
            assert rng.mapped == sum(c is not None for c in rng.chunks)
            assert all((c is not None) == (t > 0) for c, t in zip(rng.chunks, rng.touch))
        for spare in self._spare.values():
            assert all(not r.live and not r.mapped and not any(r.touch) for r in spare)
        ranges = [*self._sparse_live.values(), *(r for s in self._spare.values() for r in s)]
        return sum(r.capacity for r in ranges) * self.chunk_bytes
