"""The counters the two replays of PyTorch's allocator keep per block handed out and back.

:class:`~vmm.caching.CachingAllocator` and :class:`~vmm.expandable.ExpandableAllocator` model
different segment policies but count the same way, so that their ``stats()`` compare: each
owns one :class:`BlockCounters` (a part with its own state, not a base class) and reads it.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

__all__ = ["BlockCounters", "part_attribute"]


def part_attribute(path: str, doc: str | None = None) -> property:
    """A read-only property of an allocator that reads an attribute of one of its parts
    (``"counts.allocated_bytes"``): the counters the replay reads per event (``ooc.frag``)
    stay the allocator's attributes while a part owns them, read by ``attrgetter`` in C."""
    return property(attrgetter(path), doc=doc)


class BlockCounters:
    """Live and peak bytes and allocations of the blocks an allocator handed out (blocks with
    ``allocated``, ``requested``, ``size`` and ``segment``). Plain attributes: the replay
    reads them per event."""

    __slots__ = ("requested_bytes", "allocated_bytes", "live_allocations", "alloc_count",
                 "free_count", "peak_requested_bytes", "peak_allocated_bytes",
                 "peak_live_allocations")

    def __init__(self) -> None:
        self.requested_bytes = self.allocated_bytes = self.live_allocations = 0
        self.alloc_count = self.free_count = 0
        self.peak_requested_bytes = self.peak_allocated_bytes = self.peak_live_allocations = 0

    def hand_out(self, block: Any, nbytes: int) -> None:
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

    def take_back(self, block: Any) -> None:
        """``block`` is free again (a zero-byte block, with no segment, counts no bytes)."""
        block.allocated = False
        self.free_count += 1
        self.live_allocations -= 1
        if block.segment is None:
            return
        self.requested_bytes -= block.requested
        self.allocated_bytes -= block.size
        block.requested = 0
