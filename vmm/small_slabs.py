"""What :class:`vmm.SmallBlockAllocator` hands out and keeps: a :class:`SmallBlock` (the
caller's side, with the buffer lifetime rule of :class:`vmm.Allocation`), and the slabs, free
stretches and tiers of the packing (the allocator's bookkeeping, read by its ``check``), and
the tiers it is made with (``default_tiers``).

Apart from :mod:`vmm.small_blocks` (the rules: which path a request takes, best fit,
coalescing, when a slab goes back) as :mod:`vmm.allocation` is apart from :mod:`vmm.virtual`.
"""

from __future__ import annotations

import gc
import weakref
from bisect import bisect_left, insort
from typing import Any, Sequence

from vmm.allocation import Allocation, AllocationError, BufferInUse, buffer_span
from vmm.units import format_size

__all__ = ["SmallBlock", "DEFAULT_ALIGN", "DEFAULT_PACK_WASTE", "default_tiers"]

DEFAULT_ALIGN = 512
DEFAULT_PACK_WASTE = 0.25


def default_tiers(chunk: int, align: int = DEFAULT_ALIGN) -> tuple[tuple[int, int], ...]:
    """The tiers ooc's allocator uses with chunks of ``chunk`` bytes, as ``(limit, slab)``
    pairs: every request below a chunk into one-chunk slabs, those up to 4 chunks that round
    badly into 10-chunk sparse slabs (mapped only where blocks lie). None where a chunk holds
    fewer than two blocks of ``align``. The one configuration of ooc's allocator: the
    runtime's device pools, ``ooc simulate --allocator vmm`` and ``ooc frag``'s ``vmm-N``
    models all use it, and it never maps more than whole chunks per request would (module
    docstring), so a plan made with sizes rounded up to whole chunks fits it.

    Measured on the 12 traces of benchmarks/bench_frag.py (peak reserved at 2 MiB chunks, see
    benchmarks/results/frag.md): 4-chunk limit and 10-chunk slabs peak at or below 2-chunk /
    5-chunk (resnet18 step 198 vs 202 MiB, its plan at 1/4 58 vs 64 MiB) and 8-chunk / 20-chunk
    slabs; no medium tier misses two targets (resnet18 step 214 MiB, gpt2 step 7.38 GiB)."""
    if chunk < 2 * align:
        return ()
    return ((chunk - align, chunk), (4 * chunk, 10 * chunk))


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
        nbytes = buffer_span(offset, nbytes, self.nbytes, self.mapped_bytes,
                             f"bytes of small block 0x{self.address:x}")
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
    """A free stretch of a chunk: [offset, offset + size). ``slab`` is its :class:`_Slab`, or,
    for the tail of a large range where no block has landed yet, that range's allocation."""

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
                 base: int = 0, total: int = 0, head: int = 0, tail: bool = False) -> None:
        self.allocation = allocation
        self.owner = owner    # the vmm.SmallBlockAllocator (not imported: it imports this)
        self.tier = tier
        self.base = base      # the slab is [base, base + total) of its allocation
        self.total = total or tier.slab_bytes
        self.head = head      # tail slab of a live large block: its bytes in the last chunk
        self.tail = tail      # made in a multi-chunk range's last chunk (indexed apart, for life)
        self.free: dict[int, _Free] = {}   # offset -> free stretch
        self.ends: dict[int, _Free] = {}   # offset + size -> the same stretch
        self.used = 0                      # bytes of live blocks (rounded)


class _Tier:
    """Requests up to ``limit`` bytes, packed best fit into slabs of ``slab_bytes``: the free
    stretches of its slabs by size (sorted distinct sizes; per size, in the order they became
    free), those of tail slabs apart (``tsizes``, ``tby_size``: searched second). A bucket
    maps each stretch to itself (an object's hash is its identity: cheaper than ``id``)."""

    __slots__ = ("limit", "slab_bytes", "sparse", "sizes", "by_size", "tsizes", "tby_size",
                 "slabs")

    def __init__(self, limit: int, slab_bytes: int, sparse: bool = False) -> None:
        self.limit = limit
        self.slab_bytes = slab_bytes
        self.sparse = sparse   # slabs of several chunks: mapped only where blocks lie
        self.sizes: list[int] = []
        self.by_size: dict[int, dict[_Free, _Free]] = {}
        self.tsizes: list[int] = []
        self.tby_size: dict[int, dict[_Free, _Free]] = {}
        self.slabs = 0

    def index(self, f: _Free, tail: bool) -> None:
        """Index a free stretch (``tail``: of a slab in a multi-chunk range's last chunk)."""
        by_size = self.tby_size if tail else self.by_size
        size = f.size
        bucket = by_size.get(size)
        if bucket is None:
            by_size[size] = {f: f}
            insort(self.tsizes if tail else self.sizes, size)
        else:
            bucket[f] = f

    def unindex(self, f: _Free, tail: bool) -> None:
        by_size = self.tby_size if tail else self.by_size
        size = f.size
        bucket = by_size[size]
        del bucket[f]
        if not bucket:
            del by_size[size]
            sizes = self.tsizes if tail else self.sizes
            del sizes[bisect_left(sizes, size)]


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


def _check_packing(a: Any) -> None:
    """The invariants of a :class:`vmm.SmallBlockAllocator`'s packing (its ``check``)."""
    chunks = 0
    for tier in a.tiers:
        stretches = [f for by in (tier.by_size, tier.tby_size) for bucket in by.values()
                     for f in bucket.values()]
        slabs = {f.slab for f in stretches if type(f.slab) is _Slab}
        tail_slabs = {f.slab for b in tier.tby_size.values() for f in b.values()}
        for f in stretches:
            if type(f.slab) is not _Slab:   # a tail with no block yet: the range's end
                assert f.slab.live and a._tails[f.slab] is f and tier is a.tiers[0]
                assert f.offset + f.size == f.slab.mapped_bytes and f.size < a.chunk_bytes
                one = f.slab.mapped_bytes == a.chunk_bytes   # searched with the slabs'
                assert tier.by_size.get(f.size, {}).get(f) is f if one else \
                    tier.tby_size.get(f.size, {}).get(f) is f
        for slab in slabs:
            assert slab.used > 0 and slab.allocation.live and slab.tier is tier
            free = sum(f.size for f in slab.free.values())
            assert {f.offset + f.size: f for f in slab.free.values()} == slab.ends
            assert free + slab.used == slab.total, (free, slab.used)
            assert all(slab.base <= f.offset < slab.base + slab.total for f in slab.free.values())
        assert sorted(tier.by_size) == tier.sizes and sorted(tier.tby_size) == tier.tsizes
        assert all(s.tail for s in slabs if s in tail_slabs)
        assert not any(s.tail for s in slabs if s not in tail_slabs)
        own = [s for s in slabs if not s.head]
        assert len(own) <= tier.slabs
        if tier.sparse:
            for slab in slabs:   # a chunk is in use where a block lies, and only there
                rng, c = slab.allocation, a.chunk_bytes
                free = [0] * rng.capacity
                for f in slab.free.values():
                    for j in range(f.offset // c, (f.offset + f.size - 1) // c + 1):
                        free[j] += min(f.offset + f.size, (j + 1) * c) - max(f.offset, j * c)
                assert all((rng.touch[j] == 0) == (free[j] == c) for j in range(rng.capacity))
        else:
            chunks += tier.slabs * tier.slab_bytes // a.chunk_bytes
    chunks += a.virtual._sparse.chunks_in_use()
    assert chunks == a.small_chunks
    assert sum(t.slabs for t in a.tiers) <= a.small_blocks


def add_free(slab: _Slab, offset: int, size: int) -> None:
    """Index ``[offset, offset + size)`` of ``slab`` as a free stretch of its tier (a new
    one: the caller made sure no free neighbour touches it)."""
    f = _Free(slab, offset, size)
    slab.free[offset] = f
    slab.ends[offset + size] = f
    slab.tier.index(f, False)


def _make_tiers(tiers: Sequence[tuple[int, int]], chunk: int, align: int) -> tuple[_Tier, ...]:
    """The tiers of a :class:`vmm.SmallBlockAllocator`, checked (its ``tiers`` and ``align``)."""
    if align <= 0 or align & (align - 1) or chunk % align:
        raise ValueError(f"align {align} must be a power of two dividing the chunk ({chunk} B)")
    last = 0
    for limit, slab in tiers:
        if not last < limit < slab or slab % chunk or limit % align or (not last and slab != chunk):
            raise ValueError(f"tier ({limit} B, slab {slab} B): limits must grow, be multiples "
                             f"of {align} B and each below its slab, slabs whole chunks of "
                             f"{chunk} B (the first tier's one chunk)")
        last = limit
    return tuple(_Tier(limit, slab, slab > chunk) for limit, slab in tiers)


def _packing_stats(a: Any, st: dict[str, int]) -> dict[str, int]:
    """A :class:`vmm.SmallBlockAllocator`'s ``stats()`` from its virtual allocator's ``st``."""
    st["requested_bytes"] = a.requested_bytes
    st["peak_requested_bytes"] = a.peak_requested_bytes
    st["internal_fragmentation_bytes"] = a.mapped_bytes - a.requested_bytes
    st["allocations"] = a.live_allocations
    st["peak_allocations"] = a.peak_allocations
    st["largest_fit_bytes"] = a.largest_fit()
    st.update(small_blocks=a.small_blocks, small_chunks=a.small_chunks,
              peak_small_chunks=a.peak_small_chunks,
              small_requested_bytes=a.small_requested_bytes,
              small_block_bytes=a.small_block_bytes,
              small_free_bytes=a.small_chunks * a.chunk_bytes - a.small_block_bytes,
              small_allocs=a.small_allocs, small_chunk_opens=a.small_chunk_opens,
              tail_blocks=a.tail_blocks, threshold_bytes=a.threshold)
    return st
