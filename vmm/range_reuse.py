"""Where :class:`vmm.VirtualAllocator` finds the chunks for a request: reserved ranges kept
after ``free`` ("parked"), taken back whole, shrunk, grown in place or stolen from.

The policy is steps 1-4 of :class:`vmm.VirtualAllocator`'s docstring; this module holds the
free-range indexes (parked ranges by mapped count and by park time, free ranges by capacity)
and steps 2-4 with stealing and the quarantine of ranges the device may still use. Kept apart
from :mod:`vmm.virtual` (the public API and the byte accounting) so that the reuse policy
reads on its own. :class:`RangeReuse` is a mixin of the allocator, not an object of its own:
the hot path (exact reuse in ``alloc``, parking in ``free``) updates the same indexes inline,
and the counters it bumps are the allocator's ``stats()``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Any

from vmm.errors import OutOfBudget
from vmm.pool import Chunk, ChunkPool


class _Range:
    """One reserved virtual range: ``capacity`` chunks of address space, the first
    ``len(chunks)`` of them mapped (the chunks in mapping order)."""

    __slots__ = ("address", "capacity", "chunks", "rid", "fence", "head", "idle")

    def __init__(self, address: int, capacity: int, rid: int) -> None:
        self.address = address
        self.capacity = capacity
        self.chunks: list[Chunk] = []
        self.rid = rid
        # Live ranges only (vmm.range_heads): the first ``idle`` mapped chunks serve no
        # block (an idle head), and ``head`` chunks at the front were taken from it (the
        # mapped ones then start at address + head x chunk, not at address); 0 otherwise.
        self.head = 0
        self.idle = 0
        # Parked: the backend's mark of the moment it was freed (``Backend.fence``): work
        # queued before it may still use the chunks; an unmap that finds it passed need not
        # wait for the device. None while in use (or if the backend keeps no fences).
        self.fence: Any = None


class RangeReuse:
    """The range-placement half of :class:`vmm.VirtualAllocator` (see the module docstring).
    Its state (``_parked``, ``_parked_sizes``, ``_lru``, ``_by_capacity``, ``_quarantine``,
    ``_ranges`` and the counters) is created by the allocator's constructor; :meth:`check`
    verifies the invariants that tie those indexes to the pool's chunk counts."""

    pool: ChunkPool
    live_chunks: int
    reserved_bytes: int
    peak_reserved_bytes: int
    reserve_calls: int
    free_range_calls: int
    backend: Any
    chunk_bytes: int
    lean: bool
    parked_chunks: int
    idle_chunks: int
    _parked: dict[int, dict[int, _Range]]
    _parked_sizes: list[int]
    _lru: dict[int, _Range]
    _by_capacity: dict[int, dict[int, _Range]]
    _quarantine: list[tuple[_Range, int, Any]]
    _ranges: dict[int, _Range]

    def _reserve(self, capacity: int) -> int:
        """Reserve address space for ``capacity`` chunks (a driver call on CUDA), counted in
        ``reserved_bytes``; its address. Whole ranges and sparse ones (vmm.sparse_ranges) alike."""
        address = self.backend.reserve_range(capacity * self.chunk_bytes)
        self.reserve_calls += 1
        self.reserved_bytes += capacity * self.chunk_bytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        return address

    def _unreserve(self, address: int, capacity: int) -> None:
        """Free address space ``_reserve`` gave (nothing mapped in it any more)."""
        self.backend.free_range(address, capacity * self.chunk_bytes)
        self.free_range_calls += 1
        self.reserved_bytes -= capacity * self.chunk_bytes

    def check(self) -> None:
        """Verify the internal invariants (for tests); raises AssertionError if broken."""
        pool = self.pool
        live = self.live_chunks
        parked = sum(len(r.chunks) for r in self._lru.values())
        assert parked == self.parked_chunks, (parked, self.parked_chunks)
        self._check_idle()
        idle = self.idle_chunks
        assert pool.handed_out == live + parked + idle, (pool.handed_out, live, parked, idle)
        assert pool.created == pool.handed_out + pool.cached
        assert pool.created <= pool.max_chunks
        assert self.reserved_bytes == (sum(r.capacity for r in self._ranges.values())
                                       * self.chunk_bytes + self._check_sparse()[1])
        for m, bucket in self._parked.items():
            assert bucket and m in self._parked_sizes
            for r in bucket.values():
                assert len(r.chunks) == m and r.rid in self._lru
        assert sorted(self._parked) == self._parked_sizes
        for cap, bucket in self._by_capacity.items():
            for r in bucket.values():
                assert r.capacity == cap and len(r.chunks) <= cap

    def _place(self, k: int, nbytes: int) -> _Range:
        """Steps 2-4 of the class doc: find or make a range holding k mapped chunks."""
        self._flush_quarantine()
        chunk = self.chunk_bytes
        sizes = self._parked_sizes
        # 2. shrink the smallest larger parked range, if that costs fewer calls than k maps
        # and the chunks would otherwise have to be stolen from parked ranges anyway.
        # Not while the device may still use the range (its fence has not passed): the
        # unmap would make the host wait; steps 3-4 steal without waiting instead.
        i = bisect_right(sizes, k)
        if (i < len(sizes) and sizes[i] < 2 * k
                and (self.pool.cached if self.lean else self.pool.available) < k):
            rng = next(reversed(self._parked[sizes[i]].values()))
            if rng.fence is None or self.backend.fence_passed(rng.fence):
                self._detach_parked(rng)
                self._remove_free(rng)
                self._unmap_tail(rng, k)
                self.reuse_shrink += 1
                return rng
        # 3. grow a range of capacity k in place (it holds fewer than k chunks).
        target = None
        have = 0
        by_cap = self._by_capacity.get(k)
        if by_cap:
            target = next(reversed(by_cap.values()))
            have = len(target.chunks)
            if have:
                self._detach_parked(target)
            self._remove_free(target)
        need = k - have
        pool = self.pool
        if need > pool.available + self.parked_chunks + self.idle_chunks:
            if target is not None:
                self._restore_free(target)
            self.ooms += 1
            raise self._oom(nbytes, k)
        got: list[Chunk] = []
        try:
            got = self._gather(need)
            if target is None:
                target = _Range(self._reserve(k), k, self._next_rid)
                self._next_rid += 1
                self._ranges[target.rid] = target
                self.new_ranges += 1
            elif have:
                self.reuse_grow += 1
            else:
                self.reuse_range += 1
            start = target.address + have * chunk
            self.backend.map_many(start, [c.handle for c in got], chunk)
            target.chunks.extend(got)
            self.map_calls += need
            got = []
            self.backend.set_access(start, need * chunk)
        except BaseException:
            # A backend failure (device out of memory, a driver error): every chunk taken
            # goes back to the pool unmapped, the range back to the free ranges.
            pool.release(got)
            if target is not None:
                if target.chunks:
                    self._unmap_tail(target, 0)
                self._restore_free(target)
            raise
        return target

    def _gather(self, need: int) -> list[Chunk]:
        """``need`` unmapped chunks for a request (the caller checked that ``need`` is at most
        ``pool.available + parked_chunks + idle_chunks``); on failure every chunk taken goes
        back to the pool.

        Where they come from: the pool's cache first (free, unmapped); then, by default, new
        chunks up to the budget before parked ones (parked ranges survive for exact reuse as
        long as the budget allows), or with ``lean``, parked ones before new ones (physical
        memory grows only when every chunk is under a live allocation)."""
        pool = self.pool
        got: list[Chunk] = []
        try:
            take = min(need, pool.cached)
            if take:
                got = pool.acquire(take)
            rest = need - take
            if rest and not self.lean:
                create = min(rest, pool.max_chunks - pool.created)
                if create:
                    try:
                        got.extend(pool.acquire(create))
                        rest -= create
                    except OutOfBudget:
                        # The device is full before the budget is: use what was created,
                        # then parked chunks (a request that fits must not fail for this).
                        extra = min(rest, pool.cached)
                        if extra:
                            got.extend(pool.acquire(extra))
                            rest -= extra
                        if rest > self.parked_chunks + self.idle_chunks:
                            raise
            if rest:
                # Parked ranges first (least recently parked), then idle heads (a range whose
                # tail still lives: its chunks come back whole when the tail goes).
                steal = min(rest, self.parked_chunks)
                if steal:
                    got.extend(self._steal(steal))
                    rest -= steal
                steal = min(rest, self.idle_chunks)
                if steal:
                    got.extend(self._steal_idle(steal))
                    rest -= steal
                if rest:
                    got.extend(pool.acquire(rest))
        except BaseException:
            pool.release(got)
            raise
        return got

    def _trim_some(self, count: int) -> int:
        from_cache = min(count, self.pool.cached)
        freed = self.pool.trim(from_cache * self.chunk_bytes)
        stolen = min(count - from_cache, self.parked_chunks)
        if stolen:
            self.pool.release(self._steal(stolen, defer=False))   # released: truly unmapped
            freed += self.pool.trim(stolen * self.chunk_bytes)
        idle = min(count - from_cache - stolen, self.idle_chunks)
        if idle:
            self.pool.release(self._steal_idle(idle))
            freed += self.pool.trim(idle * self.chunk_bytes)
        return freed

    def _steal(self, count: int, *, defer: bool = True) -> list[Chunk]:
        """Take ``count`` chunks from parked ranges, least recently parked first (``defer``:
        chunks may stay mapped at their old address for a while, see below)."""
        chunk = self.chunk_bytes
        out: list[Chunk] = []
        with self.backend.one_synchronization():   # one device wait for every range below
            while count:
                count = self._steal_from_oldest(count, out, chunk, defer)
        return out

    def _steal_from_oldest(self, count: int, out: list[Chunk], chunk: int, defer: bool) -> int:
        """Move up to ``count`` chunks off the tail of the least recently parked range into
        ``out``; return how many are still wanted.

        If the range's fence has not passed (kernels queued before it was let go may still
        use its addresses), nothing is unmapped now, which would need the host to wait for
        the device: the chunks move on while still mapped there too (the driver allows a
        chunk at two addresses), and the range waits in quarantine until its fence passes
        (:meth:`_flush_quarantine`). Safe because the chunks' new users are ordered after
        the old ones on the device: kernels on the same stream, copies ordered after it."""
        rng = next(iter(self._lru.values()))
        m = len(rng.chunks)
        take = min(count, m)
        keep = m - take
        self._detach_parked(rng)
        if defer and rng.fence is not None and not self.backend.fence_passed(rng.fence):
            out.extend(rng.chunks[keep:])
            if keep:
                self.pool.release(rng.chunks[:keep])   # free for any range, as parked ones are
            rng.chunks.clear()
            self._remove_free(rng)
            self._quarantine.append((rng, m, rng.fence))
            self.deferred_unmaps += 1
            self.steals += 1
            return count - take
        self.backend.unmap(rng.address + keep * chunk, take * chunk, fence=rng.fence)
        self.unmap_calls += take
        out.extend(rng.chunks[keep:])
        del rng.chunks[keep:]
        if keep:
            self._park(rng)
        self.steals += 1
        return count - take

    def _flush_quarantine(self, *, force: bool = False) -> None:
        """Unmap the quarantined ranges whose fence has passed (all of them with ``force``:
        the device is synchronized once) and make them free, empty ranges again."""
        if not self._quarantine:
            return
        chunk = self.chunk_bytes
        waiting = []
        with self.backend.one_synchronization():
            for rng, m, fence in self._quarantine:
                if force or self.backend.fence_passed(fence):
                    self.backend.unmap(rng.address, m * chunk, fence=fence)
                    self.unmap_calls += m
                    self._by_capacity.setdefault(rng.capacity, {})[rng.rid] = rng
                else:
                    waiting.append((rng, m, fence))
        self._quarantine = waiting

    def _unmap_tail(self, rng: _Range, keep: int) -> None:
        """Unmap the range's chunks past the first ``keep`` and return them to the pool."""
        drop = len(rng.chunks) - keep
        if drop > 0:
            self.backend.unmap(rng.address + keep * self.chunk_bytes, drop * self.chunk_bytes,
                               fence=rng.fence)
            self.unmap_calls += drop
            self.pool.release(rng.chunks[keep:])
            del rng.chunks[keep:]

    def _park(self, rng: _Range) -> None:
        m = len(rng.chunks)
        bucket = self._parked.get(m)
        if bucket is None:
            self._parked[m] = {rng.rid: rng}
            insort(self._parked_sizes, m)
        else:
            bucket[rng.rid] = rng
        self._lru[rng.rid] = rng
        self.parked_chunks += m

    def _detach_parked(self, rng: _Range) -> None:
        m = len(rng.chunks)
        bucket = self._parked[m]
        del bucket[rng.rid]
        if not bucket:
            del self._parked[m]
            del self._parked_sizes[bisect_left(self._parked_sizes, m)]
        del self._lru[rng.rid]
        self.parked_chunks -= m

    def _remove_free(self, rng: _Range) -> None:
        by_cap = self._by_capacity[rng.capacity]
        del by_cap[rng.rid]
        if not by_cap:
            del self._by_capacity[rng.capacity]

    def _restore_free(self, rng: _Range) -> None:
        if rng.chunks:
            self._park(rng)
        self._by_capacity.setdefault(rng.capacity, {})[rng.rid] = rng


_EMPTY = _Range(0, 0, -1)  # the range of every zero-byte allocation (never mapped)
