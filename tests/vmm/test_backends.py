"""Backends: the sim backend enforces the mapping contract; the host backend is real memory."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from vmm import HostBackend, SimBackend
from vmm.backend import ContractError, DeviceOutOfMemory, Ledger

MiB = 1 << 20


# -- sim: the contract ----------------------------------------------------------------------
def test_sim_map_unmap_round_trip() -> None:
    b = SimBackend()
    h1, h2 = b.create_chunk(2 * MiB), b.create_chunk(2 * MiB)
    base = b.reserve_range(8 * MiB)
    b.map_many(base, [h2, h1], 2 * MiB)       # any order
    b.set_access(base, 4 * MiB)
    b.unmap(base, 4 * MiB)
    b.release_chunk(h1)
    b.release_chunk(h2)
    b.free_range(base, 8 * MiB)
    assert b.physical_bytes == 0 and b.ledger.ranges() == []


@pytest.mark.parametrize("misuse, match", [
    (lambda b, h, r: b.map(r + 8 * MiB, h, 2 * MiB), "not inside one reserved"),
    (lambda b, h, r: b.map(r + 7 * MiB, h, 2 * MiB), "multiples of the granularity"),
    (lambda b, h, r: b.map(r - 2 * MiB, h, 2 * MiB), "not inside one reserved"),
    (lambda b, h, r: b.create_chunk(3 * MiB), "not a positive multiple"),
    (lambda b, h, r: b.reserve_range(MiB), "not a positive multiple"),
    (lambda b, h, r: b.map(r, 12345, 2 * MiB), "unknown, released"),
])
def test_sim_rejects_misuse(misuse, match) -> None:
    b = SimBackend()
    h = b.create_chunk(2 * MiB)
    r = b.reserve_range(8 * MiB)
    with pytest.raises(ContractError, match=match):
        misuse(b, h, r)


def test_sim_rejects_double_map_and_partial_unmap() -> None:
    b = SimBackend()
    h, h2 = b.create_chunk(4 * MiB), b.create_chunk(2 * MiB)
    r = b.reserve_range(8 * MiB)
    b.map(r + 2 * MiB, h, 4 * MiB)
    with pytest.raises(ContractError, match="double map"):
        b.map(r + 2 * MiB, h2, 2 * MiB)
    with pytest.raises(ContractError, match="double map"):
        b.map(r, h, 4 * MiB)                  # overlaps the start of the mapping
    with pytest.raises(ContractError, match="double map"):
        b.map(r + 4 * MiB, h2, 2 * MiB)       # inside the mapping
    with pytest.raises(ContractError, match="cuts the mapping"):
        b.unmap(r + 4 * MiB, 2 * MiB)
    with pytest.raises(ContractError, match="cuts the mapping"):
        b.unmap(r, 4 * MiB)
    with pytest.raises(ContractError, match="nothing is mapped"):
        b.unmap(r, 2 * MiB)
    with pytest.raises(ContractError, match="still mapped"):
        b.release_chunk(h)
    with pytest.raises(ContractError, match="still mapped in it"):
        b.free_range(r, 8 * MiB)
    with pytest.raises(ContractError, match="not fully mapped"):
        b.set_access(r, 4 * MiB)
    with pytest.raises(ContractError, match="whole reserved range"):
        b.free_range(r, 4 * MiB)
    b.unmap(r, 8 * MiB)                       # a span covering whole mappings is fine
    b.release_chunk(h)
    with pytest.raises(ContractError, match="unknown or already released"):
        b.release_chunk(h)


def test_sim_capacity_is_device_out_of_memory() -> None:
    b = SimBackend(capacity_bytes=4 * MiB)
    b.create_chunk(2 * MiB)
    b.create_chunk(2 * MiB)
    with pytest.raises(DeviceOutOfMemory, match="already exist"):
        b.create_chunk(2 * MiB)


def test_ledger_is_mapped_spans_several_mappings() -> None:
    led = Ledger(4096, "t")
    led.add_chunk("a", 4096)
    led.add_chunk("b", 8192)
    led.add_range(0x10000, 0x10000)
    led.add_mappings(0x10000, ["a"], 4096)
    led.add_mappings(0x11000, ["b"], 8192)
    assert led.is_mapped(0x10000, 3 * 4096) and led.is_mapped(0x10000, 3 * 4096, whole=True)
    assert led.is_mapped(0x10800, 4096)                  # a part of two mappings
    assert not led.is_mapped(0x10800, 4096, whole=True)
    assert not led.is_mapped(0x10000, 4 * 4096)
    assert not led.is_mapped(0x20000, 4096)
    led.add_mappings(0x14000, ["a"], 4096)               # after a gap
    assert not led.is_mapped(0x10000, 5 * 4096)
    assert led.is_mapped(0x14000, 4096)


# -- host: real memory ----------------------------------------------------------------------
def test_host_granularity_and_alignment() -> None:
    with HostBackend() as b:
        assert b.granularity == os.sysconf("SC_PAGE_SIZE") == 4096
        assert (2 * MiB) % b.granularity == 0
        r = b.reserve_range(4 * MiB, alignment=2 * MiB)
        assert r % (2 * MiB) == 0
        r2 = b.reserve_range(3 * 4096)
        assert r2 % 4096 == 0


def test_host_same_chunk_through_two_mappings() -> None:
    """Bytes written through one mapping read back through another mapping of the chunk."""
    with HostBackend() as b:
        h = b.create_chunk(2 * MiB)
        r1 = b.reserve_range(2 * MiB)
        r2 = b.reserve_range(4 * MiB)
        b.map(r1, h, 2 * MiB)
        b.map(r2 + 2 * MiB, h, 2 * MiB)
        one = np.frombuffer(b.buffer(r1, 2 * MiB), dtype=np.uint8)
        two = np.frombuffer(b.buffer(r2 + 2 * MiB, 2 * MiB), dtype=np.uint8)
        one[:] = np.arange(2 * MiB, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(one, two)
        two[123] = 7
        assert one[123] == 7
        del one, two
        b.unmap(r1, 2 * MiB)
        b.unmap(r2 + 2 * MiB, 2 * MiB)
        b.release_chunk(h)


def test_host_chunk_contents_survive_remapping_elsewhere() -> None:
    with HostBackend() as b:
        hs = [b.create_chunk(64 * 1024) for _ in range(3)]
        r = b.reserve_range(3 * 64 * 1024)
        b.map_many(r, hs, 64 * 1024)
        arr = np.frombuffer(b.buffer(r, 3 * 64 * 1024), dtype=np.uint8)
        for i in range(3):
            arr[i * 65536:(i + 1) * 65536] = i + 1
        del arr
        b.unmap(r, 3 * 64 * 1024)
        b.map_many(r, hs[::-1], 64 * 1024)     # reversed order, same range
        arr = np.frombuffer(b.buffer(r, 3 * 64 * 1024), dtype=np.uint8)
        assert [int(arr[i * 65536]) for i in range(3)] == [3, 2, 1]


def test_host_unmapped_span_stays_reserved() -> None:
    with HostBackend() as b:
        h = b.create_chunk(4096)
        r = b.reserve_range(8192)
        b.map(r, h, 4096)
        b.unmap(r, 4096)
        with pytest.raises(ContractError, match="not fully mapped"):
            b.buffer(r, 4096)
        # the reservation is still ours: mapping again at the same place works
        b.map(r + 4096, h, 4096)
        b.unmap(r + 4096, 4096)


def test_host_release_punches_the_file() -> None:
    with HostBackend() as b:
        h = b.create_chunk(4 * MiB)
        r = b.reserve_range(4 * MiB)
        b.map(r, h, 4 * MiB)
        np.frombuffer(b.buffer(r, 4 * MiB), dtype=np.uint8)[:] = 1
        assert b.physical_bytes() >= 4 * MiB
        b.unmap(r, 4 * MiB)
        b.release_chunk(h)
        assert b.physical_bytes() == 0
        h2 = b.create_chunk(4 * MiB)           # the slot is reused, and reads as zeros
        assert h2 == h
        b.map(r, h2, 4 * MiB)
        assert not np.frombuffer(b.buffer(r, 4 * MiB), dtype=np.uint8).any()
        b.unmap(r, 4 * MiB)


def test_host_tempfile_fallback_is_private(tmp_path) -> None:
    with HostBackend(use_memfd=False, directory=str(tmp_path)) as b:
        assert b.file_kind == "tempfile"
        mode = os.fstat(b._fd).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert os.fstat(b._fd).st_nlink == 0    # unlinked
        assert list(tmp_path.iterdir()) == []  # private directory removed too
        h = b.create_chunk(2 * MiB)
        r = b.reserve_range(2 * MiB)
        b.map(r, h, 2 * MiB)
        np.frombuffer(b.buffer(r, 2 * MiB), dtype=np.uint8)[:] = 9
        b.unmap(r, 2 * MiB)
        b.map(r, h, 2 * MiB)
        assert np.frombuffer(b.buffer(r, 2 * MiB), dtype=np.uint8)[-1] == 9
        b.unmap(r, 2 * MiB)


def test_host_call_errors_name_the_call_and_errno() -> None:
    with HostBackend() as b:
        with pytest.raises(DeviceOutOfMemory, match=r"mmap\(NULL, .*MAP_NORESERVE.*ENOMEM"):
            b.reserve_range(1 << 60)                   # more address space than exists


def test_host_close_releases_everything_and_refuses_use() -> None:
    b = HostBackend()
    h = b.create_chunk(2 * MiB)
    r = b.reserve_range(2 * MiB)
    b.map(r, h, 2 * MiB)
    b.close()
    assert not b._finalizer.alive and b.ledger.ranges() == [] and not b.ledger.chunks
    with pytest.raises(Exception, match="after close"):
        b.create_chunk(2 * MiB)
    b.close()  # twice is fine
