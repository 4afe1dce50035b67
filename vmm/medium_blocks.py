"""The medium tier of ooc's allocator: blocks of one to a few chunks in sparse slabs.

Why a module of its own: the placement rule is what makes the medium tier safe for a pool that
runs a plan (a block of k chunks' worth never puts more than k chunks in use, so a plan made
with sizes rounded up to whole chunks fits), and it reads best apart from the small tier's
best fit (:mod:`vmm.small_blocks`, whose allocator this mixin is part of).
"""

from bisect import bisect_left

from vmm.small_slabs import SmallBlock, _Free, _Slab, _Tier


class MediumBlocks:
    """``SmallBlockAllocator``'s medium tier (a mixin over its ``virtual`` allocator, chunk
    size and counters)."""

    def _alloc_sparse(self, nbytes: int, size: int, tier: _Tier) -> SmallBlock:
        """A block of ``size`` (rounded) bytes in a slab of several chunks, in use only where
        blocks lie (:mod:`vmm.sparse_ranges`). The block starts at most ``k x c - size``
        bytes into a chunk (k = ceil(size / c)), so it touches k chunks, no more than whole
        chunks of its own would map. Among the free stretches where it can go, the place that
        puts the fewest chunks newly in use (sharing a chunk with a neighbour), then the
        smallest stretch (best fit), then the one freed last; a new slab only if no stretch
        can take it. Of each stretch two places are tried: as near its start, and as near its
        end, as the rule allows (the rest of the stretch stays one or two free stretches).

        Small blocks are not placed beside medium ones (in the unused end of their chunks):
        measured on bench_frag's traces it saved as much as it cost (resnet18 plan 1/4 +2 MiB,
        unet step -4 MiB, within 4 MiB on every trace)."""
        c = self.chunk_bytes
        k = -(-size // c)
        slack = k * c - size
        best: _Free | None = None
        best_new = k + 1
        best_at = 0
        sizes, by_size = tier.sizes, tier.by_size
        for i in range(bisect_left(sizes, size), len(sizes)):
            have = sizes[i]
            for f in reversed(by_size[have].values()):
                o = f.offset
                q = o + have - size      # the last start inside the stretch
                r = o % c
                p = o if r <= slack else o - r + c
                if p > q:
                    continue
                # The chunks the block would put newly in use: those no block touches yet.
                touch = f.slab.allocation.touch
                new = touch[p // c:(p + size - 1) // c + 1].count(0)
                if new < best_new:
                    best, best_new, best_at = f, new, p
                r = q % c
                e = q if r <= slack else q - r + slack
                if e != p:
                    new = touch[e // c:(e + size - 1) // c + 1].count(0)
                    if new < best_new:
                        best, best_new, best_at = f, new, e
                if not best_new:
                    break
            if not best_new:
                break
        v = self.virtual
        if best is None:
            rng = v.sparse_range(tier.slab_bytes // c)
            try:
                new = v.touch(rng, 0, k - 1, nbytes)
            except BaseException:
                v.release_sparse(rng)
                raise
            slab = _Slab(rng, self, tier)
            tier.slabs += 1
            self.small_chunk_opens += 1
            self._add_free(slab, size, slab.total - size)
            x = 0
        else:
            slab, x = best.slab, best_at
            rng = slab.allocation
            new = v.touch(rng, x // c, (x + size - 1) // c, nbytes)   # may raise: nothing changed
            o, end = best.offset, best.offset + best.size
            del slab.free[o]
            del slab.ends[end]
            tier.unindex(best, False)
            if x > o:
                self._add_free(slab, o, x - o)
            if x + size < end:
                self._add_free(slab, x + size, end - x - size)
        self.mapped_bytes = v.mapped_bytes
        self.small_chunks += new
        if self.small_chunks > self.peak_small_chunks:
            self.peak_small_chunks = self.small_chunks
        slab.used += size
        self.small_allocs += 1
        self.small_blocks += 1
        self.small_requested_bytes += nbytes
        self.small_block_bytes += size
        return SmallBlock(rng.address + x, nbytes, size, slab)

    @staticmethod
    def _add_free(slab: _Slab, offset: int, size: int) -> None:
        f = _Free(slab, offset, size)
        slab.free[offset] = f
        slab.ends[offset + size] = f
        slab.tier.index(f, False)
