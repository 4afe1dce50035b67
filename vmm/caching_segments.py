"""The segments of the caching model and the blocks inside them, and how a segment is had
from the backend and given back.

Each segment is one ``cudaMalloc`` in PyTorch; here it is one chunk of the segment's size
mapped onto its own reserved range of the backend. A segment's blocks form a doubly linked
list in address order (split and coalesced by :class:`vmm.caching.CachingAllocator`). Kept
apart from :mod:`vmm.caching` (the best-fit search, splitting, coalescing and the statistics)
because getting device memory from the backend is a separate concern from arranging blocks
inside it. :class:`Segments` is a part the allocator owns, with its own state (the segments
and their counters); the retry after emptying the cache, which PyTorch makes before it
reports out of memory, is the allocator's (it empties its own cache).
"""

from __future__ import annotations

from typing import Any

from vmm.backend import Backend
from vmm.block_sizes import allocation_size
from vmm.errors import OutOfBudget

__all__ = ["Block", "Segments"]


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


class Segments:
    """The segments of one :class:`vmm.caching.CachingAllocator` (module docstring): each is a
    chunk of the backend mapped onto a reserved range of its own. Owns them and their counters
    (the allocator's ``stats()`` reads them); the allocator arranges blocks inside and decides
    when to ask for one (with its retry after emptying its cache) or give one back."""

    __slots__ = ("backend", "capacity_bytes", "by_address", "mapped_bytes", "small_pool_bytes",
                 "peak_mapped_bytes", "peak_segments", "map_calls", "unmap_calls")

    def __init__(self, backend: Backend, capacity_bytes: int | None) -> None:
        self.backend, self.capacity_bytes = backend, capacity_bytes
        self.by_address: dict[int, _Segment] = {}
        self.mapped_bytes = self.small_pool_bytes = 0   # = reserved segment bytes; of the small pool
        self.peak_mapped_bytes = self.peak_segments = 0
        self.map_calls = self.unmap_calls = 0

    def __len__(self) -> int:
        return len(self.by_address)

    def size_for(self, size: int) -> int:
        """The segment a block of ``size`` bytes comes in: PyTorch's ``allocation_size``,
        rounded up to the backend's granularity."""
        seg_size, g = allocation_size(size), self.backend.granularity
        return -(-seg_size // g) * g

    def new(self, seg_size: int, small: bool) -> _Segment | None:
        """A new segment of ``seg_size`` bytes; None if the capacity or the backend is full
        (whatever was made of it given back)."""
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
        self.by_address[address] = seg
        self.map_calls += 1
        self.mapped_bytes += seg_size
        if small:
            self.small_pool_bytes += seg_size
        if self.mapped_bytes > self.peak_mapped_bytes:
            self.peak_mapped_bytes = self.mapped_bytes
        if len(self.by_address) > self.peak_segments:
            self.peak_segments = len(self.by_address)
        return seg

    def release(self, seg: _Segment) -> int:
        """Give ``seg`` back to the backend; its bytes."""
        backend = self.backend
        backend.unmap(seg.address, seg.size)
        backend.release_chunk(seg.handle)
        backend.free_range(seg.address, seg.size)
        del self.by_address[seg.address]
        self.unmap_calls += 1
        self.mapped_bytes -= seg.size
        if seg.small:
            self.small_pool_bytes -= seg.size
        return seg.size
