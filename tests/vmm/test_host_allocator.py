"""VirtualAllocator over real host memory: contents survive reuse, buffers, trim, RSS."""

from __future__ import annotations

import gc
import random
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmm import ChunkPool, HostBackend, OutOfBudget, VirtualAllocator
from vmm.virtual import BufferInUse

MiB = 1 << 20
KiB = 1 << 10


def _fill(alloc, seed: int) -> int:
    """Write a pattern unique to ``seed`` over the allocation; return its checksum."""
    view = np.frombuffer(alloc.buffer(), dtype=np.uint8)
    rng = np.random.default_rng(seed)
    view[:] = rng.integers(0, 256, alloc.nbytes, dtype=np.uint8)
    return zlib.crc32(view)


def _crc(alloc) -> int:
    return zlib.crc32(np.frombuffer(alloc.buffer(), dtype=np.uint8))


def _run_ops(va: VirtualAllocator, n_ops: int, seed: int, max_bytes: int) -> None:
    rng = random.Random(seed)
    live: dict[int, tuple] = {}
    serial = 0
    for step in range(n_ops):
        if live and (rng.random() < 0.45 or len(live) > 40):
            key = rng.choice(list(live))
            alloc, crc = live.pop(key)
            assert _crc(alloc) == crc, f"allocation {key} corrupted before free at op {step}"
            va.free(alloc)
        else:
            size = rng.randint(1, max_bytes)
            try:
                alloc = va.alloc(size)
            except OutOfBudget:
                continue
            serial += 1
            live[serial] = (alloc, _fill(alloc, serial))
        if step % 1000 == 999:
            va.check()
            for key, (alloc, crc) in live.items():
                assert _crc(alloc) == crc, f"allocation {key} corrupted at op {step}"
    for alloc, crc in live.values():
        assert _crc(alloc) == crc
        va.free(alloc)
    va.check()


@pytest.mark.parametrize("mode, n_ops", [({}, 10_000), ({"lean": True}, 3_000),
                                         ({"keep_mapped": False}, 3_000)])
def test_contents_survive_chunk_reuse_in_any_order(mode, n_ops) -> None:
    """10,000 random alloc/free on a small budget (chunks are reused, stolen and remapped
    in a different order all the time): every live allocation keeps its bytes."""
    backend = HostBackend()
    va = VirtualAllocator(ChunkPool(backend, 16 * KiB, 512 * KiB), **mode)   # 32 chunks
    _run_ops(va, n_ops, seed=1234, max_bytes=80 * KiB)
    s = va.stats()
    assert s["map_calls"] > 100 and s["ooms"] > 0          # the budget really was tight
    if not mode:
        assert s["steals"] > 0 and s["reuse_exact"] > 0
    va.close()
    backend.close()


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 64 * KiB), min_size=1, max_size=30),
       order=st.randoms(use_true_random=False))
def test_contents_property(sizes, order) -> None:
    backend = HostBackend()
    va = VirtualAllocator(ChunkPool(backend, 8 * KiB, 256 * KiB))
    live = []
    for i, size in enumerate(sizes):
        if live and order.random() < 0.4:
            alloc, crc = live.pop(order.randrange(len(live)))
            assert _crc(alloc) == crc
            va.free(alloc)
        try:
            alloc = va.alloc(size)
        except OutOfBudget:
            continue
        live.append((alloc, _fill(alloc, i)))
    for alloc, crc in live:
        assert _crc(alloc) == crc
        va.free(alloc)
    va.check()
    va.close()
    backend.close()


def test_buffer_is_zero_copy_for_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    va = VirtualAllocator(ChunkPool(HostBackend(), 2 * MiB, 16 * MiB))
    a = va.alloc(3 * MiB)
    assert a.address % 4096 == 0 and a.alignment == 4096
    arr = np.frombuffer(a.buffer(), dtype=np.float32)
    ten = torch.frombuffer(a.buffer(), dtype=torch.float32)
    assert arr.ctypes.data == a.address == ten.data_ptr()
    assert arr.size == ten.numel() == 3 * MiB // 4
    ten[10] = 2.5
    assert arr[10] == 2.5                                   # one memory, two views
    arr[-1] = -1.0
    assert float(ten[-1]) == -1.0
    part = np.frombuffer(a.buffer(offset=4096, nbytes=8192), dtype=np.uint8)
    assert part.ctypes.data == a.address + 4096 and part.size == 8192
    del arr, ten, part
    gc.collect()
    va.free(a)


def test_free_refuses_while_a_buffer_is_alive() -> None:
    torch = pytest.importorskip("torch")
    va = VirtualAllocator(ChunkPool(HostBackend(), 2 * MiB, 16 * MiB))
    a = va.alloc(MiB)
    view = torch.frombuffer(a.buffer(), dtype=torch.uint8)[100:200]   # a view of a view
    with pytest.raises(BufferInUse, match="still referenced"):
        va.free(a)
    assert a.live and a.exports_alive() == 1
    mv = memoryview(a.buffer())
    del view
    with pytest.raises(BufferInUse):
        va.free(a)
    del mv
    va.free(a)
    with pytest.raises(Exception, match="freed"):
        a.buffer()


def test_buffer_bounds() -> None:
    va = VirtualAllocator(ChunkPool(HostBackend(), 2 * MiB, 16 * MiB))
    a = va.alloc(MiB)
    assert len(a.buffer(nbytes=2 * MiB)) == 2 * MiB           # up to the mapped bytes
    with pytest.raises(Exception, match="outside"):
        a.buffer(nbytes=2 * MiB + 1)
    with pytest.raises(Exception, match="outside"):
        a.buffer(offset=-1)
    gc.collect()
    va.free(a)


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def _smaps_rss(address: int) -> int:
    """Rss of the mapping that contains ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


def test_trim_returns_memory() -> None:
    """Touch 64 MiB: resident memory and the memfd grow; free keeps the chunks (parked,
    reusable); trim gives them back: RSS drops and the file holds no pages."""
    backend = HostBackend()
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 128 * MiB))
    before = _rss_shmem()
    a = va.alloc(64 * MiB)
    np.frombuffer(a.buffer(), dtype=np.uint8)[:] = 1
    gc.collect()
    assert _smaps_rss(a.address) == 64 * MiB
    assert backend.physical_bytes() == 64 * MiB
    assert _rss_shmem() - before >= 60 * MiB
    address = a.address
    va.free(a)
    assert backend.physical_bytes() == 64 * MiB              # parked: still held
    assert va.trim() == 64 * MiB
    assert backend.physical_bytes() == 0
    assert _smaps_rss(address) == 0
    assert _rss_shmem() - before < 4 * MiB
    va.close()
    backend.close()
