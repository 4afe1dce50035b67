"""What :class:`vmm.SmallBlockAllocator` hands out and keeps: a :class:`SmallBlock` (the
caller's side, with the buffer lifetime rule of :class:`vmm.Allocation`), and the slabs, free
stretches and tiers of the packing (the allocator's bookkeeping, read by its ``check``).

Apart from :mod:`vmm.small_blocks` (the rules: which path a request takes, best fit,
coalescing, when a slab goes back) as :mod:`vmm.allocation` is apart from :mod:`vmm.virtual`.
"""

from __future__ import annotations

import gc
import weakref
from bisect import bisect_left, insort
from typing import Any

from vmm.allocation import Allocation, AllocationError, BufferInUse
from vmm.units import format_size

__all__ = ["SmallBlock"]


class SmallBlock:
    """A live small block (what :meth:`SmallBlockAllocator.alloc` returns for a small
    request): ``address`` (a multiple of the allocator's ``align``), ``nbytes`` (requested),
    ``mapped_bytes`` (the rounded block size); :meth:`buffer` and :meth:`free` as for an
    :class:`~vmm.allocation.Allocation`, with the same lifetime rule for buffers."""

    __slots__ = ("address", "nbytes", "mapped_bytes", "_slab", "_exports", "__weakref__")

    def __init__(self, address: int, nbytes: int, size: int, slab: _Slab) -> None:
        self.address = address
        self.nbytes = nbytes
        self.mapped_bytes = size
        self._slab: _Slab | None = slab
        self._exports: list[weakref.ref] | None = None

    @property
    def live(self) -> bool:
        return self._slab is not None

    @property
    def chunk_address(self) -> int:
        """The address of the chunk holding the block (0 once freed)."""
        return self._slab.allocation.address if self._slab is not None else 0

    def buffer(self, offset: int = 0, nbytes: int | None = None) -> Any:
        """A zero-copy buffer over ``[offset, offset + nbytes)`` of the block (host backend)."""
        if self._slab is None:
            raise AllocationError(f"buffer() of a freed small block (was at 0x{self.address:x})")
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.mapped_bytes:
            raise AllocationError(f"buffer(offset={offset}, nbytes={nbytes}) outside the "
                                  f"{self.mapped_bytes} bytes of small block 0x{self.address:x}")
        chunk = self._slab.allocation
        buf = chunk.buffer(self.address - chunk.address + offset, nbytes)
        if self._exports is None:
            self._exports = []
        self._exports.append(weakref.ref(buf))
        return buf

    def free(self) -> None:
        if self._slab is None:
            raise AllocationError(f"double free of the small block at 0x{self.address:x}")
        self._slab.owner.free(self)

    def __repr__(self) -> str:
        state = "live" if self._slab is not None else "freed"
        return (f"<SmallBlock 0x{self.address:x} {format_size(self.nbytes)} requested, "
                f"{format_size(self.mapped_bytes)} block, {state}>")


class _Free:
    """A free stretch of a chunk: [offset, offset + size)."""

    __slots__ = ("slab", "offset", "size")

    def __init__(self, slab: _Slab, offset: int, size: int) -> None:
        self.slab = slab
        self.offset = offset
        self.size = size


class _Slab:
    """Chunks held for small blocks: the allocation, its free stretches by offset (offsets
    from the allocation's address). A *tail slab* is the last chunk of a large allocation,
    whose bytes past the large block serve small blocks too (``head`` > 0 while the large
    block lives)."""

    __slots__ = ("allocation", "owner", "tier", "free", "ends", "used", "base", "total", "head",
                 "tail")

    def __init__(self, allocation: Allocation, owner: Any, tier: _Tier,
                 base: int = 0, total: int = 0, head: int = 0) -> None:
        self.allocation = allocation
        self.owner = owner    # the vmm.SmallBlockAllocator (not imported: it imports this)
        self.tier = tier
        self.base = base      # the slab is [base, base + total) of its allocation
        self.total = total or tier.slab_bytes
        self.head = head      # tail slab of a live large block: its bytes in the last chunk
        self.tail = head > 0  # made in a large range's last chunk (indexed apart, for life)
        self.free: dict[int, _Free] = {}   # offset -> free stretch
        self.ends: dict[int, _Free] = {}   # offset + size -> the same stretch
        self.used = 0                      # bytes of live blocks (rounded)


class _Tier:
    """Requests up to ``limit`` bytes, packed best fit into slabs of ``slab_bytes``: the free
    stretches of its slabs by size (sorted distinct sizes; per size, in the order they became
    free), those of tail slabs apart (``tsizes``, ``tby_size``: searched second)."""

    __slots__ = ("limit", "slab_bytes", "sizes", "by_size", "tsizes", "tby_size", "slabs")

    def __init__(self, limit: int, slab_bytes: int) -> None:
        self.limit = limit
        self.slab_bytes = slab_bytes
        self.sizes: list[int] = []
        self.by_size: dict[int, dict[int, _Free]] = {}
        self.tsizes: list[int] = []
        self.tby_size: dict[int, dict[int, _Free]] = {}
        self.slabs = 0

    def index(self, f: _Free) -> None:
        if f.slab.tail:
            by_size, sizes = self.tby_size, self.tsizes
        else:
            by_size, sizes = self.by_size, self.sizes
        bucket = by_size.get(f.size)
        if bucket is None:
            by_size[f.size] = {id(f): f}
            insort(sizes, f.size)
        else:
            bucket[id(f)] = f

    def unindex(self, f: _Free) -> None:
        if f.slab.tail:
            by_size, sizes = self.tby_size, self.tsizes
        else:
            by_size, sizes = self.by_size, self.sizes
        bucket = by_size[f.size]
        del bucket[id(f)]
        if not bucket:
            del by_size[f.size]
            del sizes[bisect_left(sizes, f.size)]


def _check_exports(block: SmallBlock) -> None:
    if not any(r() is not None for r in block._exports or ()):
        block._exports = None
        return
    gc.collect()
    alive = sum(r() is not None for r in block._exports or ())
    if alive:
        raise BufferInUse(
            f"free of the small block at 0x{block.address:x} ({format_size(block.nbytes)}) "
            f"while {alive} buffer(s) exported from it are still referenced: drop them first, "
            "their memory would be reused")
    block._exports = None
