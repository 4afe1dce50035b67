"""ooc's allocator: a small-block pool in front of virtual addressing.

Pure virtual addressing (:class:`vmm.VirtualAllocator`) rounds every request up to whole
chunks: no external fragmentation, but a 4 KiB tensor costs a 2 MiB chunk, so a program of
many small tensors reserves several times its live bytes (a scientific CNN snapshot: 2.11x
at 2 MiB chunks, 14x at 20 MiB). :class:`SmallBlockAllocator` keeps the chunk design for
what it is good at and packs what it is bad at:

Three paths, by size (chunk c = 2 MiB in the defaults, :func:`default_tiers`):

- **small** (below a chunk, ``c - 512``): rounded up to ``align`` bytes (512, PyTorch's
  ``kMinBlockSize``) and placed **best fit** (the smallest free stretch that is large enough,
  the one freed last among equals) in a one-chunk *slab*; the rest of the stretch stays free;
- **medium** (up to 2 chunks, and only if rounding it up to whole chunks would waste more than
  ``pack_waste`` = 1/4 of it, e.g. 2.25 MiB -> 4 MiB): best fit in 5-chunk slabs, as PyTorch
  packs 1-10 MiB blocks into 20 MiB segments;
- **large** (anything else): the virtual-range path, k = ceil(n / c) chunks from wherever
  they are, mapped back to back onto one contiguous range. That is GMLake's *stitching*
  (Guo et al., ASPLOS'24): physically scattered free chunks serve one large tensor, so a
  large request never fails or grows the footprint for lack of a contiguous hole. Packed
  blocks never span slabs (stitching a 4 KiB block would save nothing).

A slab is one allocation of the virtual allocator (same physical pool, same budget). A freed
block **coalesces** with its free neighbours; when a slab's blocks are all free the slab goes
back to the virtual allocator at once (parked mapped or unmapped, as its ``keep_mapped``
says), where any request can take its chunks. The **tail** of a large range (the bytes of its
last chunk past the request) is a slab too: small blocks fill it. When the large block is
freed while small blocks still live in its tail, every chunk of the range but the last is
unmapped and given back (:meth:`vmm.VirtualAllocator.release_head`), and the last stays as an
ordinary one-chunk slab until its blocks go.

Why these (benchmarks/results/frag.md, peak reserved on model steps, swap schedules, a
many-small-tensor CNN and a transformer with a growing KV cache): packing everything below a
chunk beats packing below half a chunk (a 1.2 MiB tensor no longer takes 2 MiB); tails
filled with small blocks remove most of the rounding loss of large tensors (ResNet's 2.25 and
4.5 MiB activations); the medium tier removes the rest where small tensors are too few to fill
the tails, and only where rounding wastes over a quarter (packing requests that round well
fragments the slabs: 4-10% more on a swap schedule).

The bound (what the tests check), with B_t the live blocks packed in tier t, s_t its slab
size and L the live large allocations, at every moment:

    mapped_bytes = sum over L of (chunks still mapped) x c + sum over t of (slabs of t) x s_t
    slabs of t <= B_t          (a slab with no live block is given back at once)
    => mapped_bytes <= sum over L of ceil(n / c) x c + sum over t of B_t x s_t

and nothing is mapped once everything is freed. No non-moving allocator bounds the slabs
by the live *bytes* after an adversarial order of frees (one live block per slab); what
best fit adds is that a slab is opened only when no free stretch of its tier fits.

Addresses: a large allocation's address is a multiple of the backend granularity; a small
block's, of ``align``. Not thread-safe (callers hold one lock, as for the virtual allocator).
"""

from bisect import bisect_left
from typing import Sequence

from vmm.allocation import Allocation, AllocationError
from vmm.errors import OutOfBudget
from vmm.small_slabs import SmallBlock, _check_exports, _Free, _Slab, _Tier
from vmm.units import format_size
from vmm.virtual import VirtualAllocator

__all__ = ["SmallBlockAllocator", "SmallBlock", "DEFAULT_ALIGN", "DEFAULT_PACK_WASTE",
           "default_tiers"]

DEFAULT_ALIGN = 512
DEFAULT_PACK_WASTE = 0.25


def default_tiers(chunk: int, align: int = DEFAULT_ALIGN) -> tuple[tuple[int, int], ...]:
    """The tiers ooc's allocator uses with chunks of ``chunk`` bytes, as ``(limit, slab)``
    pairs (measured on the traces of benchmarks/bench_frag.py, see the module docstring):
    every request below a chunk into one-chunk slabs, those up to 2 chunks that round badly
    into 5-chunk slabs. None where a chunk holds fewer than two blocks of ``align``."""
    if chunk < 2 * align:
        return ()
    return ((chunk - align, chunk), (2 * chunk, 5 * chunk))

class SmallBlockAllocator:
    """ooc's allocator: small requests packed into chunks, large ones as stitched virtual
    ranges (see the module docstring for the rules and the bound).

    Args:
        virtual: the :class:`vmm.VirtualAllocator` both paths take chunks from (its pool is
            the budget).
        tiers: ``(limit, slab)`` pairs, limits growing: a request of at most ``limit``
            bytes (and above the previous limit) is packed into slabs of ``slab`` bytes
            (whole chunks, above the limit); default :func:`default_tiers`. ``threshold``
            is the last limit: larger requests take the virtual-range path.
        align: packed blocks' size and address are multiples of it (a power of two dividing
            the chunk; 512 by default; the page where I/O needs O_DIRECT alignment).
        pack_waste: a request above the first tier's limit is packed only if rounding it up
            to whole chunks would waste more than this fraction of it.
        pack_tails: let small blocks fill the unused tail of large ranges (default). Saves
            memory where small tensors are few (ResNet-18's step: 204 vs 212 MiB), but a
            tail block outliving its range costs an unmap and a later map of that range's
            other chunks (benchmarks/results/frag.md: 297k map calls per 1M swap events,
            1.7k without).

    Same interface as :class:`vmm.VirtualAllocator` for callers and for ``vmm.replay``:
    ``alloc``, ``free``, ``trim``, ``close``, ``largest_fit``, ``stats`` and the plain
    counters ``requested_bytes`` / ``mapped_bytes`` / ``map_calls`` / ``unmap_calls``.
    ``mapped_bytes`` counts a chunk under small blocks whole: what the device holds for them.
    """

    def __init__(self, virtual: VirtualAllocator, *,
                 tiers: Sequence[tuple[int, int]] | None = None, align: int = DEFAULT_ALIGN,
                 pack_waste: float = DEFAULT_PACK_WASTE, pack_tails: bool = True) -> None:
        chunk = virtual.chunk_bytes
        if tiers is None:
            tiers = default_tiers(chunk, align)
        if align <= 0 or align & (align - 1) or chunk % align:
            raise ValueError(f"align {align} must be a power of two dividing the chunk ({chunk} B)")
        last = 0
        for limit, slab in tiers:
            if not last < limit < slab or slab % chunk or limit % align:
                raise ValueError(f"tier ({limit} B, slab {slab} B): limits must grow, be multiples "
                                 f"of {align} B and each below its slab, slabs whole chunks of "
                                 f"{chunk} B")
            last = limit
        self.virtual = virtual
        self.pool = virtual.pool
        self.backend = virtual.backend
        self.chunk_bytes = chunk
        self.tiers = tuple(_Tier(limit, slab) for limit, slab in tiers)
        self.threshold = last     # requests above it take the virtual-range path
        self._first_limit = self.tiers[0].limit if self.tiers else 0
        self.pack_waste = pack_waste
        self.pack_tails = pack_tails
        self.align = align
        self.alignment = align   # what every address is a multiple of (small blocks included)
        self.requested_bytes = 0
        self.peak_requested_bytes = 0
        self.small_requested_bytes = 0
        self.small_block_bytes = 0    # rounded sizes of live small blocks
        self.small_blocks = 0
        self.small_chunks = 0         # chunks under slabs
        self.peak_small_chunks = 0
        self.small_allocs = 0
        self.small_chunk_opens = 0    # slabs opened
        self.tail_blocks = 0          # small blocks placed in large allocations' last chunks
        self._slab_allocations = 0    # virtual allocations held for small blocks only
        self._tails: dict[int, _Slab] = {}   # id(large allocation) -> its tail slab
        self.peak_allocations = 0

    # -- counters of the virtual allocator (one physical pool, one count) -------------------
    @property
    def mapped_bytes(self) -> int:
        return self.virtual.mapped_bytes

    @property
    def map_calls(self) -> int:
        return self.virtual.map_calls

    @property
    def unmap_calls(self) -> int:
        return self.virtual.unmap_calls

    @property
    def live_allocations(self) -> int:
        return self.virtual.live_allocations - self._slab_allocations + self.small_blocks

    # -- public API ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Allocation | SmallBlock:
        """A packed block if ``0 < nbytes <= threshold`` (and, above the first tier, if whole
        chunks would waste more than ``pack_waste`` of it), else a virtual range (see the
        module doc). A medium request whose slab does not fit the budget takes the virtual
        path, so a request fails only when its whole chunks do not fit."""
        if 0 < nbytes <= self.threshold and (
                nbytes <= self._first_limit or -nbytes % self.chunk_bytes > self.pack_waste * nbytes):
            try:
                out: Allocation | SmallBlock = self._alloc_small(nbytes)
            except OutOfBudget:
                if nbytes <= self._first_limit:
                    raise
                out = self._alloc_large(nbytes)
        else:
            out = self._alloc_large(nbytes)
        r = self.requested_bytes = self.requested_bytes + nbytes
        if r > self.peak_requested_bytes:
            self.peak_requested_bytes = r
        n = self.virtual.live_allocations - self._slab_allocations + self.small_blocks
        if n > self.peak_allocations:
            self.peak_allocations = n
        return out

    def _alloc_large(self, nbytes: int) -> Allocation:
        out = self.virtual.alloc(nbytes)
        a = self.align
        used = (nbytes + a - 1) & -a
        if nbytes > 0 and out.mapped_bytes - used >= a and self.tiers and self.pack_tails:
            # The unused end of the last chunk takes small blocks (a tail slab).
            chunk = self.chunk_bytes
            base = out.mapped_bytes - chunk
            tier = self.tiers[0]
            slab = self._tails[id(out)] = _Slab(out, self, tier, base, chunk, used - base)
            slab.used = used - base
            f = _Free(slab, used, out.mapped_bytes - used)
            slab.free[used] = f
            slab.ends[out.mapped_bytes] = f
            tier.index(f)
        return out

    def free(self, handle: Allocation | SmallBlock) -> None:
        """Free a block or a range; a chunk whose small blocks are all free goes back."""
        if type(handle) is not SmallBlock:
            slab = self._tails.pop(id(handle), None) if handle._range is not None else None
            if slab is None or slab.used == slab.head:   # no small block in its tail
                if slab is not None:
                    self._drop_slab(slab)
                self.virtual.free(handle)
                self.requested_bytes -= handle.nbytes
                return
            # 3. the large block goes, small blocks in its tail stay: keep the last chunk
            # (a one-chunk slab of its own from now on), unmap the others.
            self.virtual.release_head(handle)
            self.requested_bytes -= handle.nbytes
            head, slab.head = slab.head, 0
            slab.tier.slabs += 1
            self.small_chunks += 1
            self._slab_allocations += 1
            self._release(slab, slab.base, head)
            return
        slab = handle._slab
        if slab is None:
            raise AllocationError(f"double free of the small block at 0x{handle.address:x} "
                                  f"({format_size(handle.nbytes)})")
        if slab.owner is not self:
            raise AllocationError(f"free of {handle!r}, which belongs to another allocator")
        if handle._exports:
            _check_exports(handle)
        handle._slab = None
        size = handle.mapped_bytes
        self.requested_bytes -= handle.nbytes
        self.small_requested_bytes -= handle.nbytes
        self.small_block_bytes -= size
        self.small_blocks -= 1
        if slab.head:
            self.tail_blocks -= 1
        self._release(slab, handle.address - slab.allocation.address, size)

    def _release(self, slab: _Slab, offset: int, size: int) -> None:
        """Make ``[offset, offset + size)`` of a slab free again."""
        slab.used -= size
        if slab.used == 0:
            # 2. the chunk's blocks are all free: give it back whole (no coalescing needed).
            self._drop_slab(slab)
            slab.tier.slabs -= 1
            self.small_chunks -= slab.total // self.chunk_bytes
            self._slab_allocations -= 1
            self.virtual.free(slab.allocation)
            return
        # 1. coalesce with the free neighbours in the chunk, then index the merged stretch.
        end = offset + size
        nxt = slab.free.pop(end, None)
        if nxt is not None:
            del slab.ends[end + nxt.size]
            slab.tier.unindex(nxt)
            size += nxt.size
        prev = slab.ends.pop(offset, None)
        if prev is not None:
            slab.tier.unindex(prev)
            prev.size += size
        else:
            prev = _Free(slab, offset, size)
            slab.free[offset] = prev
        slab.ends[prev.offset + prev.size] = prev
        slab.tier.index(prev)

    @staticmethod
    def _drop_slab(slab: _Slab) -> None:
        for f in slab.free.values():
            slab.tier.unindex(f)
        slab.free.clear()
        slab.ends.clear()

    def largest_fit(self) -> int:
        """Bytes of the largest request that would succeed now (a free chunk's worth or a
        small block's, whichever is larger)."""
        free = max((min(max(t.sizes[-1:] + t.tsizes[-1:]), t.limit) for t in self.tiers
                    if t.sizes or t.tsizes), default=0)
        return max(self.virtual.largest_fit(), free)

    def trim(self, limit: int | None = None) -> int:
        """As :meth:`vmm.VirtualAllocator.trim`: chunks under small blocks are in use."""
        return self.virtual.trim(limit)

    def close(self) -> None:
        if self.small_blocks:
            raise AllocationError(f"close() with {self.small_blocks} live small block(s) "
                                  f"({format_size(self.small_requested_bytes)}): free them first")
        self.virtual.close()

    def check(self) -> None:
        """Verify the invariants (for tests); raises AssertionError if broken."""
        self.virtual.check()
        chunks = 0
        for tier in self.tiers:
            slabs = {f.slab for by in (tier.by_size, tier.tby_size) for bucket in by.values()
                     for f in bucket.values()}
            for slab in slabs:
                assert slab.used > 0 and slab.allocation.live and slab.tier is tier
                free = sum(f.size for f in slab.free.values())
                assert {f.offset + f.size: f for f in slab.free.values()} == slab.ends
                assert free + slab.used == slab.total, (free, slab.used)
                assert all(slab.base <= f.offset < slab.base + slab.total for f in slab.free.values())
            assert sorted(tier.by_size) == tier.sizes and sorted(tier.tby_size) == tier.tsizes
            assert all(f.slab.tail for b in tier.tby_size.values() for f in b.values())
            assert not any(f.slab.tail for b in tier.by_size.values() for f in b.values())
            own = [s for s in slabs if not s.head]
            assert len(own) <= tier.slabs
            chunks += tier.slabs * tier.slab_bytes // self.chunk_bytes
        assert chunks == self.small_chunks
        assert sum(t.slabs for t in self.tiers) <= self.small_blocks

    def stats(self) -> dict[str, int]:
        """The virtual allocator's :meth:`~vmm.VirtualAllocator.stats` with the requests of
        both paths in ``requested_bytes``/``allocations``, plus: ``small_blocks`` (live),
        ``small_chunks`` (chunks under them), ``peak_small_chunks``, ``small_requested_bytes``,
        ``small_block_bytes`` (rounded sizes), ``small_free_bytes`` (free stretches inside
        small chunks), ``small_allocs``, ``small_chunk_opens`` and ``threshold_bytes``."""
        st = self.virtual.stats()
        st["requested_bytes"] = self.requested_bytes
        st["peak_requested_bytes"] = self.peak_requested_bytes
        st["internal_fragmentation_bytes"] = self.mapped_bytes - self.requested_bytes
        st["allocations"] = self.live_allocations
        st["peak_allocations"] = self.peak_allocations
        st["largest_fit_bytes"] = self.largest_fit()
        st.update(small_blocks=self.small_blocks, small_chunks=self.small_chunks,
                  peak_small_chunks=self.peak_small_chunks,
                  small_requested_bytes=self.small_requested_bytes,
                  small_block_bytes=self.small_block_bytes,
                  small_free_bytes=self.small_chunks * self.chunk_bytes - self.small_block_bytes,
                  small_allocs=self.small_allocs, small_chunk_opens=self.small_chunk_opens,
                  tail_blocks=self.tail_blocks,
                  threshold_bytes=self.threshold)
        return st

    def __repr__(self) -> str:
        return (f"<SmallBlockAllocator {self.small_blocks} small blocks in {self.small_chunks} "
                f"chunks (<= {format_size(self.threshold)}), {self.virtual!r}>")

    # -- the small path -----------------------------------------------------------------------
    def _alloc_small(self, nbytes: int) -> SmallBlock:
        a = self.align
        size = (nbytes + a - 1) & -a
        for tier in self.tiers:    # nbytes <= threshold, a multiple of align: one fits
            if size <= tier.limit:
                break
        # Best fit in the tier's own slabs first, then in the tails of large ranges: a block
        # in a tail keeps that chunk mapped after the large block goes (release_head, an
        # unmap and later a map), so tails take only what no slab can.
        sizes, by_size = tier.sizes, tier.by_size
        i = bisect_left(sizes, size)
        if i == len(sizes):
            sizes, by_size = tier.tsizes, tier.tby_size
            i = bisect_left(sizes, size)
        if i < len(sizes):
            have = sizes[i]
            bucket = by_size[have]
            _, f = bucket.popitem()        # best fit; among equals the one freed last
            if not bucket:
                del by_size[have]
                del sizes[i]
            slab = f.slab
            offset = f.offset
            del slab.free[offset]
            if have > size:                # split: the rest stays free (same end)
                f.offset += size
                f.size -= size
                slab.free[f.offset] = f
                tier.index(f)
            else:
                del slab.ends[offset + have]
        else:
            whole = tier.slab_bytes
            allocation = self.virtual.alloc(whole)   # may raise BudgetExceeded
            slab = _Slab(allocation, self, tier)
            tier.slabs += 1
            self._slab_allocations += 1
            self.small_chunks += whole // self.chunk_bytes
            self.small_chunk_opens += 1
            if self.small_chunks > self.peak_small_chunks:
                self.peak_small_chunks = self.small_chunks
            offset = 0
            f = _Free(slab, size, whole - size)
            slab.free[size] = f
            slab.ends[whole] = f
            tier.index(f)
        slab.used += size
        if slab.head:
            self.tail_blocks += 1
        self.small_allocs += 1
        self.small_blocks += 1
        self.small_requested_bytes += nbytes
        self.small_block_bytes += size
        return SmallBlock(slab.allocation.address + offset, nbytes, size, slab)
