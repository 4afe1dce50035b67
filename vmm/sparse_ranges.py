"""Reserved ranges whose chunks are mapped one by one, only where a block lies ("sparse
ranges"): what :class:`vmm.SmallBlockAllocator` packs blocks of one to a few chunks into.

A block of n bytes placed so that it touches exactly ceil(n / chunk) chunks of a
:class:`SparseRange` (it starts at most ``k x chunk - n`` bytes into a chunk) costs no more
chunks than a range of its own would, and two such blocks that share a chunk cost one chunk
less: four 2.25 MiB blocks side by side in a 5-chunk range map 5 chunks, not 4 x 2. Chunk j
of the range is in use while ``touch[j]`` (the live blocks that touch it) is above zero, so at
every moment

    chunks in use in the range <= sum over its live blocks of ceil(n / chunk)

which is what a plan made with every size rounded up to whole chunks counted: a pool that runs
the plan never needs more (tests/ooc/test_pool_protocol.py). A 5-chunk slab mapped whole
(what ooc's medium tier did before) keeps 5 chunks for one live 2-chunk block once the others
are freed, and a planned swap-in of GPT-2 at a quarter of its peak ran out of the pool that way.

A chunk no block touches any more stays mapped where it is, *idle*, as the front chunks of a
range under a live tail do (:mod:`vmm.range_heads`): counted as free, not in use (it leaves
``mapped_bytes`` and ``live_chunks``), taken back with no backend call when a block touches
its place again, and taken (unmapped) by any request that needs chunks, after parked ranges
and idle heads. Unmapping at once made the 200k-event swap schedule of bench_frag map and
unmap a chunk every 20 events (11,834 maps, 9,935 unmaps; kept idle: about as few as without
sparse ranges), and on CUDA an unmap at a free makes the host wait for the device.

A mixin of :class:`vmm.VirtualAllocator` (as :class:`~vmm.range_reuse.RangeReuse` and
:class:`~vmm.range_heads.IdleHeads` are): the chunks come from the same budget, by the same
steps (cache, new, stolen from parked ranges or idle heads), and count in its
``mapped_bytes``, ``live_chunks``, ``map_calls`` and ``unmap_calls``; its idle chunks in
``idle_chunks``. A range whose last block goes stays reserved, its idle chunks mapped, and is
handed out again (most recently given back first); :meth:`vmm.VirtualAllocator.trim` unmaps
the idle chunks and frees the empty ranges.
"""

from __future__ import annotations

from typing import Any

from vmm.pool import Chunk, ChunkPool


class SparseRange:
    """``capacity`` chunks of reserved address space at ``address``: ``chunks[j]`` is the chunk
    mapped at position j (None where none is), ``touch[j]`` the live blocks over it; ``mapped``
    chunks are mapped, ``idle`` of them with no block over them; ``live`` while a caller holds
    it; ``fence``: the backend's mark of the last time a chunk went idle."""

    __slots__ = ("owner", "address", "capacity", "chunks", "touch", "mapped", "idle", "live",
                 "fence")

    def __init__(self, owner: Any, address: int, capacity: int) -> None:
        self.owner = owner
        self.address = address
        self.capacity = capacity
        self.chunks: list[Chunk | None] = [None] * capacity
        self.touch = [0] * capacity
        self.mapped = 0
        self.idle = 0
        self.live = False
        self.fence: Any = None

    def buffer(self, offset: int, nbytes: int) -> Any:
        """A host buffer over ``[offset, offset + nbytes)`` (host backend; chunks in use only)."""
        buf = self.owner.backend.buffer(self.address + offset, nbytes)
        buf._ooc_range = self
        return buf


class SparseRanges:
    """Sparse ranges of a :class:`vmm.VirtualAllocator` (see the module docstring). Its state
    (``_spare``: ranges with no block, by capacity; ``_sparse_live``: those held, by id;
    ``_sparse_idle``: ranges with idle chunks, oldest first) is created by the allocator's
    constructor."""

    pool: ChunkPool
    backend: Any
    chunk_bytes: int
    live_chunks: int
    mapped_bytes: int
    peak_mapped_bytes: int
    peak_chunks_in_use: int
    map_calls: int
    unmap_calls: int
    parked_chunks: int
    idle_chunks: int
    ooms: int
    _reserve: Any                    # vmm.range_reuse: address space, counted
    _unreserve: Any
    _spare: dict[int, list[SparseRange]]
    _sparse_live: dict[int, SparseRange]
    _sparse_idle: dict[int, SparseRange]

    def sparse_range(self, capacity: int) -> SparseRange:
        """A live sparse range of ``capacity`` chunks with no block on it: the one given back
        last if there is one (its idle chunks may serve the next blocks), else a new
        reservation (a driver call on CUDA)."""
        spare = self._spare.get(capacity)
        if spare:
            rng = spare.pop()
        else:
            rng = SparseRange(self, self._reserve(capacity), capacity)
        rng.live = True
        self._sparse_live[id(rng)] = rng
        return rng

    def release_sparse(self, rng: SparseRange) -> None:
        """Give back a sparse range with no block left on it (its chunks, if any, idle)."""
        assert rng.live and rng.idle == rng.mapped, "a sparse range goes back with no block"
        rng.live = False
        del self._sparse_live[id(rng)]
        self._spare.setdefault(rng.capacity, []).append(rng)

    def touch(self, rng: SparseRange, first: int, last: int, nbytes: int) -> int:
        """Count a new block over positions ``first..last`` (inclusive): their chunks are in
        use from now on (idle ones taken back as they are, missing ones mapped); return how
        many were not in use before. Raises :class:`vmm.pool.BudgetExceeded` (changing
        nothing) when the budget lacks the chunks to map."""
        touch, chunks = rng.touch, rng.chunks
        need = revive = 0
        for j in range(first, last + 1):
            if not touch[j]:
                if chunks[j] is None:
                    need += 1
                else:
                    revive += 1
        if need > self.pool.available + self.parked_chunks + self.idle_chunks - revive:
            self.ooms += 1
            raise self._oom(nbytes, need)
        # Touched before any chunk is gathered: a steal takes only untouched chunks.
        for j in range(first, last + 1):
            touch[j] += 1
        if revive:
            self._set_idle(rng, rng.idle - revive)
        if need:
            try:
                self._map_missing(rng, first, last, need)
            except BaseException:
                # A backend failure: what this call took back or mapped is idle again.
                for j in range(first, last + 1):
                    touch[j] -= 1
                self._set_idle(rng, rng.idle + sum(
                    1 for j in range(first, last + 1) if not touch[j] and chunks[j] is not None))
                raise
        used = need + revive
        if used:
            self.live_chunks += used
            total = self.mapped_bytes = self.mapped_bytes + used * self.chunk_bytes
            if total > self.peak_mapped_bytes:
                self.peak_mapped_bytes = total
                self.peak_chunks_in_use = self.live_chunks
        return used

    def untouch(self, rng: SparseRange, first: int, last: int) -> int:
        """A block over positions ``first..last`` is gone: the chunks no block touches any
        more go idle (still mapped); return how many."""
        touch = rng.touch
        drop = 0
        for j in range(first, last + 1):
            t = touch[j] = touch[j] - 1
            if not t:
                drop += 1
        if drop:
            rng.fence = self.backend.fence()   # work queued before now may still use them
            self._set_idle(rng, rng.idle + drop)
            self.live_chunks -= drop
            self.mapped_bytes -= drop * self.chunk_bytes
        return drop

    def _map_missing(self, rng: SparseRange, first: int, last: int, need: int) -> None:
        """Map ``need`` chunks at the positions of ``first..last`` with none, one backend call
        per run of such positions; chunks gathered but not mapped go back to the pool."""
        self._flush_quarantine()
        chunks = rng.chunks
        chunk = self.chunk_bytes
        got = self._gather(need)
        try:
            j = first
            while j <= last:
                if chunks[j] is not None:
                    j += 1
                    continue
                end = j
                while end <= last and chunks[end] is None:
                    end += 1
                run, got = got[:end - j], got[end - j:]
                start = rng.address + j * chunk
                self.backend.map_many(start, [c.handle for c in run], chunk)
                chunks[j:end] = run
                rng.mapped += end - j
                self.map_calls += end - j
                self.backend.set_access(start, (end - j) * chunk)
                j = end
        finally:
            self.pool.release(got)

    def _set_idle(self, rng: SparseRange, idle: int) -> None:
        self.idle_chunks += idle - rng.idle
        rng.idle = idle
        if idle:
            self._sparse_idle.setdefault(id(rng), rng)
        else:
            self._sparse_idle.pop(id(rng), None)

    def _steal_sparse(self, count: int) -> list[Chunk]:
        """Unmap up to ``count`` idle chunks of sparse ranges (those idle longest first) and
        return them (still handed out by the pool)."""
        chunk = self.chunk_bytes
        out: list[Chunk] = []
        while count and self._sparse_idle:
            rng = next(iter(self._sparse_idle.values()))
            take = [j for j in range(rng.capacity)
                    if rng.chunks[j] is not None and not rng.touch[j]][:count]
            i = 0
            while i < len(take):     # one unmap per run of positions
                j = end = take[i]
                while i < len(take) and take[i] == end:
                    i += 1
                    end += 1
                self.backend.unmap(rng.address + j * chunk, (end - j) * chunk, fence=rng.fence)
                out.extend(rng.chunks[j:end])   # type: ignore[arg-type]
                rng.chunks[j:end] = [None] * (end - j)
            self.unmap_calls += len(take)
            rng.mapped -= len(take)
            self._set_idle(rng, rng.idle - len(take))
            count -= len(take)
        return out

    def _trim_sparse(self) -> None:
        """Free the address space of every sparse range with no block (their idle chunks
        were stolen before)."""
        for spare in self._spare.values():
            for rng in spare:
                assert not rng.mapped
                self._unreserve(rng.address, rng.capacity)
        self._spare.clear()

    def _check_sparse(self) -> int:
        """Verify the sparse ranges' invariants; return their idle chunks and reserved bytes."""
        ranges = [*self._sparse_live.values(), *(r for s in self._spare.values() for r in s)]
        for rng in ranges:
            assert rng.live == (id(rng) in self._sparse_live)
            assert rng.mapped == sum(c is not None for c in rng.chunks)
            assert all(c is not None for c, t in zip(rng.chunks, rng.touch) if t)
            assert rng.idle == sum(c is not None and not t for c, t in zip(rng.chunks, rng.touch))
            assert (id(rng) in self._sparse_idle) == (rng.idle > 0)
            assert rng.live or not any(rng.touch)
        assert len(self._sparse_idle) == sum(r.idle > 0 for r in ranges)
        return sum(r.idle for r in ranges), sum(r.capacity for r in ranges) * self.chunk_bytes
