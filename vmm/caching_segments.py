"""The segments of the caching model and the blocks inside them, and how a segment is had
from the backend and given back.

Each segment is one ``cudaMalloc`` in PyTorch; here it is one chunk of the segment's size
mapped onto its own reserved range of the backend. A segment's blocks form a doubly linked
list in address order (split and coalesced by :class:`vmm.caching.CachingAllocator`). Kept
apart from :mod:`vmm.caching` (the best-fit search, splitting, coalescing and the statistics)
because getting device memory, with the retry after emptying the cache that PyTorch makes
before it reports out of memory, is a separate concern from arranging blocks inside it.
:class:`SegmentSource` is a mixin of the allocator: the segment counters it updates are the
allocator's ``stats()``.
"""

from __future__ import annotations

from typing import Any

from vmm.backend import Backend
from vmm.block_sizes import allocation_size
from vmm.errors import OutOfBudget

__all__ = ["Block", "SegmentSource"]


class _Segment:
    __slots__ = ("address", "size", "handle", "small", "active", "first")

    def __init__(self, address: int, size: int, handle: Any, small: bool) -> None:
        self.address = address
        self.size = size
        self.handle = handle
        self.small = small
        self.active = 0  # allocated blocks in this segment
        self.first: Block | None = None  # the block at the segment's start


class Block:
    """A block of a segment: ``address``, ``size`` (rounded, after splitting) and, while
    allocated, ``requested`` (the bytes asked for). What :meth:`CachingAllocator.alloc`
    returns and :meth:`CachingAllocator.free` takes."""

    __slots__ = ("address", "size", "requested", "allocated", "prev", "next", "segment",
                 "gc_base")

    def __init__(self, address: int, size: int, segment: _Segment | None,
                 prev: "Block | None" = None, next: "Block | None" = None) -> None:
        self.address = address
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev = prev
        self.next = next
        self.segment = segment
        self.gc_base = 0  # the pool's search count when this block last became free

    @property
    def nbytes(self) -> int:
        return self.requested

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"<Block 0x{self.address:x} size={self.size} requested={self.requested} {state}>"


class SegmentSource:
    """The segment half of :class:`vmm.caching.CachingAllocator` (see the module docstring):
    a new segment for a request, the retry after emptying the cache (the allocator's
    ``empty_cache``), the release of one; the error when even the retry fails is the
    allocator's ``_oom``."""

    backend: Backend
    capacity_bytes: int | None
    _granularity: int
    _segments: dict[int, _Segment]

    def _alloc_block(self, size: int, small: bool, nbytes: int) -> Block:
        """A new segment for the request; on failure free cached segments, retry once."""
        seg_size = allocation_size(size)
        g = self._granularity
        if seg_size % g:
            seg_size = -(-seg_size // g) * g
        seg = self._new_segment(seg_size, small)
        if seg is None:
            self.num_alloc_retries += 1
            self.empty_cache()
            seg = self._new_segment(seg_size, small)
            if seg is None:
                self.ooms += 1
                raise self._oom(nbytes, size, seg_size)
        block = Block(seg.address, seg.size, seg)
        seg.first = block
        return block

    def _new_segment(self, seg_size: int, small: bool) -> _Segment | None:
        cap = self.capacity_bytes
        if cap is not None and self.mapped_bytes + seg_size > cap:
            return None
        backend = self.backend
        address = handle = None
        try:
            address = backend.reserve_range(seg_size)
            handle = backend.create_chunk(seg_size)
            backend.map(address, handle, seg_size)
            backend.set_access(address, seg_size)
        except OutOfBudget:  # the backend itself is full (DeviceOutOfMemory)
            if handle is not None:
                backend.release_chunk(handle)
            if address is not None:
                backend.free_range(address, seg_size)
            return None
        seg = _Segment(address, seg_size, handle, small)
        self._segments[address] = seg
        self.map_calls += 1
        self.mapped_bytes += seg_size
        if small:
            self.small_pool_bytes += seg_size
        if self.mapped_bytes > self.peak_mapped_bytes:
            self.peak_mapped_bytes = self.mapped_bytes
        if len(self._segments) > self.peak_segments:
            self.peak_segments = len(self._segments)
        return seg

    def _release_segment(self, seg: _Segment) -> int:
        backend = self.backend
        backend.unmap(seg.address, seg.size)
        backend.release_chunk(seg.handle)
        backend.free_range(seg.address, seg.size)
        del self._segments[seg.address]
        self.unmap_calls += 1
        self.mapped_bytes -= seg.size
        if seg.small:
            self.small_pool_bytes -= seg.size
        return seg.size

