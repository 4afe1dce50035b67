"""The medium tier of ooc's allocator: blocks of one to a few chunks in sparse slabs.

Why a module of its own: the placement rule is what makes the medium tier safe for a pool that
runs a plan (a block of k chunks' worth never puts more than k chunks in use, so a plan made
with sizes rounded up to whole chunks fits), and it reads best apart from the small tier's
best fit (:mod:`vmm.small_blocks`). ``alloc_medium`` carves a block from a tier's slabs (the
tier's free stretches and slabs are its state, :mod:`vmm.small_slabs`); the allocator that
calls it counts what it returns.
"""

from bisect import bisect_left
from typing import Any

from vmm.small_slabs import SmallBlock, _Free, _Slab, _Tier, add_free


def alloc_medium(virtual: Any, owner: Any, nbytes: int, size: int, tier: _Tier) -> tuple[SmallBlock, int, bool]:
    """A block of ``nbytes`` (``size`` rounded) from ``tier``'s sparse slabs over ``virtual``
    (``owner``: the allocator its slabs belong to), and what it changed for the allocator's
    counters: the chunks it put newly in use, and whether it opened a slab.

    A block of ``size`` (rounded) bytes in a slab of several chunks, in use only where
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
    c = virtual.chunk_bytes
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
    v = virtual
    if best is None:
        rng = v.sparse_range(tier.slab_bytes // c)
        try:
            new = v.touch(rng, 0, k - 1, nbytes)
        except BaseException:
            v.release_sparse(rng)
            raise
        slab = _Slab(rng, owner, tier)
        tier.slabs += 1
        add_free(slab, size, slab.total - size)
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
            add_free(slab, o, x - o)
        if x + size < end:
            add_free(slab, x + size, end - x - size)
    slab.used += size
    return SmallBlock(rng.address + x, nbytes, size, slab), new, best is None
