"""The reserved ranges no allocation holds ("free ranges"), and how a request is placed on
them: taken back whole, shrunk, grown in place or stolen from.

The policy is steps 1-4 of :class:`vmm.VirtualAllocator`'s docstring. :class:`FreeRanges` is
the part of the allocator that owns the free-range indexes (parked ranges by mapped count and
by park time, free ranges by capacity), the quarantine of ranges the device may still use and
the address space of every range (sparse ones too), so that the reuse policy reads on its own.
The allocator asks it for a range (:meth:`~FreeRanges.take_exact` on the hot path of
``alloc``, :meth:`~FreeRanges.place` otherwise) and gives it every freed range
(:meth:`~FreeRanges.add`); :meth:`~FreeRanges.gather` finds the chunks a request lacks: in the
pool, in parked ranges, then idle (:mod:`vmm.range_heads`). The counters it bumps are the
allocator's plain attributes, what ``stats()`` reports and a replay reads per event.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Any

from vmm.errors import OutOfBudget
from vmm.pool import Chunk


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


class FreeRanges:
    """The free ranges of one :class:`vmm.VirtualAllocator` (see the module docstring), and
    the registry of its whole ranges, live or free (``check`` and ``trim`` walk it).

    Indexes: ``_parked``: mapped count m > 0 -> {rid: range}, ordered by park time;
    ``_parked_sizes``: the sorted keys of ``_parked``; ``_lru``: every parked range by park
    time; ``_by_capacity``: capacity -> {rid: range} for every free range (parked or empty);
    ``_quarantine``: (range, chunks still mapped there, fence) for ranges whose chunks were
    stolen while the device may still use their addresses, unmapped once the fence passed."""

    def __init__(self, allocator: Any) -> None:
        # The vmm.VirtualAllocator (not imported: it imports this): its counters, its budget
        # error and its ``lean``.
        self._va = allocator
        self._pool = allocator.pool
        self._backend = allocator.backend
        self._chunk = allocator.chunk_bytes
        self._parked: dict[int, dict[int, _Range]] = {}
        self._parked_sizes: list[int] = []
        self._lru: dict[int, _Range] = {}
        self._by_capacity: dict[int, dict[int, _Range]] = {}
        self._quarantine: list[tuple[_Range, int, Any]] = []
        self._ranges: dict[int, _Range] = {}
        self._next_rid = 0
        # The vmm.range_heads.IdleHeads :meth:`gather` turns to after the parked ranges (they
        # pass on to the sparse ranges what they lack); set by the allocator once made, since
        # the sparse ranges they hold gather through this part.
        self.idle: Any = None

    @property
    def quarantined(self) -> int:
        """Ranges whose unmap still waits for their fence (``stats()``)."""
        return len(self._quarantine)

    def reserve(self, capacity: int) -> int:
        """Reserve address space for ``capacity`` chunks (a driver call on CUDA), counted in
        ``reserved_bytes``; its address. Whole ranges and sparse ones alike."""
        va = self._va
        address = self._backend.reserve_range(capacity * self._chunk)
        va.reserve_calls += 1
        va.reserved_bytes += capacity * self._chunk
        if va.reserved_bytes > va.peak_reserved_bytes:
            va.peak_reserved_bytes = va.reserved_bytes
        return address

    def unreserve(self, address: int, capacity: int) -> None:
        """Free address space :meth:`reserve` gave (nothing mapped in it any more)."""
        self._backend.free_range(address, capacity * self._chunk)
        self._va.free_range_calls += 1
        self._va.reserved_bytes -= capacity * self._chunk

    def take_exact(self, k: int) -> _Range | None:
        """Step 1 (the hot path of a repeating schedule): the most recently parked range with
        exactly ``k`` chunks mapped, out of the indexes with no backend call; else None."""
        bucket = self._parked.get(k)
        if not bucket:
            return None
        rid, rng = bucket.popitem()
        if not bucket:
            del self._parked[k]
            del self._parked_sizes[bisect_left(self._parked_sizes, k)]
        del self._lru[rid]
        by_cap = self._by_capacity[rng.capacity]
        del by_cap[rid]
        if not by_cap:
            del self._by_capacity[rng.capacity]
        va = self._va
        va.parked_chunks -= k
        va.reuse_exact += 1
        return rng

    def add(self, rng: _Range) -> None:
        """A range no allocation holds: parked (newest) if chunks are still mapped in it,
        and free for reuse by its capacity either way. Inline: ``free`` calls it per event."""
        rid = rng.rid
        m = len(rng.chunks)
        if m:
            bucket = self._parked.get(m)
            if bucket is None:
                self._parked[m] = {rid: rng}
                insort(self._parked_sizes, m)
            else:
                bucket[rid] = rng
            self._lru[rid] = rng
            self._va.parked_chunks += m
        by_cap = self._by_capacity.get(rng.capacity)
        if by_cap is None:
            self._by_capacity[rng.capacity] = {rid: rng}
        else:
            by_cap[rid] = rng

    def place(self, k: int, nbytes: int) -> _Range:
        """Steps 2-4 of the allocator's class doc: find or make a range holding k mapped
        chunks (``nbytes``: the request, for the budget error)."""
        self.flush_quarantine()
        va = self._va
        chunk = self._chunk
        sizes = self._parked_sizes
        # 2. shrink the smallest larger parked range, if that costs fewer calls than k maps
        # and the chunks would otherwise have to be stolen from parked ranges anyway.
        # Not while the device may still use the range (its fence has not passed): the
        # unmap would make the host wait; steps 3-4 steal without waiting instead.
        i = bisect_right(sizes, k)
        if (i < len(sizes) and sizes[i] < 2 * k
                and (self._pool.cached if va.lean else self._pool.available) < k):
            rng = next(reversed(self._parked[sizes[i]].values()))
            if rng.fence is None or self._backend.fence_passed(rng.fence):
                self._detach_parked(rng)
                self._remove_free(rng)
                self.unmap_tail(rng, k)
                va.reuse_shrink += 1
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
        pool = self._pool
        if need > pool.available + va.parked_chunks + va.idle_chunks:
            if target is not None:
                self.add(target)
            va.ooms += 1
            raise va._oom(nbytes, k)
        got: list[Chunk] = []
        try:
            got = self.gather(need)
            if target is None:
                target = _Range(self.reserve(k), k, self._next_rid)
                self._next_rid += 1
                self._ranges[target.rid] = target
                va.new_ranges += 1
            elif have:
                va.reuse_grow += 1
            else:
                va.reuse_range += 1
            start = target.address + have * chunk
            self._backend.map_many(start, [c.handle for c in got], chunk)
            target.chunks.extend(got)
            va.map_calls += need
            got = []
            self._backend.set_access(start, need * chunk)
        except BaseException:
            # A backend failure (device out of memory, a driver error): every chunk taken
            # goes back to the pool unmapped, the range back to the free ranges.
            pool.release(got)
            if target is not None:
                if target.chunks:
                    self.unmap_tail(target, 0)
                self.add(target)
            raise
        return target

    def gather(self, need: int) -> list[Chunk]:
        """``need`` unmapped chunks for a request (the caller checked that ``need`` is at most
        ``pool.available + parked_chunks + idle_chunks``); on failure every chunk taken goes
        back to the pool. A whole range's chunks (:meth:`place`) and a sparse range's alike.

        Where they come from: the pool's cache first (free, unmapped); then, by default, new
        chunks up to the budget before parked ones (parked ranges survive for exact reuse as
        long as the budget allows), or with ``lean``, parked ones before new ones (physical
        memory grows only when every chunk is under a live allocation)."""
        va = self._va
        pool = self._pool
        got: list[Chunk] = []
        try:
            take = min(need, pool.cached)
            if take:
                got = pool.acquire(take)
            rest = need - take
            if rest and not va.lean:
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
                        if rest > va.parked_chunks + va.idle_chunks:
                            raise
            if rest:
                # Parked ranges first (least recently parked), then idle heads (a range whose
                # tail still lives: its chunks come back whole when the tail goes), then the
                # idle chunks of sparse ranges.
                steal = min(rest, va.parked_chunks)
                if steal:
                    got.extend(self.steal(steal))
                    rest -= steal
                steal = min(rest, va.idle_chunks)
                if steal:
                    got.extend(self.idle.steal(steal))
                    rest -= steal
                if rest:
                    got.extend(pool.acquire(rest))
        except BaseException:
            pool.release(got)
            raise
        return got

    def trim_some(self, count: int) -> int:
        """``trim(limit)``: give back ``count`` unused chunks, cached, parked, then idle ones
        (the quarantine was flushed before); return the bytes released."""
        pool, chunk, va = self._pool, self._chunk, self._va
        from_cache = min(count, pool.cached)
        freed = pool.trim(from_cache * chunk)
        stolen = min(count - from_cache, va.parked_chunks)
        if stolen:
            pool.release(self.steal(stolen, defer=False))   # released: truly unmapped
            freed += pool.trim(stolen * chunk)
        idle = min(count - from_cache - stolen, va.idle_chunks)
        if idle:
            pool.release(self.idle.steal(idle))
            freed += pool.trim(idle * chunk)
        return freed

    def steal(self, count: int, *, defer: bool = True) -> list[Chunk]:
        """Take ``count`` chunks from parked ranges, least recently parked first (``defer``:
        chunks may stay mapped at their old address for a while, see below)."""
        chunk = self._chunk
        out: list[Chunk] = []
        with self._backend.one_synchronization():   # one device wait for every range below
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
        (:meth:`flush_quarantine`). Safe because the chunks' new users are ordered after
        the old ones on the device: kernels on the same stream, copies ordered after it."""
        va = self._va
        rng = next(iter(self._lru.values()))
        m = len(rng.chunks)
        take = min(count, m)
        keep = m - take
        self._detach_parked(rng)
        if defer and rng.fence is not None and not self._backend.fence_passed(rng.fence):
            out.extend(rng.chunks[keep:])
            if keep:
                self._pool.release(rng.chunks[:keep])   # free for any range, as parked ones are
            rng.chunks.clear()
            self._remove_free(rng)
            self._quarantine.append((rng, m, rng.fence))
            va.deferred_unmaps += 1
            va.steals += 1
            return count - take
        self._backend.unmap(rng.address + keep * chunk, take * chunk, fence=rng.fence)
        va.unmap_calls += take
        out.extend(rng.chunks[keep:])
        del rng.chunks[keep:]
        if keep:
            self._park(rng)
        va.steals += 1
        return count - take

    def flush_quarantine(self, *, force: bool = False) -> None:
        """Unmap the quarantined ranges whose fence has passed (all of them with ``force``:
        the device is synchronized once) and make them free, empty ranges again."""
        if not self._quarantine:
            return
        chunk = self._chunk
        backend = self._backend
        waiting = []
        with backend.one_synchronization():
            for rng, m, fence in self._quarantine:
                if force or backend.fence_passed(fence):
                    backend.unmap(rng.address, m * chunk, fence=fence)
                    self._va.unmap_calls += m
                    self._by_capacity.setdefault(rng.capacity, {})[rng.rid] = rng
                else:
                    waiting.append((rng, m, fence))
        self._quarantine = waiting

    def unmap_tail(self, rng: _Range, keep: int) -> None:
        """Unmap the range's chunks past the first ``keep`` and return them to the pool."""
        drop = len(rng.chunks) - keep
        if drop > 0:
            self._backend.unmap(rng.address + keep * self._chunk, drop * self._chunk,
                                fence=rng.fence)
            self._va.unmap_calls += drop
            self._pool.release(rng.chunks[keep:])
            del rng.chunks[keep:]

    def release_all(self) -> None:
        """``trim``: unmap every parked range (chunks back to the pool) and free the address
        space of every free range (the quarantine was flushed before)."""
        for rng in list(self._lru.values()):
            self._detach_parked(rng)
            self.unmap_tail(rng, 0)
        for by_cap in self._by_capacity.values():
            for rng in by_cap.values():
                self.unreserve(rng.address, rng.capacity)
                del self._ranges[rng.rid]
        self._by_capacity.clear()

    def check(self) -> tuple[int, int]:
        """Verify the indexes' invariants (for tests); return the chunks of the parked ranges
        and the reserved bytes of every whole range, for the allocator to check its counters."""
        for m, bucket in self._parked.items():
            assert bucket and m in self._parked_sizes
            for r in bucket.values():
                assert len(r.chunks) == m and r.rid in self._lru
        assert sorted(self._parked) == self._parked_sizes
        for cap, bucket in self._by_capacity.items():
            for r in bucket.values():
                assert r.capacity == cap and len(r.chunks) <= cap
        return (sum(len(r.chunks) for r in self._lru.values()),
                sum(r.capacity for r in self._ranges.values()) * self._chunk)

    def _park(self, rng: _Range) -> None:
        m = len(rng.chunks)
        bucket = self._parked.get(m)
        if bucket is None:
            self._parked[m] = {rng.rid: rng}
            insort(self._parked_sizes, m)
        else:
            bucket[rng.rid] = rng
        self._lru[rng.rid] = rng
        self._va.parked_chunks += m

    def _detach_parked(self, rng: _Range) -> None:
        m = len(rng.chunks)
        bucket = self._parked[m]
        del bucket[rng.rid]
        if not bucket:
            del self._parked[m]
            del self._parked_sizes[bisect_left(self._parked_sizes, m)]
        del self._lru[rng.rid]
        self._va.parked_chunks -= m

    def _remove_free(self, rng: _Range) -> None:
        by_cap = self._by_capacity[rng.capacity]
        del by_cap[rng.rid]
        if not by_cap:
            del self._by_capacity[rng.capacity]


_EMPTY = _Range(0, 0, -1)  # the range of every zero-byte allocation (never mapped)
