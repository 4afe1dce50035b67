"""CachingAllocator: the known behaviours of PyTorch's CUDACachingAllocator."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmm import CachingAllocator, HostBackend, OutOfBudget, SimBackend
from vmm.caching import CachingAllocatorError, allocation_size, round_size

KiB, MiB = 1 << 10, 1 << 20


def make(capacity: int | None = None, **kw) -> CachingAllocator:
    return CachingAllocator(SimBackend(), capacity, **kw)


def test_rounding_to_512() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1 << 20)] == [
        512, 512, 512, 1024, 1024, 1 << 20]
    ca = make()
    a, b = ca.alloc(1), ca.alloc(513)
    assert (a.size, b.size) == (512, 1024)
    assert b.address == a.address + 512                  # same small segment, packed
    s = ca.stats()
    assert s["requested_bytes"] == 514 and s["allocated_bytes"] == 1536


def test_segment_sizes() -> None:
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB               # <= 1 MiB: small pool, 2 MiB
    assert allocation_size(MiB + 512) == 20 * MiB        # (1 MiB, 10 MiB): 20 MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB         # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MiB + 512) == 12 * MiB


def test_small_and_large_pools_are_separate() -> None:
    ca = make()
    small = ca.alloc(MiB)                                # small pool: 2 MiB segment, 1 MiB left
    large = ca.alloc(MiB + 1)                            # does not use the small remainder
    s = ca.stats()
    assert s["segments"] == 2 and s["reserved_segment_bytes"] == 22 * MiB
    assert s["small_pool_bytes"] == 2 * MiB and s["large_pool_bytes"] == 20 * MiB
    ca.free(large)
    tiny = ca.alloc(1000)                                # small: never from the large pool's 20 MiB
    assert small.address < tiny.address < small.address + 2 * MiB
    ca.free(small)
    ca.free(tiny)


def test_small_pool_split_keeps_a_512_byte_remainder() -> None:
    ca = make()
    a = ca.alloc(MiB)
    b = ca.alloc(MiB - 512)                              # leaves exactly 512 B: split (>= 512)
    assert b.size == MiB - 512
    c = ca.alloc(1)                                      # the 512 B block
    assert c.address == b.address + b.size and ca.stats()["segments"] == 1
    for x in (a, b, c):
        ca.free(x)


def test_large_pool_splits_only_if_more_than_1mib_remains() -> None:
    ca = make()
    a = ca.alloc(19 * MiB)                               # own segment of 20 MiB, 1 MiB left
    assert a.size == 20 * MiB                            # remaining == 1 MiB: not split
    b = ca.alloc(18 * MiB + 512)                         # 20 MiB segment, 2 MiB - 512 left
    assert b.size == 18 * MiB + 512                      # more than 1 MiB: split
    ca2 = make()
    c = ca2.alloc(5 * MiB)                               # 20 MiB segment, 15 MiB left: split
    assert c.size == 5 * MiB
    d = ca2.alloc(14 * MiB - 512)                        # leaves 1 MiB + 512 B: split
    assert d.size == 14 * MiB - 512 and d.address == c.address + 5 * MiB
    e = ca2.alloc(MiB + 512)                             # the remainder, exactly
    assert e.address == d.address + d.size and ca2.stats()["segments"] == 1


def test_best_fit_smallest_block_then_lowest_address() -> None:
    ca = make()
    blocks = [ca.alloc(4 * MiB) for _ in range(4)]       # 16 MiB of a 20 MiB segment
    x = ca.alloc(3 * MiB)                                # the 4 MiB tail -> no split (1 MiB)
    assert x.size == 4 * MiB
    ca.free(blocks[0])                                   # a 4 MiB hole at offset 0
    ca.free(blocks[2])                                   # a 4 MiB hole at offset 8 MiB
    y = ca.alloc(2 * MiB)                                # ties on size: lower address wins
    assert y.address == blocks[0].address
    ca.free(x)                                           # free blocks now: 2, 4, 4 MiB
    z = ca.alloc(2 * MiB)                                # best fit: the 2 MiB rest of hole 0
    assert z.address == blocks[0].address + 2 * MiB


def test_coalescing_with_free_neighbours() -> None:
    ca = make()
    a, b, c = ca.alloc(4 * MiB), ca.alloc(4 * MiB), ca.alloc(4 * MiB)
    ca.free(b)
    ca.free(a)                                           # merges with b
    seg = ca.segments()[0]
    assert [(blk["size"], blk["state"]) for blk in seg["blocks"]] == [
        (8 * MiB, "inactive"), (4 * MiB, "active_allocated"), (8 * MiB, "inactive")]
    ca.free(c)                                           # merges both sides: one block
    seg = ca.segments()[0]
    assert [(blk["size"], blk["state"]) for blk in seg["blocks"]] == [(20 * MiB, "inactive")]
    assert ca.stats()["largest_free_block"] == 20 * MiB


def test_segments_are_cached_until_empty_cache() -> None:
    ca = make()
    a = ca.alloc(30 * MiB)
    ca.free(a)
    s = ca.stats()
    assert s["reserved_segment_bytes"] == 30 * MiB and s["requested_bytes"] == 0
    assert s["chunks_cached"] == 1 and s["chunks_in_use"] == 0
    b = ca.alloc(29 * MiB)                               # reuses the cached segment
    assert b.address == a.address and ca.stats()["map_calls"] == 1
    c = ca.alloc(100)                                    # a small segment, in use
    ca.free(b)
    assert ca.empty_cache() == 30 * MiB                  # only segments with no live block
    s = ca.stats()
    assert s["segments"] == 1 and s["reserved_segment_bytes"] == 2 * MiB
    assert s["unmap_calls"] == 1
    ca.free(c)
    ca.empty_cache()
    assert ca.stats()["reserved_segment_bytes"] == 0 and ca.backend.physical_bytes == 0


def test_fragmentation_reserved_far_above_live() -> None:
    """Growing requests, each freed before the next: no cached block is large enough,
    so every request takes a new segment and reserved memory piles up."""
    ca = make()
    for i in range(10):
        blk = ca.alloc((10 + 2 * i) * MiB)
        ca.free(blk)
    s = ca.stats()
    assert s["peak_requested_bytes"] == 28 * MiB
    assert s["reserved_segment_bytes"] == sum(10 + 2 * i for i in range(10)) * MiB  # 190 MiB
    assert s["reserved_segment_bytes"] > 6 * s["peak_requested_bytes"]


def test_oom_frees_cached_segments_and_retries_once() -> None:
    ca = make(capacity=64 * MiB)
    for size in (20, 22):                                # 42 MiB of segments, all freed
        ca.free(ca.alloc(size * MiB))
    blk = ca.alloc(30 * MiB)                             # no fit, 72 > 64: free cache, retry
    s = ca.stats()
    assert s["num_alloc_retries"] == 1 and s["segments"] == 1
    assert s["reserved_segment_bytes"] == 30 * MiB
    ca.free(blk)


def test_oom_message() -> None:
    ca = make(capacity=40 * MiB)
    a = ca.alloc(30 * MiB)
    with pytest.raises(OutOfBudget) as err:
        ca.alloc(12 * MiB)                               # needs a 12 MiB segment: 42 > 40
    e = err.value
    msg = str(e)
    assert "tried to allocate 12 MiB" in msg and "40 MiB" in msg and "30 MiB reserved" in msg
    assert e.requested == 12 * MiB and e.in_use == 30 * MiB and e.budget == 40 * MiB
    assert e.largest_fit == 10 * MiB
    s = ca.stats()
    assert s["ooms"] == 1 and s["num_alloc_retries"] == 1
    ca.free(a)


def test_max_split_size_blocks_are_not_split_for_small_requests() -> None:
    ca = make(max_split_size=32 * MiB)
    big = ca.alloc(40 * MiB)
    ca.free(big)
    small = ca.alloc(4 * MiB)                            # the 40 MiB block is off limits
    assert small.address != big.address and ca.stats()["segments"] == 2
    ca.free(small)


def test_double_free_and_zero_size() -> None:
    ca = make()
    a = ca.alloc(100)
    ca.free(a)
    with pytest.raises(CachingAllocatorError, match="double free"):
        ca.free(a)
    z = ca.alloc(0)
    assert z.address == 0 and ca.stats()["segments"] == 1
    ca.free(z)


def test_stats_keys_and_docs() -> None:
    ca = make()
    s = ca.stats()
    for key in ("requested_bytes", "mapped_bytes", "reserved_bytes", "peak_requested_bytes",
                "peak_mapped_bytes", "chunks_in_use", "chunks_cached",
                "internal_fragmentation_bytes", "map_calls", "unmap_calls",
                "reserved_segment_bytes", "peak_reserved_bytes", "largest_free_block",
                "segments"):
        assert key in s, key
        assert f"``{key}``" in CachingAllocator.stats.__doc__, key
    a = ca.alloc(3 * MiB)
    s = ca.stats()
    assert s["mapped_bytes"] == s["reserved_segment_bytes"] == 20 * MiB
    assert s["internal_fragmentation_bytes"] == 17 * MiB
    assert s["inactive_split_bytes"] == 17 * MiB
    ca.free(a)
    assert list(ca.stats()) == list(s)


def test_runs_over_real_host_memory() -> None:
    backend = HostBackend()
    ca = CachingAllocator(backend)
    a = ca.alloc(3 * MiB)
    assert a.address % 4096 == 0
    import numpy as np

    np.frombuffer(backend.buffer(a.address, a.size), dtype=np.uint8)[:] = 5
    assert backend.physical_bytes() == 3 * MiB
    ca.free(a)
    ca.empty_cache()
    assert backend.physical_bytes() == 0
    backend.close()


def _check(ca: CachingAllocator) -> None:
    """Every segment is a chain of non-overlapping blocks tiling it; no two free
    neighbours; free lists match the free blocks."""
    free_total = 0
    for seg in ca.segments():
        pos = seg["address"]
        prev_free = False
        for blk in seg["blocks"]:
            assert blk["address"] == pos
            pos += blk["size"]
            is_free = blk["state"] == "inactive"
            assert not (is_free and prev_free), "free neighbours not coalesced"
            prev_free = is_free
            free_total += blk["size"] if is_free else 0
        assert pos == seg["address"] + seg["total_size"]
    s = ca.stats()
    assert s["reserved_segment_bytes"] - s["allocated_bytes"] == free_total
    assert len(ca._free_small) + len(ca._free_large) == len(ca._free_blocks)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB), st.integers(0, 999)),
                    max_size=80),
       capacity=st.sampled_from([None, 96 * MiB]))
def test_random_ops_keep_the_heap_consistent(ops, capacity) -> None:
    ca = make(capacity)
    live = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            try:
                live.append(ca.alloc(size))
            except OutOfBudget:
                assert capacity is not None
        else:
            ca.free(live.pop(pick % len(live)))
        _check(ca)
    addresses = sorted((b.address, b.address + b.size) for b in live)
    assert all(e <= s for (_, e), (s, _) in zip(addresses, addresses[1:]))  # no overlap
    for blk in live:
        ca.free(blk)
    ca.empty_cache()
    assert ca.stats()["segments"] == 0 and ca.backend.ledger.ranges() == []


def test_seeded_heavy_mix_matches_invariants() -> None:
    rng = random.Random(7)
    ca = make()
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            ca.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(ca.alloc(rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MiB),
                                              rng.randint(1, 40 * MiB)])))
    _check(ca)


def test_backend_out_of_memory_is_a_failed_segment() -> None:
    """A device smaller than the model's capacity: the backend's own OOM takes the same
    free-cached-segments-and-retry path, then raises OutOfBudget."""
    ca = CachingAllocator(SimBackend(capacity_bytes=40 * MiB))
    ca.free(ca.alloc(24 * MiB))
    a = ca.alloc(30 * MiB)                               # backend full: empty_cache, retry
    assert ca.stats()["num_alloc_retries"] == 1 and ca.stats()["segments"] == 1
    with pytest.raises(OutOfBudget, match="tried to allocate"):
        ca.alloc(12 * MiB)
    ca.free(a)
    ca.empty_cache()
    assert ca.backend.physical_bytes == 0 and ca.backend.ledger.ranges() == []
