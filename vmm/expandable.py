"""A model of PyTorch's caching allocator with ``expandable_segments:True``.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` PyTorch stops making one
``cudaMalloc`` segment per cache miss. Instead each pool (per stream; one stream here, as in
the rest of the replay) owns one *expandable segment*: a virtual range as large as the device
and an eighth, reserved once, into which physical pages are mapped on demand — 2 MiB pages
for the small pool (requests up to 1 MiB), 20 MiB pages for the large pool. Blocks are still
found best-fit and split, but a miss grows the segment at its end instead of adding a
segment beside it, so a freed block next to the growing end is reused and extended, and the
"many segments, each with a hole" pattern of the default allocator cannot form. Why a user
turns it on: it is PyTorch's own answer to fragmentation, one line of configuration.

The rules followed (``c10/cuda/CUDACachingAllocator.cpp``: ``get_free_block``,
``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``, ``unmap_block``,
``release_cached_blocks``, ``should_split``):

- requests are rounded as without the knob (512 bytes, or :mod:`vmm.roundup`) and go to the
  small pool up to 1 MiB, else to the large pool;
- *search*: the smallest mapped free block that fits, ties by address; but a block followed
  by unmapped space counts as that much larger, so among the fits the walk moves on to a
  larger block while that one's "size it could expand to" is smaller (keeping the growing
  end for requests that need it). ``max_split_size`` checks then apply as without the knob;
- *miss*: take the lowest-addressed unmapped range of the pool (together with the free
  mapped block right before it, if any) with room for the request, and map just enough whole
  pages at its start to cover the request, merging them with free mapped neighbours; when no
  range has room, reserve a new segment. Mapping is all or nothing per range (a page that
  cannot be had undoes that range's pages);
- *split*: a found block is split whenever at least 512 bytes remain, in both pools (no
  1 MiB rule);
- *free*: the block merges with free **mapped** neighbours only; nothing is unmapped;
- *out of memory*: when pages cannot be mapped (the device is full), every whole page inside
  a free block of either pool is unmapped (``empty_cache`` does the same) and the request is
  retried once, then fails.

Reserved bytes are the mapped pages (``mapped_bytes``); ``map_calls`` / ``unmap_calls``
count pages mapped / unmapped (one ``cuMemMap`` / ``cuMemUnmap`` each in PyTorch).
``garbage_collection_threshold`` never frees expandable memory in PyTorch, so it has no
parameter here. Pure bookkeeping: no backend, nothing allocated.

The blocks, segments and per-pool free lists are :mod:`vmm.expandable_blocks`; the size rules
shared with the default allocator are :mod:`vmm.block_sizes`.
"""

from __future__ import annotations

from bisect import bisect_left

from vmm.block_counters import BlockCounters, part_attribute
from vmm.block_sizes import K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_SIZE, block_size
from vmm.errors import CachingAllocatorError
from vmm.expandable_blocks import _MASK, _SHIFT, ExpandableBlock, _Pool, _Segment
from vmm.pool import BudgetExceeded
from vmm.roundup import check_divisions
from vmm.units import format_size

__all__ = ["ExpandableAllocator", "ExpandableBlock"]

_UNLIMITED_SPACE = 1 << 46  # the virtual range of a segment when no device size is given


class ExpandableAllocator:
    """PyTorch's caching allocator under ``expandable_segments:True`` (module docstring).

    Args:
        capacity_bytes: device memory: mapping fails once the pages would exceed it (and
            each segment's virtual range is this plus an eighth). ``None``: unlimited.
        max_split_size: ``max_split_size_mb`` in bytes (``None``: unlimited).
        roundup_divisions: ``roundup_power2_divisions`` (1: off).

    Same surface as :class:`vmm.CachingAllocator` for the replay: ``alloc`` / ``free``,
    ``empty_cache``, ``largest_free_block``, ``stats`` and the plain counters.
    """

    def __init__(self, capacity_bytes: int | None = None, *, max_split_size: int | None = None,
                 roundup_divisions: int = 1) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_split_size = max_split_size if max_split_size is not None else 1 << 62
        self.roundup_divisions = check_divisions(roundup_divisions)
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._segments: list[_Segment] = []
        self._next_base = 1 << 40
        self.counts = BlockCounters()   # the blocks handed out: bytes, peaks (as CachingAllocator's)
        self.mapped_bytes = 0           # pages mapped (plain attributes: the replay reads them per event)
        self.small_pool_bytes = 0
        self.peak_mapped_bytes = 0
        self.map_calls = 0
        self.unmap_calls = 0
        self.num_alloc_retries = 0
        self.ooms = 0

    # The block counters the replay reads per event (``ooc.frag``), as every vmm allocator has them.
    requested_bytes = part_attribute("counts.requested_bytes")
    allocated_bytes = part_attribute("counts.allocated_bytes")
    live_allocations = part_attribute("counts.live_allocations")

    # -- public API --------------------------------------------------------------------
    def alloc(self, nbytes: int) -> ExpandableBlock:
        """PyTorch's ``malloc`` with expandable segments; BudgetExceeded when even unmapping
        every free page does not make room."""
        if nbytes <= 0:
            if nbytes == 0:
                block = ExpandableBlock(0, 0, None, True)
                self.counts.hand_out(block, 0)
                return block
            raise CachingAllocatorError(f"alloc of a negative size ({nbytes} bytes)")
        size = block_size(nbytes, self.roundup_divisions)
        small = size <= K_SMALL_SIZE
        pool = self._pools[small]
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._expand(pool, size)
            if block is None:
                self.num_alloc_retries += 1
                self.empty_cache()
                block = self._expand(pool, size)
                if block is None:
                    self.ooms += 1
                    raise self._oom(nbytes, size)
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK_SIZE:  # should_split: always, with expandable segments
            rest = ExpandableBlock(block.address + size, remaining, block.segment, True)
            self._splice_after(block, rest)
            block.size = size
            pool.add_free(rest)
        self.counts.hand_out(block, nbytes)
        return block

    malloc = alloc

    def free(self, block: ExpandableBlock) -> None:
        """PyTorch's ``free_block``: merge with free mapped neighbours; nothing is unmapped."""
        if not block.allocated:
            raise CachingAllocatorError(f"double free (or free of a block never handed out): "
                                        f"{block!r}")
        self.counts.take_back(block)
        seg = block.segment
        if seg is None:
            return
        pool = self._pools[seg.small]
        self._merge_free(pool, block)
        pool.add_free(block)

    def empty_cache(self) -> int:
        """Unmap every whole page inside a free block, both pools (PyTorch's
        ``release_cached_blocks`` with expandable segments); return the bytes unmapped."""
        freed = 0
        for pool in self._pools.values():
            for key in list(pool.free):
                freed += self._unmap_block(pool, pool.blocks[key & _MASK])
        return freed

    def largest_free_block(self) -> int:
        """Size of the largest mapped free block (either pool)."""
        return max((p.free[-1] >> _SHIFT for p in self._pools.values() if p.free), default=0)

    def stats(self) -> dict[str, int]:
        """The keys :meth:`vmm.CachingAllocator.stats` documents that mean something here
        (``mapped_bytes`` = reserved = pages mapped), plus ``segments`` (virtual ranges)."""
        mapped, counts = self.mapped_bytes, self.counts
        return {
            "requested_bytes": counts.requested_bytes, "mapped_bytes": mapped,
            "reserved_bytes": mapped, "physical_bytes": mapped,
            "internal_fragmentation_bytes": mapped - counts.requested_bytes,
            "peak_requested_bytes": counts.peak_requested_bytes,
            "peak_mapped_bytes": self.peak_mapped_bytes,
            "peak_reserved_bytes": self.peak_mapped_bytes,
            "peak_physical_bytes": self.peak_mapped_bytes,
            "peak_allocations": counts.peak_live_allocations,
            "map_calls": self.map_calls, "unmap_calls": self.unmap_calls,
            "allocated_bytes": counts.allocated_bytes,
            "peak_allocated_bytes": counts.peak_allocated_bytes,
            "segments": len(self._segments),
            "small_pool_bytes": self.small_pool_bytes,
            "large_pool_bytes": mapped - self.small_pool_bytes,
            "largest_free_block": self.largest_free_block(),
            "capacity_bytes": self.capacity_bytes or 0,
            "allocations": counts.live_allocations, "alloc_count": counts.alloc_count,
            "free_count": counts.free_count, "num_alloc_retries": self.num_alloc_retries,
            "ooms": self.ooms,
        }

    def __repr__(self) -> str:
        return (f"<ExpandableAllocator {self.live_allocations} live, "
                f"{format_size(self.requested_bytes)} requested, "
                f"{format_size(self.mapped_bytes)} mapped>")

    # -- internals ---------------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> ExpandableBlock | None:
        free, blocks = pool.free, pool.blocks
        i = bisect_left(free, size << _SHIFT)
        if i == len(free):
            return None
        # Prefer, among the fits, a block whose expandable size is smaller than the current's.
        cur = blocks[free[i] & _MASK]
        grow = cur.size + (cur.next.size if cur.next is not None and not cur.next.mapped else 0)
        while i + 1 < len(free):
            nxt = blocks[free[i + 1] & _MASK]
            g = nxt.size + (nxt.next.size if nxt.next is not None and not nxt.next.mapped else 0)
            if g >= grow:
                break
            i, cur, grow = i + 1, nxt, g
        mss = self.max_split_size
        if (size < mss and cur.size >= mss) or (size >= mss and cur.size >= size + K_LARGE_BUFFER):
            return None
        pool.drop_free(cur)
        return cur

    def _expand(self, pool: _Pool, size: int) -> ExpandableBlock | None:
        """PyTorch's ``try_allocate_expandable_block``: map pages until one free block at
        the lowest suitable address holds ``size``; None if the device is full."""
        cand = None
        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                cand = c
                break
        if cand is None:
            cand = self._new_segment(pool)
        if not cand.mapped and not self._map(pool, cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            assert nxt is not None and not nxt.mapped
            if not self._map(pool, nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        pool.drop_free(cand)
        return cand

    def _new_segment(self, pool: _Pool) -> ExpandableBlock:
        cap = self.capacity_bytes
        space = cap + cap // 8 if cap is not None else _UNLIMITED_SPACE
        space = -(-space // pool.page) * pool.page
        seg = _Segment(self._next_base, space, pool.page, pool.small)
        self._next_base += space + (1 << 30)
        self._segments.append(seg)
        b = ExpandableBlock(seg.base, space, seg, False)
        pool.add_unmapped(b)
        return b

    def _map(self, pool: _Pool, b: ExpandableBlock, n: int) -> bool:
        """PyTorch's ``map_block``: map the whole pages covering ``b``'s first ``n`` bytes
        (``b`` starts on a page), merge with free mapped neighbours; False if they do not fit."""
        page = pool.page
        length = -(-n // page) * page
        cap = self.capacity_bytes
        if cap is not None and self.mapped_bytes + length > cap:
            return False
        pool.drop_unmapped(b)
        b.mapped = True
        if length < b.size:
            rest = ExpandableBlock(b.address + length, b.size - length, b.segment, False)
            self._splice_after(b, rest)
            b.size = length
            pool.add_unmapped(rest)
        self._merge_free(pool, b)
        pool.add_free(b)
        self.mapped_bytes += length
        if pool.small:
            self.small_pool_bytes += length
        if self.mapped_bytes > self.peak_mapped_bytes:
            self.peak_mapped_bytes = self.mapped_bytes
        self.map_calls += length // page
        return True

    def _unmap_block(self, pool: _Pool, b: ExpandableBlock) -> int:
        """PyTorch's ``unmap_block``: unmap the whole pages inside free block ``b``; the
        partial pages at either end stay mapped as free blocks."""
        seg = b.segment
        assert seg is not None
        page = seg.page
        lo = b.address - seg.base
        begin = seg.base + -(-lo // page) * page
        end = seg.base + (lo + b.size) // page * page
        if begin >= end:
            return 0
        pool.drop_free(b)
        if begin > b.address:
            before = ExpandableBlock(b.address, begin - b.address, seg, True)
            self._splice_before(b, before)
            pool.add_free(before)
        if end < b.address + b.size:
            after = ExpandableBlock(end, b.address + b.size - end, seg, True)
            self._splice_after(b, after)
            pool.add_free(after)
        b.address, b.size, b.mapped = begin, end - begin, False
        for nb in (b.prev, b.next):
            if nb is not None and not nb.mapped:
                pool.drop_unmapped(nb)
                self._absorb(b, nb)
        pool.add_unmapped(b)
        self.mapped_bytes -= end - begin
        if pool.small:
            self.small_pool_bytes -= end - begin
        self.unmap_calls += (end - begin) // page
        return end - begin

    def _merge_free(self, pool: _Pool, b: ExpandableBlock) -> None:
        """Absorb free mapped neighbours into ``b`` (PyTorch's ``try_merge_blocks``)."""
        for nb in (b.prev, b.next):
            if nb is not None and nb.mapped and not nb.allocated:
                pool.drop_free(nb)
                self._absorb(b, nb)

    @staticmethod
    def _absorb(b: ExpandableBlock, nb: ExpandableBlock) -> None:
        if nb is b.prev:
            b.address = nb.address
            b.prev = nb.prev
            if b.prev is not None:
                b.prev.next = b
        else:
            b.next = nb.next
            if b.next is not None:
                b.next.prev = b
        b.size += nb.size

    @staticmethod
    def _splice_after(b: ExpandableBlock, new: ExpandableBlock) -> None:
        new.prev, new.next = b, b.next
        if b.next is not None:
            b.next.prev = new
        b.next = new

    @staticmethod
    def _splice_before(b: ExpandableBlock, new: ExpandableBlock) -> None:
        new.prev, new.next = b.prev, b
        if b.prev is not None:
            b.prev.next = new
        b.prev = new

    def _oom(self, nbytes: int, size: int) -> BudgetExceeded:
        cap = self.capacity_bytes
        room = (cap - self.mapped_bytes) if cap is not None else 0
        fit = max(self.largest_free_block(), room)
        return BudgetExceeded(
            f"expandable-segments allocator out of memory: tried to allocate "
            f"{format_size(nbytes)} ({nbytes} B, rounded to {size} B); device capacity "
            f"{format_size(cap) if cap is not None else 'unlimited'}; "
            f"{format_size(self.mapped_bytes)} mapped, of which "
            f"{format_size(self.allocated_bytes)} allocated; the largest request that fits now "
            f"is about {format_size(fit)}.",
            requested=nbytes, in_use=self.requested_bytes, budget=cap or 0, largest_fit=fit)
