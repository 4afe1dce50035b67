"""One conformance suite for :class:`ooc.runtime.pool.DevicePool`, run over every pool.

Implementations: the CPU pool (memfd chunks), the CUDA pool over the FAKE CUDA driver handing
out ``DevicePtr`` (what tests pass a driver for), and the CUDA pool as the engine builds it
under ``ooc.testing.fake_cuda()`` (ranges wrapped as tensors through the CUDA seam). The CUDA
cases say "fake-driver" in their ids: they check the pool's logic against the driver's
documented contract, not a GPU (``tests/ooc/test_cuda_gpu.py`` does that, with ``-m gpu``).
PyTorch's arena (:class:`~ooc.runtime.torch_arena.TorchArenaPool`, ``Options(arena="pytorch")``)
runs the protocol's part of the suite; what is about chunks (sharing, trimming whole ones) is
for the VMM pools only (fixture ``vh``).
"""

from __future__ import annotations

import contextlib
import gc
import random
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import ooc.testing
from ooc.errors import OOCError, OutOfBudget
from ooc.runtime.cpu_pool import CpuDevicePool
from ooc.runtime.cuda_pool import CudaDevicePool
from ooc.runtime.devices import make_pool
from ooc.runtime.pool import STATS_KEYS, DevicePool, RangeSource
from ooc.runtime.torch_arena import BLOCK, TorchArenaPool
from ooc.testing.fake_cuda_copies import FakeCopyDriver
from vmm.errors import VMMError

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 2 * MiB
BUDGET = 8 * CHUNK


@dataclass
class Harness:
    pool: Any
    fill: Callable[[Any, bytes], None]
    read: Callable[[Any, int], bytes]
    address: Callable[[Any], int]
    driver: Any = None


def _cpu() -> contextlib.AbstractContextManager[Harness]:
    @contextlib.contextmanager
    def make():
        def fill(t: torch.Tensor, data: bytes) -> None:
            t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        yield Harness(CpuDevicePool(BUDGET, CHUNK), fill, lambda t, n: t[:n].numpy().tobytes(),
                      lambda t: t.data_ptr())
    return make()


def _cuda_ptr() -> contextlib.AbstractContextManager[Harness]:
    @contextlib.contextmanager
    def make():
        fake = FakeCopyDriver()
        yield Harness(CudaDevicePool(BUDGET, CHUNK, driver=fake),
                      lambda p, data: fake.write_device(p.address, data),
                      lambda p, n: fake.read_device(p.address, n), lambda p: p.address, fake)
    return make()


def _cuda_seam() -> contextlib.AbstractContextManager[Harness]:
    @contextlib.contextmanager
    def make():
        with ooc.testing.fake_cuda(granularity=64 * KiB) as fake:
            pool = CudaDevicePool(BUDGET, CHUNK)   # the driver and the tensors: the seam's
            assert pool.as_tensor

            def fill(t: torch.Tensor, data: bytes) -> None:
                t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

            yield Harness(pool, fill, lambda t, n: t[:n].numpy().tobytes(),
                          lambda t: t.data_ptr(), fake)
    return make()


def _arena() -> contextlib.AbstractContextManager[Harness]:
    @contextlib.contextmanager
    def make():
        with ooc.testing.fake_cuda(granularity=64 * KiB) as fake:
            pool = make_pool("cuda", BUDGET, CHUNK, arena="pytorch")
            assert isinstance(pool, TorchArenaPool) and pool.granularity == 64 * KiB

            def fill(t: torch.Tensor, data: bytes) -> None:
                t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

            yield Harness(pool, fill, lambda t, n: t[:n].numpy().tobytes(),
                          lambda t: t.data_ptr(), fake)
    return make()


VMM_CASES = {"cpu": _cpu, "cuda-ptr-fake-driver": _cuda_ptr, "cuda-tensor-fake-driver": _cuda_seam}
CASES = {**VMM_CASES, "cuda-pytorch-arena-fake-driver": _arena}


def _harness(cases: dict, name: str):
    with cases[name]() as harness:
        yield harness
        gc.collect()
        harness.pool.close()
        if harness.driver is not None:
            assert harness.driver.violations == []
            assert not any(harness.driver.outstanding().values()), harness.driver.outstanding()


@pytest.fixture(params=list(CASES))
def h(request):
    yield from _harness(CASES, request.param)


@pytest.fixture(params=list(VMM_CASES))
def vh(request):
    """The pools over ooc's VMM allocator: chunks, shared by small ranges, trimmed whole."""
    yield from _harness(VMM_CASES, request.param)


def pattern(n: int, seed: int) -> bytes:
    period = bytes((i * 7 + seed) % 251 for i in range(251))
    return (period * (n // 251 + 1))[:n]


def test_conforms_to_the_protocol(h: Harness) -> None:
    assert isinstance(h.pool, DevicePool) and isinstance(h.pool, RangeSource)
    g = h.pool.granularity
    assert isinstance(g, int) and g > 0 and CHUNK % g == 0
    a = h.pool.alignment
    assert isinstance(a, int) and a > 0 and g % a == 0 and a & (a - 1) == 0


def test_ranges_are_aligned_distinct_and_hold_their_bytes(h: Harness) -> None:
    sizes = [5000, CHUNK, CHUNK + 1, 3 * MiB]
    _fill_and_check(h, [h.pool.take(n) for n in sizes], sizes)


def test_over_the_budget_is_out_of_budget_and_the_pool_stays_usable(h: Harness) -> None:
    keep = h.pool.take(6 * CHUNK)
    with pytest.raises(OutOfBudget):
        h.pool.take(3 * CHUNK)
    r = h.pool.take(2 * CHUNK)   # what is left still fits
    h.fill(r, pattern(2 * CHUNK, 1))
    assert h.read(r, 2 * CHUNK) == pattern(2 * CHUNK, 1)
    del keep, r


def test_a_range_goes_back_when_its_last_user_is_gone_at_the_next_reap(h: Harness) -> None:
    r = h.pool.take(CHUNK)
    if isinstance(r, torch.Tensor):
        view = r[:10]
        del r
        gc.collect()
        h.pool.reap()
        assert h.pool.stats()["allocations"] == 1, "a view still uses the range"
        r = view
        del view
    del r
    gc.collect()
    assert h.pool.stats()["allocations"] == 1, "handed back at the next reap, not before"
    h.pool.reap()
    st = h.pool.stats()
    assert st["allocations"] == 0 and st["mapped_bytes"] == 0
    assert h.pool.take(BUDGET) is not None, "the whole budget is free again"


def test_trim_gives_back_whole_unused_chunks(vh: Harness) -> None:
    ranges = [vh.pool.take(CHUNK) for _ in range(3)]
    keep = vh.pool.take(CHUNK)
    del ranges
    gc.collect()
    assert vh.pool.trim(1) == CHUNK, "a limit takes whole chunks covering it"
    assert vh.pool.trim() == 2 * CHUNK
    assert vh.pool.trim() == 0
    assert vh.pool.stats()["physical_bytes"] == CHUNK, "the live range keeps its chunk"
    vh.fill(keep, pattern(CHUNK, 4))
    assert vh.read(keep, CHUNK) == pattern(CHUNK, 4)


def test_stats_have_the_stable_keys(h: Harness) -> None:
    st = h.pool.stats()
    assert set(STATS_KEYS) <= set(st) and all(isinstance(st[k], int) for k in STATS_KEYS)
    a, b = h.pool.take(CHUNK), h.pool.take(3 * CHUNK)
    st = h.pool.stats()
    assert (st["allocations"], st["mapped_bytes"]) == (2, 4 * CHUNK)
    del a
    gc.collect()
    h.pool.reap()
    st = h.pool.stats()
    assert (st["allocations"], st["peak_allocations"]) == (1, 2)
    assert (st["mapped_bytes"], st["peak_mapped_bytes"]) == (3 * CHUNK, 4 * CHUNK)
    del b


def test_close_refuses_live_ranges_is_idempotent_and_final(h: Harness) -> None:
    r = h.pool.take(CHUNK)
    with pytest.raises(VMMError, match="live"):
        h.pool.close()
    h.fill(r, pattern(CHUNK, 2))
    assert h.read(r, CHUNK) == pattern(CHUNK, 2), "a refused close leaves the range usable"
    del r
    gc.collect()
    h.pool.close()
    h.pool.close()
    with pytest.raises(OOCError, match="closed"):
        h.pool.take(CHUNK)


# -- small tensors: packed into shared chunks ----------------------------------------------


def _fill_and_check(h: Harness, ranges: list, sizes: list[int]) -> None:
    for i, (r, n) in enumerate(zip(ranges, sizes)):
        assert h.address(r) % h.pool.alignment == 0
        h.fill(r, pattern(n, i))
    for i, (r, n) in enumerate(zip(ranges, sizes)):
        assert h.read(r, n) == pattern(n, i), f"range {i} ({n} B) was overwritten"
    spans = sorted((h.address(r), h.address(r) + n) for r, n in zip(ranges, sizes))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_small_ranges_share_chunks_and_keep_their_bytes(vh: Harness) -> None:
    sizes = [1, 100, 4096, 5000, 64 * KiB, 300 * KiB, CHUNK // 2, CHUNK - 8192]
    ranges = [vh.pool.take(n) for n in sizes]
    _fill_and_check(vh, ranges, sizes)
    st = vh.pool.stats()
    assert st["allocations"] == len(sizes)
    # Far fewer chunks than ranges (pure chunks would map one each): every one but the last
    # two fills a chunk with the others.
    assert st["mapped_bytes"] <= 3 * CHUNK < len(sizes) * CHUNK
    # Each chunk's first range starts it (a one-chunk range), the others are blocks in its rest.
    assert st["small_blocks"] == len(sizes) - st["mapped_bytes"] // CHUNK


def test_small_ranges_go_back_and_their_chunk_with_the_last(vh: Harness) -> None:
    small = [vh.pool.take(20 * KiB) for _ in range(10)]
    assert vh.pool.stats()["mapped_bytes"] == CHUNK, "ten 20 KiB ranges in one chunk"
    del small[:9]
    gc.collect()
    vh.pool.reap()
    st = vh.pool.stats()
    assert (st["allocations"], st["mapped_bytes"]) == (1, CHUNK), "the chunk stays for the last"
    del small
    gc.collect()
    vh.pool.reap()
    st = vh.pool.stats()
    assert (st["allocations"], st["mapped_bytes"], st["small_chunks"]) == (0, 0, 0)
    assert vh.pool.take(BUDGET) is not None, "the whole budget is free again"


def test_small_ranges_in_the_tail_of_a_large_one_outlive_it(vh: Harness) -> None:
    # Four chunks, the last half unused (rounding wastes under a quarter: a range of its own,
    # not a medium block).
    big = vh.pool.take(3 * CHUNK + MiB)
    tail = [vh.pool.take(100 * KiB) for _ in range(3)]  # packed into that unused tail
    assert vh.pool.stats()["mapped_bytes"] == 4 * CHUNK
    _fill_and_check(vh, [big, *tail], [3 * CHUNK + MiB] + [100 * KiB] * 3)
    del big
    gc.collect()
    vh.pool.reap()
    st = vh.pool.stats()
    assert (st["allocations"], st["mapped_bytes"]) == (3, CHUNK), "only the tail chunk stays"
    for i, r in enumerate(tail):
        assert vh.read(r, 100 * KiB) == pattern(100 * KiB, i + 1), "the tail kept its bytes"
    more = vh.pool.take(7 * CHUNK)                     # the first three went back to the budget
    del tail, more, r
    gc.collect()
    vh.pool.reap()
    assert vh.pool.stats()["mapped_bytes"] == 0


def test_a_pool_never_maps_more_than_whole_chunks_per_range(vh: Harness) -> None:
    # What lets a plan made with sizes rounded up to whole chunks fit the pool: a medium block
    # (1-4 chunks that round badly) uses only the chunks it touches, never more than its own
    # whole chunks would (a 5-chunk slab mapped whole kept 5 chunks for one 2.25 MiB range).
    rng = random.Random(0)
    sizes = [100 * KiB, CHUNK // 2, CHUNK + CHUNK // 8, CHUNK + CHUNK // 2, 2 * CHUNK + 1]
    live: list[tuple[Any, int]] = []
    for _ in range(120):
        if live and (rng.random() < 0.45 or len(live) > 6):
            live.pop(rng.randrange(len(live)))
            gc.collect()
            vh.pool.reap()
        else:
            n = rng.choice(sizes)
            with contextlib.suppress(OutOfBudget):
                live.append((vh.pool.take(n), n))
        whole = sum(-(-n // CHUNK) * CHUNK for _, n in live)
        assert vh.pool.stats()["mapped_bytes"] <= whole
    del live
    gc.collect()
    vh.pool.reap()


def test_small_ranges_past_the_budget_are_out_of_budget(vh: Harness) -> None:
    keep = [vh.pool.take(CHUNK - 8192) for _ in range(BUDGET // CHUNK)]
    with pytest.raises(OutOfBudget):
        vh.pool.take(16 * KiB)
    r = vh.pool.take(4096)                             # what is left in the chunks still fits
    vh.fill(r, pattern(4096, 9))
    assert vh.read(r, 4096) == pattern(4096, 9)
    del keep, r


# -- PyTorch's arena ------------------------------------------------------------------------


def test_the_arena_counts_blocks_as_pytorch_rounds_them_and_trims_nothing() -> None:
    """FAKE driver: each range counts as PyTorch's allocator rounds it (512-byte blocks), so
    ranges that fit the budget one by one are refused together when their blocks do not;
    ``trim`` leaves freed blocks to PyTorch's cache (0 bytes given back)."""
    with _arena() as a:
        keep = [a.pool.take(BLOCK + 1) for _ in range(BUDGET // (2 * BLOCK))]
        assert a.pool.stats()["mapped_bytes"] == BUDGET
        with pytest.raises(OutOfBudget, match="PyTorch"):
            a.pool.take(1)
        del keep
        gc.collect()
        assert a.pool.trim() == 0 and a.pool.stats()["mapped_bytes"] == 0
        assert a.pool.stats()["peak_mapped_bytes"] == BUDGET
        a.pool.close()


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_the_arena_is_refused_off_cuda(device: str) -> None:
    with pytest.raises(OOCError, match="CUDA"):
        make_pool(device, BUDGET, CHUNK, arena="pytorch")
    with pytest.raises(OOCError, match="arena"):
        make_pool("cpu", BUDGET, CHUNK, arena="vmm")


def test_a_full_device_under_the_arena_is_pytorchs_error_naming_the_swap_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE driver: PyTorch's allocator refusing a swap-in within the budget (the device is
    full) raises PyTorch's OutOfMemoryError, saying so with the bytes, and the pool stays as
    it was."""
    with _arena() as a:
        keep = a.pool.take(CHUNK)

        def full(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        monkeypatch.setattr(torch, "empty", full)
        with pytest.raises(torch.OutOfMemoryError, match=r"swap-in of 2 MiB .* device full.*Tried to allocate"):
            a.pool.take(CHUNK)
        monkeypatch.undo()
        assert a.pool.stats()["allocations"] == 1 and a.pool.stats()["mapped_bytes"] == CHUNK
        del keep
        gc.collect()
        a.pool.close()


def test_without_mremap_dontunmap_the_cpu_pool_uses_memfd_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a kernel older than 5.7 anonymous chunks cannot move without a moment's hole that
    another thread's mmap may take (``vmm.anon_host``): the backend refuses, and the CPU pool
    the engine makes uses memfd chunks instead, with the same ranges and bytes."""
    import vmm
    import vmm.anon_host

    monkeypatch.setattr(vmm.anon_host, "_DONTUNMAP", False)   # what the kernel's refusal leaves
    with pytest.raises(vmm.VMMError, match="MREMAP_DONTUNMAP"):
        vmm.AnonHostBackend()
    pool = CpuDevicePool(1 << 20, 64 << 10, share_pages=True)
    assert type(pool.backend) is vmm.HostBackend and not pool._shared
    t = pool.take(100_000)
    t.copy_(torch.arange(100_000, dtype=torch.uint8))
    assert torch.equal(t, torch.arange(100_000, dtype=torch.uint8))
    del t
    gc.collect()
    pool.trim()
    pool.close()
