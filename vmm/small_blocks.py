"""ooc's allocator: a small-block pool in front of virtual addressing.

Pure virtual addressing (:class:`vmm.VirtualAllocator`) rounds every request up to whole
chunks: no external fragmentation, but a 4 KiB tensor costs a 2 MiB chunk, so a program of
many small tensors reserves several times its live bytes (a scientific CNN snapshot: 2.11x
at 2 MiB chunks, 14x at 20 MiB). :class:`SmallBlockAllocator` keeps the chunk design for
what it is good at and packs what it is bad at:

Three paths, by size (chunk c = 2 MiB in the defaults, :func:`default_tiers`):

- **small** (below a chunk, ``c - 512``): rounded up to ``align`` bytes (512, PyTorch's
  ``kMinBlockSize``) and placed **best fit** (the smallest free stretch that is large enough,
  the one freed last among equals) in a one-chunk *slab*; the rest of the stretch stays free.
  A request that no stretch fits starts a new chunk, as a one-chunk range of its own whose
  rest takes the next blocks: the slab is made when one lands (the same layout as a slab
  opened for it, without a slab's bookkeeping for the many chunks that never get a second);
- **medium** (up to 4 chunks, and only if rounding it up to whole chunks would waste more than
  ``pack_waste`` = 1/4 of it, e.g. 2.25 MiB -> 4 MiB): placed in 10-chunk *sparse* slabs
  (:mod:`vmm.sparse_ranges`), reserved address space whose chunks are in use only where a
  block lies, and placed so that a block of n bytes touches exactly ceil(n / c) chunks (it
  starts at most ceil(n / c) x c - n bytes into a chunk). Two blocks that share a chunk save
  one: four 2.25 MiB blocks side by side take 5 chunks, not 8. Among the places allowed, the
  one that puts the fewest chunks newly in use, then best fit;
- **large** (anything else): the virtual-range path, k = ceil(n / c) chunks from wherever
  they are, mapped back to back onto one contiguous range. That is GMLake's *stitching*
  (Guo et al., ASPLOS'24): physically scattered free chunks serve one large tensor, so a
  large request never fails or grows the footprint for lack of a contiguous hole. Packed
  blocks never span slabs (stitching a 4 KiB block would save nothing).

A one-chunk slab is one allocation of the virtual allocator (same physical pool, same
budget), a sparse slab a sparse range of it (same pool too). A freed block **coalesces** with
its free neighbours; when a one-chunk slab's blocks are all free the slab goes back to the
virtual allocator at once (parked mapped or unmapped, as its ``keep_mapped`` says), where any
request can take its chunks; a chunk of a sparse slab that no block touches any more goes idle
at once (mapped, counted free, taken back by the next block there or by any request that needs
chunks). The **tail** of a large range (the bytes of its
last chunk past the request) is a slab too: small blocks fill it, after the slabs' stretches.
When the large block is freed while small blocks still live in its tail, the last chunk stays
as an ordinary one-chunk slab until its blocks go, and the others stay mapped but idle
(:mod:`vmm.range_heads`: counted as free, taken by a request that needs chunks, else parked
with the range when its tail empties, so that the next request of its size maps nothing).

Why these (benchmarks/results/frag.md, peak reserved on model steps, swap schedules, a
many-small-tensor CNN and a transformer with a growing KV cache): packing everything below a
chunk beats packing below half a chunk (a 1.2 MiB tensor no longer takes 2 MiB); tails
filled with small blocks remove most of the rounding loss of large tensors (ResNet's 2.25 and
4.5 MiB activations); the medium tier removes the rest where small tensors are too few to fill
the tails. Its slabs are sparse so that it never costs more chunks than whole chunks per
request: with 5-chunk slabs mapped whole, one slab could keep 5 chunks for one live 2-chunk
tensor, more than a plan made with chunk-rounded sizes counted (a planned swap-in of GPT-2 at a
quarter of its peak ran out of the runtime's pool), so the runtime ran without the tier and
missed two footprint targets (resnet18 step 214 MiB for 206, gpt2 step 7.38 GiB for 7.36).

The bound (what the tests check): every chunk in use lies under a live large allocation
(ceil(n / c) of them at most), is a one-chunk slab under at least one live small block, or is
touched by live blocks of a sparse slab, each of which touches ceil(n / c) chunks; a tail adds
no chunk. So at every moment

    mapped_bytes <= sum over live requests of ceil(n / c) x c

(what pure chunks would map: a plan made with sizes rounded up to whole chunks fits the pool),
and nothing is in use once everything is freed. No non-moving allocator bounds the slabs by
the live *bytes* after an adversarial order of frees (one live block per slab); what best fit
adds is that a slab is opened only when no free stretch of its tier fits.

Addresses: a large allocation's address is a multiple of the backend granularity; a small
block's, of ``align``. Not thread-safe (callers hold one lock, as for the virtual allocator).
"""

from bisect import bisect_left
from typing import Sequence

from vmm.allocation import Allocation, AllocationError
from vmm.medium_blocks import alloc_medium
from vmm.small_slabs import (DEFAULT_ALIGN, DEFAULT_PACK_WASTE, SmallBlock, _check_exports, _check_packing,
                             _Free, _make_tiers, _packing_stats, _Slab, _Tier, default_tiers)
from vmm.units import format_size
from vmm.virtual import VirtualAllocator

__all__ = ["SmallBlockAllocator", "SmallBlock", "DEFAULT_ALIGN", "DEFAULT_PACK_WASTE",
           "default_tiers"]

class SmallBlockAllocator:
    """ooc's allocator: small requests packed into chunks, large ones as stitched virtual
    ranges (see the module docstring for the rules and the bound).

    Args:
        virtual: the :class:`vmm.VirtualAllocator` both paths take chunks from (its pool is
            the budget).
        tiers: ``(limit, slab)`` pairs, limits growing: a request of at most ``limit``
            bytes (and above the previous limit) is packed into slabs of ``slab`` bytes
            (whole chunks, above the limit: the first tier's one chunk, the others' sparse);
            default :func:`default_tiers`. ``threshold`` is the last limit: larger requests
            take the virtual-range path.
        align: packed blocks' size and address are multiples of it (a power of two dividing
            the chunk; 512 by default; the page where I/O needs O_DIRECT alignment).
        pack_waste: a request above the first tier's limit is packed only if rounding it up
            to whole chunks would waste more than this fraction of it.
        pack_tails: let small blocks fill the unused tail of ranges of several chunks
            (default). Saves memory where small tensors are few (ResNet-18's step: 204 vs
            212 MiB); a tail block outliving its range keeps that range out of reuse until
            it goes (its other chunks idle, :mod:`vmm.range_heads`).

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
        self.virtual = virtual
        self.pool = virtual.pool
        self.backend = virtual.backend
        self.chunk_bytes = chunk
        self.tiers = _make_tiers(tiers, chunk, align)
        self.threshold = self.tiers[-1].limit if self.tiers else 0   # above: virtual ranges
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
        # large allocation -> its tail: the free stretch (no block yet) or the slab.
        self._tails: dict[Allocation, _Free | _Slab] = {}
        self._tier0 = self.tiers[0] if self.tiers else None
        self.live_allocations = 0
        self.peak_allocations = 0
        # The virtual allocator's, copied after each of its calls (replay reads it per event;
        # a plain attribute, not a property): chunks under live blocks and slabs.
        self.mapped_bytes = virtual.mapped_bytes

    # -- counters of the virtual allocator (one physical pool, one count) -------------------
    @property
    def map_calls(self) -> int:
        return self.virtual.map_calls

    @property
    def unmap_calls(self) -> int:
        return self.virtual.unmap_calls

    # -- public API ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Allocation | SmallBlock:
        """A packed block if ``0 < nbytes <= threshold`` (and, above the first tier, if whole
        chunks would waste more than ``pack_waste`` of it), else a virtual range (see the
        module doc). A medium block needs at most its whole chunks (fewer where it shares a
        chunk), so a request fails only when its whole chunks do not fit."""
        out: Allocation | SmallBlock | None = None
        if nbytes <= self.threshold and nbytes > 0 and (
                nbytes <= self._first_limit or -nbytes % self.chunk_bytes > self.pack_waste * nbytes):
            out = self._alloc_small(nbytes)   # None: no stretch fits, a new chunk (below)
        if out is None:
            # The virtual-range path (inline: most requests of a replay take it).
            v = self.virtual
            out = v.alloc(nbytes)
            self.mapped_bytes = v.mapped_bytes
            a = self.align
            end = out.mapped_bytes
            free = end - ((nbytes + a - 1) & -a)
            t = self._tier0
            if free >= a and t is not None:
                # The unused end of the last chunk takes small blocks: one free stretch,
                # indexed now; its slab is made when a block first lands there (most tails
                # get none). A one-chunk range's is searched with the slabs' (it is a slab
                # opened by its first block); a longer range's after them, and only with
                # ``pack_tails``.
                tail = end > self.chunk_bytes
                if not tail or self.pack_tails:
                    f = self._tails[out] = _Free(out, end - free, free)
                    t.index(f, tail)
        r = self.requested_bytes = self.requested_bytes + nbytes
        if r > self.peak_requested_bytes:
            self.peak_requested_bytes = r
        n = self.live_allocations = self.live_allocations + 1
        if n > self.peak_allocations:
            self.peak_allocations = n
        return out

    def _open_tail(self, f: _Free, tier: _Tier) -> _Slab:
        """The slab of a large range's tail, made when its first block lands (``f``: the
        tail's free stretch, whose ``slab`` was the allocation until now)."""
        out = f.slab
        end = out.mapped_bytes
        base = end - self.chunk_bytes
        slab = f.slab = self._tails[out] = _Slab(out, self, tier, base, self.chunk_bytes,
                                                     f.offset - base, end > self.chunk_bytes)
        slab.used = f.offset - base
        slab.free[f.offset] = f
        slab.ends[end] = f
        return slab

    def free(self, handle: Allocation | SmallBlock) -> None:
        """Free a block or a range; a chunk whose small blocks are all free goes back."""
        if type(handle) is not SmallBlock:
            v = self.virtual
            # (Every key of _tails is a live allocation, kept alive by its entry: a freed or
            # foreign handle is not found, and the virtual allocator refuses it.)
            tail = self._tails.pop(handle, None)
            if tail is None:
                v.free(handle)
            elif type(tail) is _Free:           # no block ever landed in its tail
                self._tier0.unindex(tail, handle.mapped_bytes > self.chunk_bytes)
                v.free(handle)
            elif tail.used == tail.head:        # none lives there now
                self._drop_slab(tail)
                v.free(handle)
            else:
                # 3. the large block goes, small blocks in its tail stay: the last chunk is a
                # one-chunk slab of its own from now on, the others are idle (vmm.range_heads).
                v.retire_head(handle)
                head, tail.head = tail.head, 0
                tail.tier.slabs += 1
                self.small_chunks += 1
                self._release(tail, tail.base, head)
            self.mapped_bytes = v.mapped_bytes
            self.requested_bytes -= handle.nbytes
            self.live_allocations -= 1
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
        self.live_allocations -= 1
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
        if slab.tier.sparse:
            # The chunks no other block touches go back now (vmm.sparse_ranges).
            c = self.chunk_bytes
            self.small_chunks -= self.virtual.untouch(slab.allocation, offset // c,
                                                      (offset + size - 1) // c)
            self.mapped_bytes = self.virtual.mapped_bytes
        if slab.used == 0:
            # 2. the slab's blocks are all free: give it back whole (no coalescing needed).
            self._drop_slab(slab)
            slab.tier.slabs -= 1
            if slab.tier.sparse:
                self.virtual.release_sparse(slab.allocation)   # nothing mapped any more
                return
            self.small_chunks -= slab.total // self.chunk_bytes
            self.virtual.free(slab.allocation)
            self.mapped_bytes = self.virtual.mapped_bytes
            return
        # 1. coalesce with the free neighbours in the chunk, then index the merged stretch.
        end = offset + size
        nxt = slab.free.pop(end, None)
        if nxt is not None:
            del slab.ends[end + nxt.size]
            slab.tier.unindex(nxt, slab.tail)
            size += nxt.size
        prev = slab.ends.pop(offset, None)
        if prev is not None:
            slab.tier.unindex(prev, slab.tail)
            prev.size += size
        else:
            prev = _Free(slab, offset, size)
            slab.free[offset] = prev
        slab.ends[prev.offset + prev.size] = prev
        slab.tier.index(prev, slab.tail)

    @staticmethod
    def _drop_slab(slab: _Slab) -> None:
        for f in slab.free.values():
            slab.tier.unindex(f, slab.tail)
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
        _check_packing(self)

    def stats(self) -> dict[str, int]:
        """The virtual allocator's :meth:`~vmm.VirtualAllocator.stats` with the requests of
        both paths in ``requested_bytes``/``allocations``, plus: ``small_blocks`` (live),
        ``small_chunks`` (chunks under them), ``peak_small_chunks``, ``small_requested_bytes``,
        ``small_block_bytes`` (rounded sizes), ``small_free_bytes`` (free stretches inside
        small chunks), ``small_allocs``, ``small_chunk_opens`` and ``threshold_bytes``."""
        return _packing_stats(self, self.virtual.stats())

    def __repr__(self) -> str:
        return (f"<SmallBlockAllocator {self.small_blocks} small blocks in {self.small_chunks} "
                f"chunks (<= {format_size(self.threshold)}), {self.virtual!r}>")

    # -- the small path -----------------------------------------------------------------------
    def _alloc_small(self, nbytes: int) -> SmallBlock | None:
        """A block in a slab or a tail, or None where none has room: then the block starts a
        new chunk, as a one-chunk range (``alloc``'s virtual path) whose rest takes small
        blocks as a slab's would (the slab is made if one lands, :meth:`_open_tail`)."""
        a = self.align
        size = (nbytes + a - 1) & -a
        tier = self._tier0
        if size > tier.limit:
            for tier in self.tiers:    # nbytes <= threshold, a multiple of align: one fits
                if size <= tier.limit:
                    break
            block, new, opened = alloc_medium(self.virtual, self, nbytes, size, tier)
            self.mapped_bytes = self.virtual.mapped_bytes
            self.small_chunks += new
            if self.small_chunks > self.peak_small_chunks:
                self.peak_small_chunks = self.small_chunks
            self.small_chunk_opens += opened
            self._count(block)
            return block
        # Best fit in the tier's own slabs first, then in the tails of large ranges: a block
        # in a tail keeps that chunk in use after the large block goes (and the range out of
        # reuse until it goes too), so tails take only what no slab can.
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
            if type(slab) is not _Slab:    # the first block in a large range's tail
                slab = self._open_tail(f, tier)
            offset = f.offset
            del slab.free[offset]
            if have > size:                # split: the rest stays free (same end)
                f.offset += size
                f.size -= size
                slab.free[f.offset] = f
                tier.index(f, slab.tail)
            else:
                del slab.ends[offset + have]
        else:
            return None
        slab.used += size
        if slab.head:
            self.tail_blocks += 1
        return self._count(SmallBlock(slab.allocation.address + offset, nbytes, size, slab))

    def _count(self, block: SmallBlock) -> SmallBlock:
        self.small_allocs += 1
        self.small_blocks += 1
        self.small_requested_bytes += block.nbytes
        self.small_block_bytes += block.mapped_bytes
        return block
