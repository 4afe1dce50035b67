"""A model of PyTorch's CUDA caching allocator (best-fit with block splitting), to compare.

This reproduces the default behaviour of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator::malloc`` / ``free``, one stream, no expandable segments):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests of at most 1 MiB (``kSmallSize``) come from the **small pool**, whose segments
  are 2 MiB (``kSmallBuffer``); larger ones from the **large pool**: a request below
  10 MiB (``kMinLargeAlloc``) gets a new 20 MiB segment (``kLargeBuffer``), a larger one a
  segment of its own size rounded up to 2 MiB (``kRoundLarge``);
- the block search is **best fit**: the smallest free block of the pool that is large
  enough, ties broken by the lower address (``BlockComparatorSize``);
- a found block is **split** if the rest is worth keeping: in the small pool if at least
  512 bytes remain, in the large pool if more than 1 MiB remains;
- a freed block **coalesces** with free neighbours of the same segment;
- segments are kept (cached) until :meth:`CachingAllocator.empty_cache`; when a new
  segment cannot be had (the device is full), the allocator frees every cached segment
  that holds no allocated block and retries once, then raises
  :class:`vmm.pool.BudgetExceeded` (an :class:`vmm.OutOfBudget`), like PyTorch's
  "CUDA out of memory. Tried to allocate ...".

``max_split_size`` (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb``) is modelled too: blocks
at least that large are never split and are not handed to smaller requests; so are
``roundup_power2_divisions`` (the rounding, :mod:`vmm.roundup`) and
``garbage_collection_threshold`` (freeing old cached segments under a memory cap,
:mod:`vmm.gc_threshold`). ``expandable_segments`` is another allocator:
:class:`vmm.expandable.ExpandableAllocator`; :mod:`vmm.alloc_conf` builds either from a
``PYTORCH_CUDA_ALLOC_CONF`` line.

Where the pieces are: the size rules both PyTorch models share in :mod:`vmm.block_sizes`, the
segments and how they are had from the backend in :mod:`vmm.caching_segments`; here the block
search, splitting, coalescing, garbage collection and the statistics.

Each segment is one ``cudaMalloc`` in PyTorch; here it is one chunk of the segment's size
mapped onto its own reserved range of the backend (sim for planning at device scale,
host for real bytes), so ``map_calls`` counts segment allocations. Free blocks sit in
sorted lists keyed by (size, address) (bisect: O(log n) search), which makes a replay run
at a few hundred thousand events per second.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from vmm.backend import Backend
from vmm.block_counters import BlockCounters, part_attribute
from vmm.block_sizes import (K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE,
                             K_SMALL_BUFFER, K_SMALL_SIZE, allocation_size, block_size,
                             round_size)
from vmm.caching_segments import Block, Segments
from vmm.errors import CachingAllocatorError
from vmm.gc_threshold import check_threshold, segments_to_release
from vmm.pool import BudgetExceeded
from vmm.roundup import check_divisions
from vmm.units import format_size

__all__ = ["CachingAllocator", "Block", "CachingAllocatorError", "K_MIN_BLOCK_SIZE",
           "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC",
           "K_ROUND_LARGE", "allocation_size", "block_size", "round_size"]

_SHIFT = 64  # free-list key = size << 64 | address: one int compares faster than a tuple


class CachingAllocator:
    """PyTorch's best-fit caching allocator over a backend (see the module docstring).

    Args:
        backend: where segments come from (a :class:`vmm.SimBackend` to model a device).
        capacity_bytes: device memory; getting a segment fails once the segments would
            exceed it. ``None``: unlimited (only the backend's own limit applies).
        max_split_size: PyTorch's ``max_split_size_mb`` in bytes (``None``: unlimited, the
            default there too).
        roundup_divisions: PyTorch's ``roundup_power2_divisions`` (1: off, the default).
        gc_threshold: PyTorch's ``garbage_collection_threshold`` (``None``: off). Like
            PyTorch it acts only under a memory cap: here ``capacity_bytes`` stands for
            ``set_per_process_memory_fraction``; without one it changes nothing.

    ``alloc(nbytes) -> Block`` and ``free(block)`` mirror ``malloc`` / ``free``;
    :meth:`empty_cache` releases every segment with no allocated block.
    """

    def __init__(self, backend: Backend, capacity_bytes: int | None = None, *,
                 max_split_size: int | None = None, roundup_divisions: int = 1,
                 gc_threshold: float | None = None) -> None:
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self.segs = Segments(backend, capacity_bytes)   # the segments and their counters
        self.counts = BlockCounters()                   # the blocks handed out: bytes, peaks
        self.max_split_size = max_split_size if max_split_size is not None else 1 << 62
        self.roundup_divisions = check_divisions(roundup_divisions)
        self.gc_threshold = check_threshold(gc_threshold) if gc_threshold is not None else None
        self._gc = self.gc_threshold is not None and capacity_bytes is not None
        self._gc_searches = 0  # large-pool block searches so far (the clock of block ages)
        self.gc_released = 0   # segments the garbage collection released
        self._free_small: list[int] = []   # keys (size << 64 | address), sorted
        self._free_large: list[int] = []
        self._free_blocks: dict[int, Block] = {}  # address -> free block
        self.active_segments = 0       # segments holding at least one allocated block
        self.num_alloc_retries = 0     # segment requests that needed the retry after empty_cache
        self.ooms = 0

    # The counters the replay reads per event (``ooc.frag``), as every vmm allocator has them.
    requested_bytes = part_attribute("counts.requested_bytes")
    allocated_bytes = part_attribute("counts.allocated_bytes")
    live_allocations = part_attribute("counts.live_allocations")
    mapped_bytes = part_attribute("segs.mapped_bytes", 'Bytes of all reserved segments (PyTorch\'s "reserved").')
    map_calls = part_attribute("segs.map_calls", "Segments allocated so far (``cudaMalloc`` in PyTorch).")
    unmap_calls = part_attribute("segs.unmap_calls", "Segments released so far (``cudaFree``).")

    # -- public API --------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Block:
        """PyTorch's ``malloc``: best-fit search, else a new segment (retry after freeing
        cached segments once), then split. Raises BudgetExceeded when nothing works."""
        if nbytes <= 0:
            if nbytes == 0:  # PyTorch hands out a null pointer and allocates nothing
                block = Block(0, 0, None)
                self.counts.hand_out(block, 0)
                return block
            raise CachingAllocatorError(f"alloc of a negative size ({nbytes} bytes)")
        size = block_size(nbytes, self.roundup_divisions)
        small = size <= K_SMALL_SIZE
        free = self._free_small if small else self._free_large
        gc = self._gc
        if gc and not small:
            self._gc_searches += 1
        block = None
        i = bisect_left(free, size << _SHIFT)
        if i < len(free):
            key = free[i]
            found = key >> _SHIFT
            mss = self.max_split_size
            # "Do not return an oversized block for a large request" (both PyTorch checks).
            if not ((size < mss and found >= mss) or
                    (size >= mss and found >= size + K_LARGE_BUFFER)):
                del free[i]
                block = self._free_blocks.pop(key & _MASK)
        if block is None:
            if gc:
                self._collect_garbage()
            block = self._alloc_block(size, small, nbytes)
        remaining = block.size - size
        if small:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self.max_split_size and remaining > K_SMALL_SIZE
        if split:
            rest = Block(block.address + size, remaining, block.segment, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            rest.gc_base = self._gc_searches
            self._free_blocks[rest.address] = rest
            insort(free, remaining << _SHIFT | rest.address)
        seg = block.segment
        if not seg.active:
            self.active_segments += 1
        seg.active += 1
        self.counts.hand_out(block, nbytes)
        return block

    malloc = alloc

    def free(self, block: Block) -> None:
        """PyTorch's ``free``: mark free, coalesce with free neighbours, back to its pool."""
        if not block.allocated:
            raise CachingAllocatorError(f"double free (or free of a block never handed out): "
                                        f"{block!r}")
        seg = block.segment
        if seg is not None and self.segs.by_address.get(seg.address) is not seg:
            raise CachingAllocatorError(f"free of {block!r}, whose segment is not this allocator's")
        self.counts.take_back(block)
        if seg is None:  # zero-byte block
            return
        seg.active -= 1
        if not seg.active:
            self.active_segments -= 1
        free = self._free_small if seg.small else self._free_large
        free_blocks = self._free_blocks
        prev = block.prev
        if prev is not None and not prev.allocated:
            # Merge the free block before us into us (PyTorch's try_merge_blocks).
            del free[bisect_left(free, prev.size << _SHIFT | prev.address)]
            del free_blocks[prev.address]
            block.address = prev.address
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                seg.first = block
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            del free[bisect_left(free, nxt.size << _SHIFT | nxt.address)]
            del free_blocks[nxt.address]
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        block.gc_base = self._gc_searches
        free_blocks[block.address] = block
        insort(free, block.size << _SHIFT | block.address)

    def empty_cache(self) -> int:
        """Release every cached segment that holds no allocated block (PyTorch's
        ``release_cached_blocks``); return the bytes released."""
        freed = 0
        for free in (self._free_small, self._free_large):
            keep = []
            for key in free:
                block = self._free_blocks[key & _MASK]
                if block.prev is None and block.next is None:
                    del self._free_blocks[block.address]
                    freed += self.segs.release(block.segment)
                else:
                    keep.append(key)
            free[:] = keep
        return freed

    def largest_free_block(self) -> int:
        """Size of the largest cached free block (either pool)."""
        best = 0
        for free in (self._free_small, self._free_large):
            if free:
                best = max(best, free[-1] >> _SHIFT)
        return best

    def stats(self) -> dict[str, int]:
        """Memory statistics as a plain dict with stable keys (all sizes in bytes).

        The keys shared with :meth:`vmm.VirtualAllocator.stats`, read for this model:

        - ``requested_bytes``: bytes asked for by live blocks (before rounding).
        - ``mapped_bytes``: bytes of all reserved segments (PyTorch's "reserved"), the
          memory the device really holds; ``reserved_bytes`` and ``physical_bytes`` are
          the same number (a segment's address space is all mapped).
        - ``chunks_in_use`` / ``chunks_cached``: segments with / without an allocated block.
        - ``internal_fragmentation_bytes``: ``mapped_bytes - requested_bytes``: everything
          reserved but not asked for (rounding, split remainders and free blocks that are
          too small or in the wrong pool; for this allocator it includes external
          fragmentation).
        - ``peak_requested_bytes``, ``peak_mapped_bytes``, ``peak_reserved_bytes`` and
          ``peak_physical_bytes`` (both = ``peak_mapped_bytes``), ``peak_allocations``:
          maxima so far.
        - ``map_calls`` / ``unmap_calls``: segments allocated / released (``cudaMalloc`` /
          ``cudaFree`` in PyTorch).

        And the model's own:

        - ``allocated_bytes``, ``peak_allocated_bytes``: block bytes after rounding/splits.
        - ``reserved_segment_bytes``: = ``mapped_bytes``; ``segments``: how many;
          ``peak_segments``; ``small_pool_bytes`` / ``large_pool_bytes``: per pool.
        - ``largest_free_block``: the largest cached free block.
        - ``inactive_split_bytes``: free bytes in segments that also hold allocated blocks
          (PyTorch's "inactive_split": the fragmentation ``empty_cache`` cannot return).
        - ``capacity_bytes``: the device size given (0 = unlimited).
        - ``allocations``, ``alloc_count``, ``free_count``, ``num_alloc_retries`` (segment
          requests that needed the free-cached-segments retry), ``ooms``.
        """
        segs, counts = self.segs, self.counts
        mapped = segs.mapped_bytes
        cached_segments = len(segs) - self.active_segments
        whole_free = sum(s.size for s in segs.by_address.values() if not s.active)
        return {
            "requested_bytes": counts.requested_bytes,
            "mapped_bytes": mapped,
            "reserved_bytes": mapped,
            "physical_bytes": mapped,
            "chunks_in_use": self.active_segments,
            "chunks_cached": cached_segments,
            "internal_fragmentation_bytes": mapped - counts.requested_bytes,
            "peak_requested_bytes": counts.peak_requested_bytes,
            "peak_mapped_bytes": segs.peak_mapped_bytes,
            "peak_reserved_bytes": segs.peak_mapped_bytes,
            "peak_physical_bytes": segs.peak_mapped_bytes,
            "peak_allocations": counts.peak_live_allocations,
            "map_calls": segs.map_calls,
            "unmap_calls": segs.unmap_calls,
            "allocated_bytes": counts.allocated_bytes,
            "peak_allocated_bytes": counts.peak_allocated_bytes,
            "reserved_segment_bytes": mapped,
            "segments": len(segs),
            "peak_segments": segs.peak_segments,
            "small_pool_bytes": segs.small_pool_bytes,
            "large_pool_bytes": mapped - segs.small_pool_bytes,
            "largest_free_block": self.largest_free_block(),
            "inactive_split_bytes": mapped - counts.allocated_bytes - whole_free,
            "capacity_bytes": self.capacity_bytes or 0,
            "allocations": counts.live_allocations,
            "alloc_count": counts.alloc_count,
            "free_count": counts.free_count,
            "num_alloc_retries": self.num_alloc_retries,
            "ooms": self.ooms,
        }

    def segments(self) -> list[dict[str, Any]]:
        """A snapshot like ``torch.cuda.memory_snapshot()``: one dict per segment with
        ``address``, ``total_size``, ``pool`` ("small"/"large") and ``blocks`` (each
        ``address``, ``size``, ``requested``, ``state``), in address order."""
        out = []
        for seg in sorted(self.segs.by_address.values(), key=lambda s: s.address):
            blocks = []
            b = seg.first
            while b is not None:
                blocks.append({"address": b.address, "size": b.size, "requested": b.requested,
                               "state": "active_allocated" if b.allocated else "inactive"})
                b = b.next
            out.append({"address": seg.address, "total_size": seg.size,
                        "pool": "small" if seg.small else "large", "blocks": blocks})
        return out

    def close(self) -> None:
        """Release every segment; refuses while blocks are allocated."""
        if self.live_allocations:
            raise CachingAllocatorError(f"close() with {self.live_allocations} live block(s)")
        self.empty_cache()

    def __repr__(self) -> str:
        return (f"<CachingAllocator {self.live_allocations} live, "
                f"{format_size(self.requested_bytes)} requested, "
                f"{format_size(self.mapped_bytes)} reserved in {len(self.segs)} segments>")

    # -- internals ---------------------------------------------------------------------
    def _collect_garbage(self) -> None:
        """PyTorch's ``garbage_collect_cached_blocks``: the choice is
        :func:`vmm.gc_threshold.segments_to_release`'s; here the ages and the release."""
        free = self._free_large
        whole = [key for key in free
                 if self._free_blocks[key & _MASK].prev is None
                 and self._free_blocks[key & _MASK].next is None]
        if not whole:
            return
        now = self._gc_searches
        cands = [(key >> _SHIFT, now - self._free_blocks[key & _MASK].gc_base) for key in whole]
        chosen = segments_to_release(cands, self.mapped_bytes, self.capacity_bytes or 0,
                                     self.gc_threshold or 0.0)
        for i in chosen:
            key = whole[i]
            del free[bisect_left(free, key)]
            block = self._free_blocks.pop(key & _MASK)
            self.segs.release(block.segment)
            self.gc_released += 1

    def _alloc_block(self, size: int, small: bool, nbytes: int) -> Block:
        """A new segment for the request; when there is no room, empty the cache and retry
        once (as PyTorch does before it reports out of memory)."""
        seg_size = self.segs.size_for(size)
        seg = self.segs.new(seg_size, small)
        if seg is None:
            self.num_alloc_retries += 1
            self.empty_cache()
            seg = self.segs.new(seg_size, small)
            if seg is None:
                self.ooms += 1
                raise self._oom(nbytes, size, seg_size)
        block = Block(seg.address, seg.size, seg)
        seg.first = block
        return block

    def _oom(self, nbytes: int, size: int, seg_size: int) -> BudgetExceeded:
        cap = self.capacity_bytes
        reserved = self.mapped_bytes
        largest = self.largest_free_block()
        room = (cap - reserved) if cap is not None else 0
        fit = max(largest, room)
        cap_text = format_size(cap) if cap is not None else "unlimited"
        return BudgetExceeded(
            f"caching allocator out of memory: tried to allocate {format_size(nbytes)} "
            f"({nbytes} B, rounded to {size} B, needs a new {format_size(seg_size)} segment); "
            f"device capacity {cap_text}; {format_size(reserved)} reserved in "
            f"{len(self.segs)} segments, of which {format_size(self.allocated_bytes)} "
            f"allocated ({format_size(self.requested_bytes)} requested) and "
            f"{format_size(reserved - self.allocated_bytes)} reserved but unallocated "
            f"(fragmentation); largest free block {format_size(largest)}; the largest request "
            f"that fits now is about {format_size(fit)}.",
            requested=nbytes, in_use=self.requested_bytes, budget=cap or 0, largest_fit=fit)


_MASK = (1 << _SHIFT) - 1
