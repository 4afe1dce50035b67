"""The counters the two replays of PyTorch's allocator keep per block handed out and back.

:class:`~vmm.caching.CachingAllocator` and :class:`~vmm.expandable.ExpandableAllocator` model
different segment policies, but count the same way, so that their ``stats()`` compare.
"""

from __future__ import annotations

from typing import Any


class BlockCounters:
    """Live and peak bytes and allocations, for allocators that hand out blocks with
    ``allocated``, ``requested`` and ``size``."""

    requested_bytes: int
    allocated_bytes: int
    live_allocations: int
    alloc_count: int
    free_count: int
    peak_requested_bytes: int
    peak_allocated_bytes: int
    peak_live_allocations: int

    def _hand_out(self, block: Any, nbytes: int) -> None:
        """``block`` (of ``block.size`` bytes) now serves a request of ``nbytes``."""
        block.allocated = True
        block.requested = nbytes
        self.alloc_count += 1
        self.live_allocations += 1
        if self.live_allocations > self.peak_live_allocations:
            self.peak_live_allocations = self.live_allocations
        self.requested_bytes += nbytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes

    def _take_back(self, block: Any) -> None:
        """``block`` is free again (a zero-byte block, with no segment, counts no bytes)."""
        block.allocated = False
        self.free_count += 1
        self.live_allocations -= 1
        if block.segment is None:
            return
        self.requested_bytes -= block.requested
        self.allocated_bytes -= block.size
        block.requested = 0
