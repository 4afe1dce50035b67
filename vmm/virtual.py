"""Contiguous virtual ranges over interchangeable physical chunks: no external fragmentation.

A request of m bytes gets k = ceil(m / chunk) chunks from the :class:`vmm.ChunkPool`, in
whatever order they come, mapped back to back onto one reserved virtual range, so the
caller sees contiguous memory while the device pool only ever deals in whole chunks. The
waste is inside the last chunk of each allocation: less than one chunk per allocation,
less than N_max x chunk in total (N_max = allocations live at once), never holes between
allocations (Hayakawa & Narihira, "Out-of-core training ... adaptive window-based
scheduling", the virtual-addressing half).

This module is the allocator's public API and its byte accounting. The allocator is composed
of parts, each owning its state and changing it through its own methods: the free ranges and
how a request is placed on them (reuse of parked ranges, stealing, quarantine:
:class:`~vmm.free_ranges.FreeRanges`), the idle heads of live ranges
(:class:`~vmm.range_heads.IdleHeads`) and the sparse ranges
(:class:`~vmm.sparse_ranges.SparseRanges`). What a caller holds (:class:`Allocation`, its
buffers and misuse errors) is :mod:`vmm.allocation`.
"""

from __future__ import annotations

from vmm.allocation import Allocation, AllocationError, BufferInUse
from vmm.backend import Backend
from vmm.free_ranges import _EMPTY, FreeRanges
from vmm.pool import BudgetExceeded, ChunkPool
from vmm.range_heads import IdleHeads
from vmm.sparse_ranges import SparseRange, SparseRanges
from vmm.units import format_size

__all__ = ["VirtualAllocator", "Allocation", "AllocationError", "BufferInUse"]


class VirtualAllocator:
    """Allocations of any size as contiguous virtual ranges of whole pooled chunks.

    ``alloc(nbytes)`` maps k = ceil(nbytes / chunk) chunks onto one reserved range and
    returns an :class:`Allocation`; ``free(allocation)`` gives them back. The physical
    budget is the pool's: when its chunks run out, :class:`vmm.pool.BudgetExceeded`
    (an :class:`vmm.OutOfBudget`) says the requested bytes, the bytes in use, the budget
    and the largest request that would fit. Since chunks are interchangeable, a request
    fails only if fewer than k chunks are left in the whole budget: never because of
    holes (no external fragmentation).

    Range reuse (what happens to a freed range), chosen so that the steady state of a
    swap schedule (the same sizes freed and allocated again every step) costs no map or
    unmap call at all, while the budget stays exact:

    - ``free`` keeps the range reserved **and mapped** ("parked") when ``keep_mapped``
      (default). Parked chunks are not in use: they count as cached, exactly like chunks
      in the pool's free list, and any request may take them back (below), so parking
      never makes a request fail that would have fit. With ``keep_mapped=False`` the
      chunks are unmapped and returned to the pool at once (the paper's plain scheme; the
      range stays reserved for reuse): it parks nothing.
    - ``alloc`` of k chunks tries, in order:

      1. **exact reuse**: a parked range with exactly k chunks mapped (most recently
         parked first): no call to the backend;
      2. **shrink a larger one**: the parked range with the fewest mapped chunks m, if
         k < m < 2k (fewer calls than mapping k fresh ones) and the pool cannot supply k
         chunks without stealing anyway: unmap its last m - k chunks;
      3. **grow in place**: a free range reserved for exactly k chunks but holding fewer
         (some were stolen, below): map only the missing ones;
      4. **new range**: reserve k chunks of address space and map k chunks.

      Chunks for steps 3-4 come from the pool (cached, then newly created up to the
      budget); if the pool has too few (or the device itself is full before the budget
      is), they are **stolen** from the parked ranges, least recently parked first, by
      unmapping the tail of the range (a partly stolen range stays parked with fewer
      chunks and can later grow back in place). On a device that works asynchronously
      (CUDA), a range let go so recently that queued kernels may still use its addresses
      is not unmapped (that needs the host to wait for the device): its chunks move on
      while still mapped there, and the range is unmapped once its fence has passed.
      Then from idle heads (:mod:`vmm.range_heads`: free chunks at the front of a live range).

    Why these: the reference implementation (nnabla's virtual caching allocator) reuses an
    exact-size range, grows an adjacent one, or steals chunks from a larger one. Exact
    reuse is what a repeating training step hits, so it is first and free. Shrinking and
    stealing take chunks off the *tail* of a parked range (one unmap per surplus chunk).
    Growth happens only inside a range's own reservation, never into a neighbouring
    range, whose address space may be in use: every range stays one reservation that can
    be freed as a unit, and no address bookkeeping beyond ranges is needed.

    By default the budget is used as a cache: physical bytes grow (lazily) up to it, as a
    caching allocator's do, so most requests of a repeating schedule make no map call.
    ``lean=True`` steals parked chunks *before* creating new ones, so physical bytes never
    exceed the peak of mapped bytes (a host where resident memory is measured), at the
    price of more map/unmap calls.

    Reserved ranges cost no memory. :meth:`trim` unmaps parked chunks, frees unused ranges
    and releases cached chunks to the backend. ``map_calls`` / ``unmap_calls`` count chunk
    mappings made / removed (one per chunk, whatever the backend batches). Zero-byte requests
    get an ``Allocation`` at address 0 with no chunks. Not thread-safe: callers hold one lock
    around ``alloc``/``free``.

    Composed of three parts, each owning its indexes: the free ranges (steps 1-4, stealing,
    quarantine, address space: :class:`~vmm.free_ranges.FreeRanges`), the idle heads
    (:class:`~vmm.range_heads.IdleHeads`) and the sparse ranges
    (:class:`~vmm.sparse_ranges.SparseRanges`). The counters all of them change (mapped
    bytes, chunks in use, calls, ...) stay plain attributes of the allocator, which every part
    holds: a replay reads ``mapped_bytes`` after every event. Parts reach each other only
    through their methods: the chunks a request lacks are gathered by the free ranges
    (:meth:`~vmm.free_ranges.FreeRanges.gather`) from the pool, their parked ranges, then the
    idle heads, which pass on to the sparse ranges what they cannot give.
    """

    def __init__(self, pool: ChunkPool, *, keep_mapped: bool = True, lean: bool = False) -> None:
        self.pool = pool
        self.backend = pool.backend
        self.chunk_bytes = pool.chunk_bytes
        self.alignment = self.backend.granularity
        self.keep_mapped = keep_mapped
        self.lean = lean
        # Whether the backend marks moments in the device's work (CUDA); else a parked
        # range's fence stays None ("unknown"), what ``Backend.fence`` would return: no call
        # per free.
        self._fences = type(self.backend).fence is not Backend.fence
        # Live accounting (plain attributes: replay reads them per event; the parts update
        # the ones they change).
        self.requested_bytes = 0
        self.mapped_bytes = 0      # chunks under live allocations x chunk_bytes
        self.reserved_bytes = 0    # virtual bytes of every reserved range
        self.live_chunks = 0
        self.parked_chunks = 0     # mapped in parked ranges (FreeRanges)
        self.idle_chunks = 0       # idle heads' (IdleHeads) and sparse ranges' (SparseRanges)
        self.live_allocations = 0
        self.peak_requested_bytes = 0
        self.peak_mapped_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_chunks_in_use = 0
        self.peak_live_allocations = 0
        self.map_calls = 0
        self.unmap_calls = 0
        self.reserve_calls = 0
        self.free_range_calls = 0
        self.alloc_count = 0
        self.free_count = 0
        self.reuse_exact = 0
        self.reuse_shrink = 0
        self.reuse_grow = 0
        self.reuse_range = 0
        self.new_ranges = 0
        self.steals = 0
        self.deferred_unmaps = 0
        self.heads_retired = self.heads_reclaimed = 0
        self.ooms = 0
        self._free = FreeRanges(self)
        self._sparse = SparseRanges(self, self._free)
        self._heads = self._free.idle = IdleHeads(self, self._sparse)
        # Bound once: ``alloc`` and ``free`` call them per event of a replay.
        self._take_exact = self._free.take_exact
        self._add_free = self._free.add

    # -- public API --------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Allocation:
        """Map ceil(nbytes / chunk) chunks onto one contiguous range (see the class doc)."""
        chunk = self.chunk_bytes
        if nbytes <= 0:
            if nbytes == 0:
                self.alloc_count += 1
                live = self.live_allocations = self.live_allocations + 1
                if live > self.peak_live_allocations:
                    self.peak_live_allocations = live
                return Allocation(0, 0, 0, _EMPTY, self)
            raise AllocationError(f"alloc of a negative size ({nbytes} bytes)")
        k = (nbytes + chunk - 1) // chunk
        # 1. exact reuse (the hot path of a repeating schedule): no backend call; else 2-4.
        rng = self._take_exact(k)
        if rng is None:
            rng = self._free.place(k, nbytes)
        # Accounting, inline: this runs once per event of a million-event replay.
        mapped = k * chunk
        self.alloc_count += 1
        live = self.live_allocations = self.live_allocations + 1
        if live > self.peak_live_allocations:
            self.peak_live_allocations = live
        requested = self.requested_bytes = self.requested_bytes + nbytes
        self.live_chunks += k
        if requested > self.peak_requested_bytes:
            self.peak_requested_bytes = requested
        total = self.mapped_bytes = self.mapped_bytes + mapped
        if total > self.peak_mapped_bytes:
            self.peak_mapped_bytes = total
            self.peak_chunks_in_use = self.live_chunks
        rng.fence = None
        return Allocation(rng.address, nbytes, mapped, rng, self)

    def free(self, allocation: Allocation) -> None:
        """Give an allocation's chunks back (parked or to the pool, see the class doc).

        Raises :class:`AllocationError` for a double free or an allocation of another
        allocator, :class:`BufferInUse` while a buffer exported from it is referenced.
        """
        rng = allocation._range
        if allocation._owner is not self:
            raise AllocationError(f"free of {allocation!r}, which belongs to another allocator")
        if rng is None:
            raise AllocationError(f"double free of the allocation at 0x{allocation.address:x} "
                                  f"({format_size(allocation.nbytes)})")
        if allocation._exports:
            allocation._drop_exports()
        allocation._range = None
        self.free_count += 1
        self.live_allocations -= 1
        if rng is _EMPTY:
            return
        k = len(rng.chunks)
        used = k - self._heads.forget(rng) if rng.idle else k
        self.requested_bytes -= allocation.nbytes
        self.mapped_bytes -= used * self.chunk_bytes
        self.live_chunks -= used
        if rng.head:
            self._heads.free_headless(rng)       # left empty
        elif self.keep_mapped:
            if self._fences:
                rng.fence = self.backend.fence()
        else:
            self._free.unmap_tail(rng, 0)
        self._add_free(rng)                      # parked if still mapped, free either way

    def largest_fit(self) -> int:
        """Bytes of the largest request that would succeed now (whole chunks)."""
        return (self.pool.max_chunks - self.live_chunks) * self.chunk_bytes

    def trim(self, limit: int | None = None) -> int:
        """Unmap parked chunks, free every unused range, release cached chunks.

        Returns the physical bytes given back to the backend. Live allocations are untouched.
        With ``limit``, give back only enough whole chunks to cover ``limit`` bytes (fewer if
        fewer are unused): the pool's cached chunks first, then those of the least recently
        parked ranges, whose address ranges stay reserved. A caller that must shed some memory
        keeps the rest of its chunks populated for the next allocations.
        """
        self._free.flush_quarantine(force=True)   # no chunk may be released while still mapped
        if limit is not None:
            return self._free.trim_some(-(-max(0, limit) // self.chunk_bytes))
        if self.idle_chunks:
            self.pool.release(self._heads.steal(self.idle_chunks))
        self._free.release_all()
        self._sparse.trim()
        return self.pool.trim()

    def close(self) -> None:
        """Trim everything; refuses while allocations are live (free them first)."""
        if self.live_allocations:
            raise AllocationError(f"close() with {self.live_allocations} live allocation(s) "
                                  f"({format_size(self.requested_bytes)}): free them first")
        self.trim()

    def retire_head(self, allocation: Allocation) -> int:
        """Count every chunk of a live allocation but its last as no longer in use, keeping
        it mapped (an idle head, :mod:`vmm.range_heads`); return those bytes. The last chunk
        stays in use at its address (small blocks live there); ``free`` of the allocation
        later parks the range whole if no request took the idle chunks meanwhile. The
        allocation keeps its ``nbytes``; the allocator's ``mapped_bytes`` and ``live_chunks``
        drop."""
        return self._heads.retire(allocation)

    def sparse_range(self, capacity: int) -> SparseRange:
        """A live sparse range (:mod:`vmm.sparse_ranges`) of ``capacity`` chunks with no block
        on it: the one given back last if there is one (its idle chunks may serve the next
        blocks), else a new reservation (a driver call on CUDA)."""
        return self._sparse.take(capacity)

    def release_sparse(self, rng: SparseRange) -> None:
        """Give back a sparse range with no block left on it (its chunks, if any, idle)."""
        self._sparse.give_back(rng)

    def touch(self, rng: SparseRange, first: int, last: int, nbytes: int) -> int:
        """Count a new block over positions ``first..last`` (inclusive) of a sparse range:
        their chunks are in use from now on (idle ones taken back as they are, missing ones
        mapped); return how many were not in use before. Raises
        :class:`vmm.pool.BudgetExceeded` (changing nothing) when the budget lacks the chunks
        to map."""
        return self._sparse.touch(rng, first, last, nbytes)

    def untouch(self, rng: SparseRange, first: int, last: int) -> int:
        """A block over positions ``first..last`` of a sparse range is gone: the chunks no
        block touches any more go idle (still mapped); return how many."""
        return self._sparse.untouch(rng, first, last)

    def check(self) -> None:
        """Verify the internal invariants (for tests); raises AssertionError if broken."""
        pool = self.pool
        live = self.live_chunks
        parked, reserved = self._free.check()
        assert parked == self.parked_chunks, (parked, self.parked_chunks)
        sparse_idle, sparse_reserved = self._sparse.check()
        idle = self.idle_chunks
        assert idle == self._heads.check() + sparse_idle, idle
        assert pool.handed_out == live + parked + idle, (pool.handed_out, live, parked, idle)
        assert pool.created == pool.handed_out + pool.cached
        assert pool.created <= pool.max_chunks
        assert self.reserved_bytes == reserved + sparse_reserved

    def stats(self) -> dict[str, int]:
        """Memory statistics as a plain dict with stable keys (all sizes in bytes).

        - ``requested_bytes``: bytes asked for by live allocations.
        - ``mapped_bytes``: chunks mapped under live allocations x chunk size.
        - ``reserved_bytes``: virtual address space reserved (live and free ranges).
        - ``physical_bytes``: chunks that exist (in use, parked or cached) x chunk size:
          the memory the device really holds.
        - ``budget_bytes``, ``chunk_bytes``, ``max_chunks``: the pool's limits.
        - ``chunks_in_use``: chunks under live allocations.
        - ``chunks_cached``: chunks that exist but serve no live allocation (pool cache +
          parked + idle); any request can take them.
        - ``chunks_parked`` / ``chunks_idle``: the parts of ``chunks_cached`` still mapped in
          parked ranges / at the front of live ranges (:mod:`vmm.range_heads`, idle heads);
          ``heads_retired`` / ``heads_reclaimed``: heads made idle / parked with their range.
        - ``internal_fragmentation_bytes``: ``mapped_bytes - requested_bytes`` (< one chunk
          per live allocation).
        - ``largest_fit_bytes``: the largest request that would succeed now.
        - ``peak_requested_bytes``, ``peak_mapped_bytes``, ``peak_reserved_bytes``,
          ``peak_physical_bytes``, ``peak_chunks_in_use``, ``peak_allocations``: maxima
          since construction.
        - ``allocations``: live allocations now; ``alloc_count``, ``free_count``: calls so far.
        - ``map_calls``, ``unmap_calls``: chunk mappings made / removed so far.
        - ``reserve_calls``, ``free_range_calls``: address ranges reserved / freed.
        - ``reuse_exact``, ``reuse_shrink``, ``reuse_grow``, ``reuse_range``,
          ``new_ranges``: how each ``alloc`` found its range (steps 1-4 of the class doc;
          ``reuse_range`` is step 3 on a range with no chunk left mapped); ``steals``:
          ranges that lost chunks to another request; ``deferred_unmaps``: steals whose
          unmap waited for the range's fence instead of the device (``quarantined_ranges``:
          those still waiting); ``ooms``: requests refused.
        """
        chunk = self.chunk_bytes
        pool = self.pool
        return {
            "requested_bytes": self.requested_bytes,
            "mapped_bytes": self.mapped_bytes,
            "reserved_bytes": self.reserved_bytes,
            "physical_bytes": pool.created * chunk,
            "budget_bytes": pool.budget_bytes,
            "chunk_bytes": chunk,
            "max_chunks": pool.max_chunks,
            "chunks_in_use": self.live_chunks,
            "chunks_cached": pool.created - self.live_chunks,
            "chunks_parked": self.parked_chunks,
            "chunks_idle": self.idle_chunks,
            "heads_retired": self.heads_retired,
            "heads_reclaimed": self.heads_reclaimed,
            "internal_fragmentation_bytes": self.mapped_bytes - self.requested_bytes,
            "largest_fit_bytes": self.largest_fit(),
            "peak_requested_bytes": self.peak_requested_bytes,
            "peak_mapped_bytes": self.peak_mapped_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_physical_bytes": pool.peak_created * chunk,
            "peak_chunks_in_use": self.peak_chunks_in_use,
            "peak_allocations": self.peak_live_allocations,
            "allocations": self.live_allocations,
            "alloc_count": self.alloc_count,
            "free_count": self.free_count,
            "map_calls": self.map_calls,
            "unmap_calls": self.unmap_calls,
            "reserve_calls": self.reserve_calls,
            "free_range_calls": self.free_range_calls,
            "reuse_exact": self.reuse_exact,
            "reuse_shrink": self.reuse_shrink,
            "reuse_grow": self.reuse_grow,
            "reuse_range": self.reuse_range,
            "new_ranges": self.new_ranges,
            "steals": self.steals,
            "deferred_unmaps": self.deferred_unmaps,
            "quarantined_ranges": self._free.quarantined,
            "ooms": self.ooms,
        }

    def __repr__(self) -> str:
        return (f"<VirtualAllocator {self.live_allocations} live, "
                f"{format_size(self.requested_bytes)} requested, "
                f"{format_size(self.mapped_bytes)} mapped, budget "
                f"{format_size(self.pool.budget_bytes)} in {format_size(self.chunk_bytes)} chunks>")

    # -- internals ---------------------------------------------------------------------
    def _oom(self, nbytes: int, k: int) -> BudgetExceeded:
        """The error for a request of ``k`` chunks the budget cannot hold (the free ranges
        and the sparse ranges raise it: the message is in the allocator's terms)."""
        chunk = self.chunk_bytes
        pool = self.pool
        fit = self.largest_fit()
        return BudgetExceeded(
            f"out of budget: cannot allocate {format_size(nbytes)} ({nbytes} B, {k} chunk(s) "
            f"of {format_size(chunk)}); {format_size(self.requested_bytes)} "
            f"({self.requested_bytes} B) in use by {self.live_allocations} live allocation(s) "
            f"in {self.live_chunks} chunks, of a budget of {format_size(pool.budget_bytes)} "
            f"({pool.budget_bytes} B, {pool.max_chunks} chunks); the largest request that "
            f"fits now is {format_size(fit)} ({fit} B). Free allocations or raise the "
            f"budget to at least {format_size((self.live_chunks + k) * chunk)}.",
            requested=nbytes, in_use=self.requested_bytes, budget=pool.budget_bytes,
            largest_fit=fit)

