"""ChunkPool and VirtualAllocator over the sim backend: budget, errors, reuse, stats."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vmm
from vmm import ChunkPool, OutOfBudget, SimBackend, VirtualAllocator, VMMError
from vmm.pool import BudgetExceeded, ChunkSizeError
from vmm.virtual import AllocationError

MiB = 1 << 20
CHUNK = 2 * MiB

STATS_KEYS = {
    "requested_bytes", "mapped_bytes", "reserved_bytes", "peak_requested_bytes",
    "peak_mapped_bytes", "chunks_in_use", "chunks_cached", "internal_fragmentation_bytes",
    "map_calls", "unmap_calls",
}


def make(capacity: int = 64 * MiB, chunk: int = CHUNK, **kw) -> VirtualAllocator:
    return VirtualAllocator(ChunkPool(SimBackend(), chunk, capacity), **kw)


# -- pool --------------------------------------------------------------------------------
def test_chunk_size_must_be_a_multiple_of_granularity() -> None:
    with pytest.raises(ChunkSizeError) as err:
        ChunkPool(SimBackend(), 3 * MiB, 64 * MiB)
    msg = str(err.value)
    assert "3145728" in msg and "granularity 2097152" in msg and "sim" in msg
    assert isinstance(err.value, VMMError)
    with pytest.raises(ChunkSizeError, match="smaller than one chunk"):
        ChunkPool(SimBackend(), 4 * MiB, 2 * MiB)


def test_pool_holds_at_most_floor_capacity_over_chunk() -> None:
    pool = ChunkPool(SimBackend(), CHUNK, 11 * MiB)      # floor(11 / 2) = 5
    assert pool.max_chunks == 5 and pool.budget_bytes == 10 * MiB
    assert pool.created == 0                            # lazy
    chunks = pool.acquire(5)
    assert pool.created == 5 and pool.backend.physical_bytes == 10 * MiB
    with pytest.raises(BudgetExceeded):
        pool.acquire(1)
    pool.release(chunks[:2])
    assert pool.cached == 2 and pool.created == 5
    again = pool.acquire(2)
    assert {c.index for c in again} == {c.index for c in chunks[:2]}   # cached ones reused
    assert pool.created == 5 and pool.create_calls == 5
    pool.release(again)
    assert pool.trim() == 4 * MiB and pool.created == 3 and pool.backend.physical_bytes == 6 * MiB


def test_pool_accepts_size_strings() -> None:
    pool = ChunkPool(SimBackend(), "2MiB", "1GiB")
    assert pool.max_chunks == 512


# -- allocator basics --------------------------------------------------------------------
def test_alloc_maps_ceil_chunks_contiguously() -> None:
    va = make()
    a = va.alloc(5 * MiB + 1)
    assert a.mapped_bytes == 6 * MiB and a.nbytes == 5 * MiB + 1
    assert len(a.chunks) == 3 and a.address % va.alignment == 0
    assert va.backend.ledger.is_mapped(a.address, a.mapped_bytes)
    s = va.stats()
    assert s["requested_bytes"] == 5 * MiB + 1 and s["mapped_bytes"] == 6 * MiB
    assert s["internal_fragmentation_bytes"] == MiB - 1
    assert s["chunks_in_use"] == 3 and s["map_calls"] == 3
    va.free(a)
    assert not a.live and a.chunks == ()
    va.check()


def test_stats_keys_are_stable_and_plain() -> None:
    va = make()
    s0 = va.stats()
    assert STATS_KEYS <= set(s0)
    a = va.alloc(3 * MiB)
    va.free(a)
    va.trim()
    s1 = va.stats()
    assert list(s0) == list(s1)
    assert all(type(v) is int for v in s1.values())
    doc = VirtualAllocator.stats.__doc__
    assert all(f"``{k}``" in doc for k in s1)           # every key is documented


def test_out_of_budget_message_names_the_numbers() -> None:
    va = make(capacity=20 * MiB)                         # 10 chunks
    a = va.alloc(7 * MiB)                                # 4 chunks
    b = va.alloc(3 * MiB)                                # 2 chunks
    with pytest.raises(OutOfBudget) as err:
        va.alloc(9 * MiB)                                # needs 5 chunks, 4 left
    e = err.value
    assert isinstance(e, BudgetExceeded) and isinstance(e, MemoryError)
    assert (e.requested, e.in_use, e.budget, e.largest_fit) == (
        9 * MiB, 10 * MiB, 20 * MiB, 8 * MiB)
    msg = str(e)
    for text in ("9 MiB", "9437184 B", "10 MiB", "20 MiB", "8 MiB", "largest request",
                 "budget"):
        assert text in msg, text
    assert va.stats()["ooms"] == 1
    va.check()
    assert va.alloc(8 * MiB).mapped_bytes == 8 * MiB    # the reported largest fit does fit
    va.free(a)
    va.free(b)


def test_no_external_fragmentation() -> None:
    """Free every other allocation: the holes are not contiguous, yet a request as large
    as all the free space together succeeds (chunks are interchangeable)."""
    va = make(capacity=40 * MiB)                         # 20 chunks
    blocks = [va.alloc(2 * MiB) for _ in range(20)]
    for blk in blocks[::2]:
        va.free(blk)
    big = va.alloc(20 * MiB)
    assert big.mapped_bytes == 20 * MiB and va.stats()["chunks_in_use"] == 20
    va.check()


def test_double_free_foreign_and_negative() -> None:
    va, other = make(), make()
    a = va.alloc(MiB)
    va.free(a)
    with pytest.raises(AllocationError, match="double free"):
        va.free(a)
    b = other.alloc(MiB)
    with pytest.raises(AllocationError, match="another allocator"):
        va.free(b)
    with pytest.raises(AllocationError, match="negative"):
        va.alloc(-1)
    z = va.alloc(0)
    assert z.address == 0 and z.mapped_bytes == 0
    va.free(z)


# -- range reuse ---------------------------------------------------------------------------
def test_exact_reuse_costs_no_map_call() -> None:
    va = make()
    a = va.alloc(5 * MiB)
    addr, chunks = a.address, a.chunks
    va.free(a)
    b = va.alloc(5 * MiB + 100)                          # same chunk count
    assert b.address == addr and b.chunks == chunks
    s = va.stats()
    assert s["map_calls"] == 3 and s["unmap_calls"] == 0 and s["reuse_exact"] == 1
    assert s["chunks_parked"] == 0 and s["chunks_in_use"] == 3


def test_parked_chunks_count_as_cached_not_in_use() -> None:
    va = make(capacity=8 * MiB)                          # 4 chunks
    a = va.alloc(8 * MiB)
    va.free(a)
    s = va.stats()
    assert s["chunks_in_use"] == 0 and s["chunks_cached"] == 4 and s["chunks_parked"] == 4
    assert s["mapped_bytes"] == 0 and s["physical_bytes"] == 8 * MiB
    assert va.largest_fit() == 8 * MiB
    # a different size still fits: parked chunks are stolen
    b = va.alloc(2 * MiB)
    c = va.alloc(6 * MiB)
    assert va.stats()["chunks_in_use"] == 4
    va.check()
    va.free(b)
    va.free(c)


def test_shrink_grow_and_steal() -> None:
    va = make(capacity=16 * MiB)                         # 8 chunks
    a = va.alloc(10 * MiB)                               # 5 chunks
    va.free(a)
    b = va.alloc(8 * MiB)                                # 4 < 5 < 8: shrink the parked range
    assert b.address == a.address and va.stats()["reuse_shrink"] == 1
    assert va.stats()["unmap_calls"] == 1
    va.free(b)
    c = va.alloc(16 * MiB)                               # 8 chunks: steals the 4 parked
    assert va.stats()["steals"] == 1 and va.stats()["chunks_in_use"] == 8
    va.free(c)
    va.check()
    d = va.alloc(2 * MiB)                                # parked 8 >= 2 x 1: no shrink
    assert va.stats()["new_ranges"] == 3
    va.free(d)
    va.check()


def test_grow_in_place_after_steal() -> None:
    va = make(capacity=12 * MiB)                         # 6 chunks
    a = va.alloc(8 * MiB)                                # range R, capacity 4
    first_two = a.chunks[:2]
    va.free(a)                                           # R parked with 4 chunks
    b, c = va.alloc(2 * MiB), va.alloc(2 * MiB)          # the last 2 new chunks
    d = va.alloc(4 * MiB)                                # pool empty: steals R's last 2
    s = va.stats()
    assert s["steals"] == 1 and s["chunks_parked"] == 2
    va.free(b)
    va.free(c)
    e = va.alloc(8 * MiB)                                # R (capacity 4, holds 2) grows
    assert e.address == a.address and e.chunks[:2] == first_two
    s = va.stats()
    assert s["reuse_grow"] == 1 and s["chunks_in_use"] == 6
    va.free(d)
    va.free(e)
    va.check()


def test_keep_mapped_false_unmaps_at_free() -> None:
    va = make(keep_mapped=False)
    a = va.alloc(5 * MiB)
    va.free(a)
    s = va.stats()
    assert s["unmap_calls"] == 3 and s["chunks_parked"] == 0 and s["chunks_cached"] == 3
    b = va.alloc(5 * MiB)
    assert b.address == a.address                        # the range is reused
    assert va.stats()["reserve_calls"] == 1


def test_lean_never_holds_more_than_peak_mapped() -> None:
    va = make(capacity=64 * MiB, lean=True)
    for size in (2, 4, 6, 8, 3, 5, 7):
        va.free(va.alloc(size * MiB))
    s = va.stats()
    assert s["peak_physical_bytes"] == s["peak_mapped_bytes"] == 8 * MiB


def test_trim_releases_everything_unused() -> None:
    va = make()
    keep = va.alloc(3 * MiB)
    for size in (2, 4, 6):
        va.free(va.alloc(size * MiB))
    released = va.trim()
    s = va.stats()
    assert released > 0 and s["chunks_cached"] == 0 and s["physical_bytes"] == 4 * MiB
    assert s["reserved_bytes"] == 4 * MiB
    va.free(keep)
    with pytest.raises(AllocationError, match="double free"):
        va.free(keep)
    va.close()
    assert va.backend.physical_bytes == 0 and va.backend.ledger.ranges() == []


def test_a_limited_trim_gives_back_whole_chunks_cached_first_then_least_recently_parked() -> None:
    va = make(keep_mapped=True)
    keep = va.alloc(2 * MiB)
    old, new = va.alloc(4 * MiB), va.alloc(6 * MiB)   # 2 + 3 chunks, parked in this order
    va.free(old)
    va.free(new)
    va.pool.release(va.pool.acquire(1))   # and one chunk waits in the pool's cache
    assert va.stats()["chunks_cached"] == 6 and va.stats()["chunks_parked"] == 5
    physical = va.stats()["physical_bytes"]
    assert va.trim(CHUNK + 1) == 2 * CHUNK   # covers the request: the cached chunk, then old's
    s = va.stats()
    assert s["physical_bytes"] == physical - 2 * CHUNK
    assert s["chunks_parked"] == 4 and va._free._parked_sizes == [1, 3]   # `new` keeps its 3 chunks
    assert s["reserved_bytes"] == 12 * MiB                          # address ranges stay
    assert va.trim(0) == 0 and va.trim(100 * MiB) == 4 * CHUNK      # never more than is unused
    assert va.stats()["physical_bytes"] == 2 * MiB
    again = va.alloc(6 * MiB)          # a trimmed range is filled again on demand
    assert va.stats()["physical_bytes"] == 8 * MiB
    for a in (again, keep):
        va.free(a)
    va.close()
    assert va.backend.physical_bytes == 0


def test_close_refuses_live_allocations() -> None:
    va = make()
    a = va.alloc(MiB)
    with pytest.raises(AllocationError, match="live allocation"):
        va.close()
    a.free()
    va.close()


def test_lazy_exports() -> None:
    assert vmm.VirtualAllocator is VirtualAllocator and vmm.Allocation.__name__ == "Allocation"
    assert {"Backend", "HostBackend", "SimBackend", "CudaBackend", "ChunkPool",
            "VirtualAllocator", "Allocation", "CachingAllocator"} <= set(vmm.__all__)
    for name in ("Backend", "HostBackend", "SimBackend", "CudaBackend", "CachingAllocator"):
        assert getattr(vmm, name).__name__ == name


def test_no_torch_in_vmm() -> None:
    import pathlib
    import re

    root = pathlib.Path(vmm.__file__).parent
    for path in root.glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+torch", path.read_text(), re.M), path


# -- properties ----------------------------------------------------------------------------
ops = st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB), st.integers(0, 1 << 30)),
               min_size=1, max_size=120)


@pytest.mark.parametrize("mode", [{}, {"lean": True}, {"keep_mapped": False}])
@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_random_ops_keep_invariants(mode, ops) -> None:
    """Any sequence: the sim contract holds (it would raise), the books balance, and a
    request fails exactly when it needs more chunks than the budget minus live chunks."""
    va = make(capacity=40 * MiB, **mode)                  # 20 chunks
    live: list = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            k = -(-size // CHUNK)
            fits = k <= 20 - va.stats()["chunks_in_use"]
            try:
                live.append(va.alloc(size))
                assert fits
            except OutOfBudget as e:
                assert not fits and e.largest_fit == (20 - va.stats()["chunks_in_use"]) * CHUNK
        else:
            va.free(live.pop(pick % len(live)))
        va.check()
        s = va.stats()
        assert s["mapped_bytes"] - s["requested_bytes"] < CHUNK * max(1, len(live))
        assert s["physical_bytes"] <= 40 * MiB
    for a in live:
        va.free(a)
    va.trim()
    assert va.backend.physical_bytes == 0 and va.backend.ledger.mapped_count == 0


def test_sim_allocations_have_no_host_buffer() -> None:
    va = make()
    a = va.alloc(MiB)
    with pytest.raises(VMMError, match="no host-visible memory"):
        a.buffer()
    va.free(a)
