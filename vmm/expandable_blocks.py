"""What an expandable segment is made of: its blocks (mapped or not) in address order, and
per pool the sorted free blocks and unmapped ranges the allocator searches.

Apart from :mod:`vmm.expandable` (the rules: search, expansion, splitting, unmapping) so that
the data structures and their small invariants read on their own. Free-list keys are
``size << 64 | address``: one int compares faster than a tuple.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from vmm.block_sizes import K_LARGE_BUFFER, K_SMALL_BUFFER

__all__ = ["ExpandableBlock"]

_SHIFT = 64
_MASK = (1 << _SHIFT) - 1

class _Segment:
    __slots__ = ("base", "size", "page", "small")

    def __init__(self, base: int, size: int, page: int, small: bool) -> None:
        self.base, self.size, self.page, self.small = base, size, page, small


class ExpandableBlock:
    """A range of an expandable segment: free or allocated when ``mapped``, else address
    space with no pages behind it. What :meth:`ExpandableAllocator.alloc` returns."""

    __slots__ = ("address", "size", "requested", "allocated", "mapped", "prev", "next", "segment")

    def __init__(self, address: int, size: int, segment: _Segment | None, mapped: bool) -> None:
        self.address = address
        self.size = size
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: ExpandableBlock | None = None
        self.next: ExpandableBlock | None = None
        self.segment = segment

    @property
    def nbytes(self) -> int:
        return self.requested

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"<ExpandableBlock 0x{self.address:x} size={self.size} {state}>"


class _Pool:
    __slots__ = ("small", "page", "free", "blocks", "unmapped", "unmapped_addrs")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        self.free: list[int] = []  # mapped free blocks: size << 64 | address, sorted
        self.blocks: dict[int, ExpandableBlock] = {}  # address -> mapped free block
        self.unmapped: dict[int, ExpandableBlock] = {}
        self.unmapped_addrs: list[int] = []  # sorted

    def add_free(self, b: ExpandableBlock) -> None:
        self.blocks[b.address] = b
        insort(self.free, b.size << _SHIFT | b.address)

    def drop_free(self, b: ExpandableBlock) -> None:
        del self.free[bisect_left(self.free, b.size << _SHIFT | b.address)]
        del self.blocks[b.address]

    def add_unmapped(self, b: ExpandableBlock) -> None:
        self.unmapped[b.address] = b
        insort(self.unmapped_addrs, b.address)

    def drop_unmapped(self, b: ExpandableBlock) -> None:
        del self.unmapped_addrs[bisect_left(self.unmapped_addrs, b.address)]
        del self.unmapped[b.address]
