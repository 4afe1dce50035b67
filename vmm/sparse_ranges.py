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

:class:`SparseRanges` is the part of :class:`vmm.VirtualAllocator` that owns them, as
:class:`~vmm.free_ranges.FreeRanges` owns the free ranges and
:class:`~vmm.range_heads.IdleHeads` the idle heads: the chunks come from the same budget, by
the same steps (cache, new, stolen from parked ranges or idle heads:
:meth:`~vmm.free_ranges.FreeRanges.gather`), their address space from
:meth:`~vmm.free_ranges.FreeRanges.reserve`, and they count in the allocator's
``mapped_bytes``, ``live_chunks``, ``map_calls`` and ``unmap_calls``; their idle chunks in
``idle_chunks``. A range whose last block goes stays reserved, its idle chunks mapped, and is
handed out again (most recently given back first); :meth:`vmm.VirtualAllocator.trim` unmaps
the idle chunks and frees the empty ranges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vmm.pool import Chunk

if TYPE_CHECKING:
    from vmm.free_ranges import FreeRanges


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
    """The sparse ranges of one :class:`vmm.VirtualAllocator` (see the module docstring):
    ``_spare``: ranges with no block, by capacity; ``_live``: those held, by id; ``_idle``:
    ranges with idle chunks, oldest first."""

    def __init__(self, allocator: Any, free_ranges: FreeRanges) -> None:
        self._va = allocator          # the vmm.VirtualAllocator: counters, budget error
        self._free = free_ranges      # address space, and the quarantine flushed before a map
        self._pool = allocator.pool
        self._backend = allocator.backend
        self._chunk = allocator.chunk_bytes
        self._spare: dict[int, list[SparseRange]] = {}
        self._live: dict[int, SparseRange] = {}
        self._idle: dict[int, SparseRange] = {}

    def take(self, capacity: int) -> SparseRange:
        """:meth:`vmm.VirtualAllocator.sparse_range`: the range of ``capacity`` chunks given
        back last, else a new reservation."""
        spare = self._spare.get(capacity)
        if spare:
            rng = spare.pop()
        else:
            rng = SparseRange(self._va, self._free.reserve(capacity), capacity)
        rng.live = True
        self._live[id(rng)] = rng
        return rng

    def give_back(self, rng: SparseRange) -> None:
        """:meth:`vmm.VirtualAllocator.release_sparse` (no block left on ``rng``)."""
        assert rng.live and rng.idle == rng.mapped, "a sparse range goes back with no block"
        rng.live = False
        del self._live[id(rng)]
        self._spare.setdefault(rng.capacity, []).append(rng)

    def touch(self, rng: SparseRange, first: int, last: int, nbytes: int) -> int:
        """:meth:`vmm.VirtualAllocator.touch`: a new block over positions ``first..last``."""
        va = self._va
        touch, chunks = rng.touch, rng.chunks
        need = revive = 0
        for j in range(first, last + 1):
            if not touch[j]:
                if chunks[j] is None:
                    need += 1
                else:
                    revive += 1
        if need > self._pool.available + va.parked_chunks + va.idle_chunks - revive:
            va.ooms += 1
            raise va._oom(nbytes, need)
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
            va.live_chunks += used
            total = va.mapped_bytes = va.mapped_bytes + used * self._chunk
            if total > va.peak_mapped_bytes:
                va.peak_mapped_bytes = total
                va.peak_chunks_in_use = va.live_chunks
        return used

    def untouch(self, rng: SparseRange, first: int, last: int) -> int:
        """:meth:`vmm.VirtualAllocator.untouch`: a block over ``first..last`` is gone."""
        touch = rng.touch
        drop = 0
        for j in range(first, last + 1):
            t = touch[j] = touch[j] - 1
            if not t:
                drop += 1
        if drop:
            va = self._va
            rng.fence = self._backend.fence()   # work queued before now may still use them
            self._set_idle(rng, rng.idle + drop)
            va.live_chunks -= drop
            va.mapped_bytes -= drop * self._chunk
        return drop

    def _map_missing(self, rng: SparseRange, first: int, last: int, need: int) -> None:
        """Map ``need`` chunks at the positions of ``first..last`` with none, one backend call
        per run of such positions; chunks gathered but not mapped go back to the pool."""
        self._free.flush_quarantine()
        va = self._va
        backend = self._backend
        chunks = rng.chunks
        chunk = self._chunk
        got = self._free.gather(need)
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
                backend.map_many(start, [c.handle for c in run], chunk)
                chunks[j:end] = run
                rng.mapped += end - j
                va.map_calls += end - j
                backend.set_access(start, (end - j) * chunk)
                j = end
        finally:
            self._pool.release(got)

    def _set_idle(self, rng: SparseRange, idle: int) -> None:
        self._va.idle_chunks += idle - rng.idle
        rng.idle = idle
        if idle:
            self._idle.setdefault(id(rng), rng)
        else:
            self._idle.pop(id(rng), None)

    def steal(self, count: int) -> list[Chunk]:
        """Unmap up to ``count`` idle chunks of sparse ranges (those idle longest first) and
        return them (still handed out by the pool)."""
        chunk = self._chunk
        backend = self._backend
        out: list[Chunk] = []
        while count and self._idle:
            rng = next(iter(self._idle.values()))
            take = [j for j in range(rng.capacity)
                    if rng.chunks[j] is not None and not rng.touch[j]][:count]
            i = 0
            while i < len(take):     # one unmap per run of positions
                j = end = take[i]
                while i < len(take) and take[i] == end:
                    i += 1
                    end += 1
                backend.unmap(rng.address + j * chunk, (end - j) * chunk, fence=rng.fence)
                out.extend(rng.chunks[j:end])   # type: ignore[arg-type]
                rng.chunks[j:end] = [None] * (end - j)
            self._va.unmap_calls += len(take)
            rng.mapped -= len(take)
            self._set_idle(rng, rng.idle - len(take))
            count -= len(take)
        return out

    def trim(self) -> None:
        """Free the address space of every sparse range with no block (their idle chunks
        were stolen before)."""
        for spare in self._spare.values():
            for rng in spare:
                assert not rng.mapped
                self._free.unreserve(rng.address, rng.capacity)
        self._spare.clear()

    def chunks_in_use(self) -> int:
        """Chunks under live blocks in the live sparse ranges (a packing check's sum)."""
        return sum(r.mapped - r.idle for r in self._live.values())

    def check(self) -> tuple[int, int]:
        """Verify the sparse ranges' invariants; return their idle chunks and reserved bytes."""
        ranges = [*self._live.values(), *(r for s in self._spare.values() for r in s)]
        for rng in ranges:
            assert rng.live == (id(rng) in self._live)
            assert rng.mapped == sum(c is not None for c in rng.chunks)
            assert all(c is not None for c, t in zip(rng.chunks, rng.touch) if t)
            assert rng.idle == sum(c is not None and not t for c, t in zip(rng.chunks, rng.touch))
            assert (id(rng) in self._idle) == (rng.idle > 0)
            assert rng.live or not any(rng.touch)
        assert len(self._idle) == sum(r.idle > 0 for r in ranges)
        return sum(r.idle for r in ranges), sum(r.capacity for r in ranges) * self._chunk
