"""One conformance suite for :class:`ooc.storage.tier.SlowerTier`, run over every tier.

Implementations: the file tier (plain, with CRC-32 verification, and with the fault hook the
reliability tests use to fake a full disk), and the pinned host tier over the FAKE CUDA
driver (``ooc.testing.fake_cuda_copies``; plain and verifying). The pinned cases say
"fake-driver" in their ids: they check the tier's logic against the driver's documented
contract, not a GPU (``tests/ooc/test_cuda_gpu.py`` does that, with ``-m gpu``).

Each case comes as a harness: the tier, plus how to make a source or destination buffer of
the kind the tier takes (a CPU pool tensor for the file tier, a device range of a CUDA pool
over the same fake driver for the pinned tier) and how to fill and read one.
"""

from __future__ import annotations

import errno
import gc
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from ooc.errors import StorageError
from ooc.runtime.cpu_pool import CpuDevicePool
from ooc.runtime.cuda_pool import CudaDevicePool
from ooc.storage.cuda_tier import PinnedTier
from ooc.storage import FileTier
from ooc.storage.tier import STATS_KEYS, SlowerTier, Transfer
from ooc.testing.fake_cuda_copies import FakeCopyDriver

KiB, MiB = 1 << 10, 1 << 20
ROOM = 8 * MiB   # what the bounded cases can hold: pinned capacity / the faked disk


def pattern(n: int, seed: int) -> bytes:
    """n bytes repeating with period 251 (not a power of two: misplaced pages show)."""
    period = bytes((i * 7 + seed) % 251 for i in range(251))
    return (period * (n // 251 + 1))[:n]


@dataclass
class Harness:
    tier: Any
    buffer: Callable[[int], Any]              # a fresh src/dst of at least n bytes
    fill: Callable[[Any, bytes], None]
    read: Callable[[Any, int], bytes]
    bounded: bool                              # reserve/write past ROOM must fail
    teardown: list = field(default_factory=list)


def _file_harness(tmp_path, **kw) -> Harness:
    pool = CpuDevicePool(64 * MiB, 64 * KiB)   # page-aligned buffers: the O_DIRECT path

    def fill(t: torch.Tensor, data: bytes) -> None:
        t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def read(t: torch.Tensor, n: int) -> bytes:
        return t[:n].numpy().tobytes()

    bounded = "_fault" in kw
    tier = FileTier(tmp_path, threads=2, chunk_bytes=64 * KiB, **kw)

    def close_pool() -> None:
        gc.collect()
        pool.close()

    return Harness(tier, pool.take, fill, read, bounded, [close_pool])


def _small_disk(op: str, key: int, offset: int, length: int) -> None:
    """The reliability tests' fault hook: a file system with ROOM bytes for the swap file."""
    if op in ("pwrite", "reserve") and offset + length > ROOM:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _pinned_harness(verify: bool) -> Harness:
    fake = FakeCopyDriver()
    pool = CudaDevicePool(64 * MiB, 2 * MiB, driver=fake)   # device ranges: DevicePtr
    tier = PinnedTier(driver=fake, capacity_bytes=ROOM, slab_bytes=2 * MiB, verify=verify)

    def fill(ptr: Any, data: bytes) -> None:
        fake.write_device(ptr.address, data)

    def read(ptr: Any, n: int) -> bytes:
        return fake.read_device(ptr.address, n)

    def check_driver() -> None:
        gc.collect()
        pool.close()
        assert fake.violations == []
        assert not any(fake.outstanding().values()), fake.outstanding()

    return Harness(tier, pool.take, fill, read, True, [check_driver])


CASES = {
    "file": lambda tmp: _file_harness(tmp),
    "file-verify": lambda tmp: _file_harness(tmp, verify=True),
    "file-fault-hook": lambda tmp: _file_harness(tmp, _fault=_small_disk),
    "pinned-fake-driver": lambda tmp: _pinned_harness(False),
    "pinned-verify-fake-driver": lambda tmp: _pinned_harness(True),
}


@pytest.fixture(params=list(CASES))
def h(request, tmp_path):
    harness = CASES[request.param](tmp_path)
    yield harness
    harness.tier.close()
    for step in harness.teardown:
        step()


def written(h: Harness, key: int, n: int, seed: int) -> Any:
    """Write ``n`` bytes of pattern ``seed`` under ``key`` and wait; return the source."""
    src = h.buffer(n)
    h.fill(src, pattern(n, seed))
    h.tier.write_async(key, src, n).result()
    return src


def read_back(h: Harness, key: int, n: int) -> bytes:
    dst = h.buffer(n)
    h.tier.read_async(key, dst).result()
    return h.read(dst, n)


# -- the protocol ---------------------------------------------------------------------------------
def test_conforms_to_the_protocol(h: Harness) -> None:
    assert isinstance(h.tier, SlowerTier)
    src = h.buffer(4 * KiB)
    h.fill(src, pattern(4 * KiB, 1))
    future = h.tier.write_async(1, src, 4 * KiB)
    assert isinstance(future, Transfer)
    assert future.result() is None and future.done() and future.exception() is None


# -- bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 4095, 4 * KiB, 5000, MiB + 3, 3 * MiB])
def test_round_trip_is_bytewise_identical(h: Harness, n: int) -> None:
    src = written(h, 7, n, seed=n % 250)
    assert read_back(h, 7, n) == pattern(n, n % 250)
    assert h.read(src, n) == pattern(n, n % 250), "the source is left as it was"


def test_a_read_may_follow_its_write_without_a_wait(h: Harness) -> None:
    """The read waits for the key's write: nothing waits between them."""
    n = MiB + 17
    src, dst = h.buffer(n), h.buffer(n)
    h.fill(src, pattern(n, 3))
    w = h.tier.write_async(5, src, n)
    r = h.tier.read_async(5, dst)
    r.result()
    w.result()
    assert h.read(dst, n) == pattern(n, 3)


def test_keys_are_independent_and_a_rewrite_replaces(h: Harness) -> None:
    sizes = {1: 3000, 2: MiB, 3: 70 * KiB}
    keep = [written(h, k, n, seed=k) for k, n in sizes.items()]
    written(h, 2, 5000, seed=9)   # rewrite: smaller, new bytes
    assert read_back(h, 1, 3000) == pattern(3000, 1)
    assert read_back(h, 2, 5000) == pattern(5000, 9)
    assert read_back(h, 3, 70 * KiB) == pattern(70 * KiB, 3)
    st = h.tier.stats()
    assert st["keys"] == 3 and st["live_bytes"] == 3000 + 5000 + 70 * KiB
    del keep


def test_discard_forgets_the_key_and_its_room(h: Harness) -> None:
    written(h, 1, MiB, seed=1)
    written(h, 2, MiB, seed=2)
    h.tier.discard(1)
    h.tier.discard(1)      # twice: nothing
    h.tier.discard(12345)  # never written: nothing
    with pytest.raises(KeyError):
        h.tier.read_async(1, h.buffer(MiB))
    assert read_back(h, 2, MiB) == pattern(MiB, 2)
    st = h.tier.stats()
    assert st["keys"] == 1 and st["live_bytes"] == MiB and st["peak_live_bytes"] == 2 * MiB


def test_discard_while_the_write_is_in_flight(h: Harness) -> None:
    """The key's room is reused only after the write is over; the next key's bytes are its own."""
    for round_ in range(4):
        src = h.buffer(MiB)
        h.fill(src, pattern(MiB, round_))
        h.tier.write_async(round_, src, MiB)
        h.tier.discard(round_)
    written(h, 99, 2 * MiB, seed=7)
    h.tier.drain()
    assert read_back(h, 99, 2 * MiB) == pattern(2 * MiB, 7)


# -- misuse ---------------------------------------------------------------------------------------
def test_misuse_is_an_error_at_the_call(h: Harness) -> None:
    with pytest.raises(KeyError):
        h.tier.read_async(404, h.buffer(4 * KiB))
    written(h, 1, 8 * KiB, seed=1)
    small = _exactly(h.buffer(4 * KiB), 4 * KiB)
    with pytest.raises(ValueError):
        h.tier.read_async(1, small)               # dst smaller than the key
    with pytest.raises(ValueError):
        h.tier.write_async(2, small, 8 * KiB)     # src smaller than nbytes
    with pytest.raises(ValueError):
        h.tier.write_async(2, small, -1)
    assert h.tier.stats()["keys"] == 1, "a refused write leaves no key"
    with pytest.raises(KeyError):
        h.tier.read_async(2, h.buffer(8 * KiB))
    assert read_back(h, 1, 8 * KiB) == pattern(8 * KiB, 1)


def _exactly(buf: Any, n: int) -> Any:
    """``n`` bytes of ``buf`` (pool ranges are rounded up to whole chunks)."""
    return buf[:n] if isinstance(buf, torch.Tensor) else type(buf)(buf.address, n)


# -- reserve --------------------------------------------------------------------------------------
def test_reserve_then_the_writes_fit(h: Harness) -> None:
    """Reserved room is there for the writes (no growth fails afterwards); a rewrite of a key
    reuses its room; more than the tier can hold fails at the reservation, changing nothing."""
    written(h, 1, 3 * MiB, seed=1)
    h.tier.reserve([(1, 3 * MiB), (None, 4 * MiB)])
    written(h, 1, 3 * MiB, seed=2)
    written(h, 2, 4 * MiB, seed=3)
    if h.bounded:
        with pytest.raises(StorageError):
            h.tier.reserve([(None, 2 * MiB)])
    assert read_back(h, 1, 3 * MiB) == pattern(3 * MiB, 2)
    assert read_back(h, 2, 4 * MiB) == pattern(4 * MiB, 3)
    h.tier.reserve([])


def test_a_write_past_the_room_fails_and_names_the_key(h: Harness) -> None:
    if not h.bounded:
        pytest.skip("an unbounded file tier: the machine's disk is the limit")
    written(h, 1, 6 * MiB, seed=1)
    src = h.buffer(4 * MiB)
    h.fill(src, pattern(4 * MiB, 2))
    with pytest.raises(StorageError, match="key 2|space"):
        h.tier.write_async(2, src, 4 * MiB).result()
    h.tier.discard(2)
    assert read_back(h, 1, 6 * MiB) == pattern(6 * MiB, 1), "the other keys stay intact"


# -- drain ----------------------------------------------------------------------------------------
def test_drain_waits_for_every_transfer_whoever_holds_its_future(h: Harness) -> None:
    h.tier.drain()   # nothing in flight: returns
    srcs = []
    for k in range(4):
        src = h.buffer(MiB)
        h.fill(src, pattern(MiB, k))
        srcs.append(src)
        h.tier.write_async(k, src, MiB)      # future dropped
    dsts = [h.buffer(MiB) for _ in range(4)]
    futures = [h.tier.read_async(k, dsts[k]) for k in range(4)]
    h.tier.drain()
    assert all(f.done() for f in futures)
    assert [h.read(d, MiB) for d in dsts] == [pattern(MiB, k) for k in range(4)]
    st = h.tier.stats()
    assert (st["writes"], st["reads"]) == (4, 4)
    assert (st["bytes_written"], st["bytes_read"]) == (4 * MiB, 4 * MiB)


# -- stats ----------------------------------------------------------------------------------------
def test_stats_have_the_stable_keys(h: Harness) -> None:
    st = h.tier.stats()
    assert set(STATS_KEYS) <= set(st), set(STATS_KEYS) - set(st)
    assert all(st[k] == 0 for k in STATS_KEYS if k != "verify")
    assert isinstance(st["verify"], bool)
    written(h, 1, 5000, seed=1)
    read_back(h, 1, 5000)
    st = h.tier.stats()
    assert (st["writes"], st["reads"], st["bytes_written"], st["bytes_read"]) == (1, 1, 5000, 5000)
    assert (st["keys"], st["live_bytes"], st["peak_live_bytes"]) == (1, 5000, 5000)
    assert all(isinstance(st[k], int) for k in STATS_KEYS if k != "verify")


# -- close ----------------------------------------------------------------------------------------
def test_close_is_idempotent_and_refuses_new_work(h: Harness) -> None:
    src = written(h, 1, MiB, seed=1)
    h.tier.write_async(2, src, MiB)   # still in flight, maybe: close waits for it
    h.tier.close()
    h.tier.close()
    with pytest.raises(StorageError, match="closed"):
        h.tier.write_async(3, src, MiB)
    with pytest.raises(StorageError, match="closed"):
        h.tier.read_async(1, h.buffer(MiB))
    with pytest.raises(StorageError, match="closed"):
        h.tier.reserve([(None, MiB)])
    h.tier.discard(1)     # these do not raise on a closed tier
    h.tier.drain()
    assert set(STATS_KEYS) <= set(h.tier.stats())
