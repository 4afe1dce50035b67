"""The CUDA slower tier and device pool against a FAKE driver (ooc/testing/fake_cuda_copies.py).

Nothing here touches a GPU or CUDA: every test runs ``PinnedTier`` and ``CudaDevicePool`` over
a fake ``cuda.bindings.driver`` whose device memory is host bytearrays and whose async copies
run lazily, in stream order, only when something synchronizes. The first tests check that the
fake itself catches the mistakes that matter (a missing wait shows stale bytes, misuse is
refused), so that the tier passing against it means something. Real-GPU tests are in
``test_cuda_gpu.py`` and skip without a device.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # make ``tests.fakes`` importable however pytest was started
    sys.path.insert(0, _ROOT)

from ooc.errors import OOCError, OutOfBudget, StorageError  # noqa: E402
from ooc.runtime import cuda_pool  # noqa: E402
from ooc.runtime.cuda_pool import CudaDevicePool, make_callbacks, route_allocations  # noqa: E402
from ooc.storage.cuda_tier import PinnedTier  # noqa: E402
from ooc.runtime.devices import DevicePtr, byte_view_for, make_tier_and_pool  # noqa: E402
from tests.fakes.fake_cuda_copies import CUresult, FakeCopyDriver  # noqa: E402

MiB = 1 << 20
OK = (CUresult.CUDA_SUCCESS,)
ZERO = {"handles": 0, "reservations": 0, "mappings": 0, "retained_contexts": 0, "streams": 0,
        "events": 0, "pinned": 0, "queued_ops": 0}


def pattern(n: int, seed: int = 1) -> bytes:
    """n bytes repeating with period 251 (not a power of two: misplaced pages show)."""
    period = bytes((i * 7 + seed) % 251 for i in range(251))
    return (period * (n // 251 + 1))[:n]


@pytest.fixture
def fake() -> FakeCopyDriver:
    return FakeCopyDriver()


@pytest.fixture
def user_ctx(fake: FakeCopyDriver):
    """For tests that drive the fake driver themselves, as PyTorch would: their own retain of
    device 0's primary context, current in this thread (ooc's objects leave the thread's
    current context as they found it, so they do not provide one)."""
    assert fake.cuInit(0) == OK
    _, dev = fake.cuDeviceGet(0)
    _, ctx = fake.cuDevicePrimaryCtxRetain(dev)
    assert fake.cuCtxSetCurrent(ctx) == OK
    yield ctx
    fake.cuDevicePrimaryCtxRelease(dev)


@pytest.fixture
def pool(fake: FakeCopyDriver):
    p = CudaDevicePool(32 * MiB, 2 * MiB, driver=fake)
    yield p
    gc.collect()
    p.close()


@pytest.fixture
def tier(fake: FakeCopyDriver, pool: CudaDevicePool):
    t = PinnedTier(driver=fake, capacity_bytes=32 * MiB, slab_bytes=4 * MiB)
    yield t
    t.close()


# -- the fake catches what it should ----------------------------------------------------------
def test_fake_missing_wait_shows_stale_bytes(fake: FakeCopyDriver, user_ctx,
                                             pool: CudaDevicePool) -> None:
    """FAKE driver: a copy that does not wait for the kernel producing its source copies the
    old bytes; with cuEventRecord + cuStreamWaitEvent it copies the new ones. Reading a
    destination before synchronizing shows stale bytes."""
    src = pool.take(2 * MiB)
    data = pattern(4096)
    _, host = fake.cuMemHostAlloc(4096, 0)
    _, copy = fake.cuStreamCreate(1)
    _, ev = fake.cuEventCreate(2)
    # without a wait: the copy stream runs alone, the kernel on stream 0 has not run
    assert fake.kernel_write(0, src.address, data) == OK
    assert fake.cuMemcpyDtoHAsync(host, src.address, 4096, copy) == OK
    assert ctypes.string_at(host, 4096) == bytes(4096)          # nothing ran yet
    assert fake.cuStreamSynchronize(copy) == OK
    assert ctypes.string_at(host, 4096) == bytes(4096)          # stale: the kernel had not run
    assert fake.cuStreamSynchronize(0) == OK
    # with the wait: syncing the copy stream runs the kernel first
    assert fake.kernel_write(0, src.address, pattern(4096, 2)) == OK
    assert fake.cuEventRecord(ev, 0) == OK
    assert fake.cuStreamWaitEvent(copy, ev, 0) == OK
    assert fake.cuMemcpyDtoHAsync(host, src.address, 4096, copy) == OK
    assert fake.cuStreamSynchronize(copy) == OK
    assert ctypes.string_at(host, 4096) == pattern(4096, 2)
    # host -> device: the destination is stale until the copy is synchronized
    dst = pool.take(2 * MiB)
    assert fake.cuMemcpyHtoDAsync(dst.address, host, 4096, copy) == OK
    assert fake.read_device(dst.address, 4096) == bytes(4096)
    assert fake.cuEventRecord(ev, copy) == OK
    assert fake.cuEventSynchronize(ev) == OK
    assert fake.read_device(dst.address, 4096) == pattern(4096, 2)
    for r in (fake.cuEventDestroy(ev), fake.cuStreamDestroy(copy), fake.cuMemFreeHost(host)):
        assert r == OK
    assert fake.violations == []


def test_fake_refuses_misuse(fake: FakeCopyDriver, user_ctx, pool: CudaDevicePool) -> None:
    """FAKE driver: copies outside mapped device memory or outside pinned memory, waits on
    events never recorded, destroyed handles, frees and unmaps under a queued copy."""
    dev = pool.take(2 * MiB)
    _, host = fake.cuMemHostAlloc(8192, 0)
    _, s = fake.cuStreamCreate(1)
    _, ev = fake.cuEventCreate(0)
    inval = (CUresult.CUDA_ERROR_INVALID_VALUE,)
    unmapped = dev.address + 64 * MiB
    assert fake.cuMemcpyDtoHAsync(host, unmapped, 16, s) == inval
    assert fake.cuMemcpyDtoHAsync(host, dev.address + 2 * MiB - 8, 16, s) == inval  # runs off
    pageable = ctypes.create_string_buffer(16)
    assert fake.cuMemcpyDtoHAsync(ctypes.addressof(pageable), dev.address, 16, s) == inval
    assert fake.cuMemcpyHtoDAsync(dev.address, host + 8000, 400, s) == inval  # past the pinned
    not_permitted = (CUresult.CUDA_ERROR_NOT_PERMITTED,)
    assert fake.cuStreamWaitEvent(s, ev, 0) == not_permitted      # never recorded
    assert fake.cuEventSynchronize(ev) == not_permitted
    assert fake.cuEventQuery(ev) == not_permitted
    assert fake.cuEventRecord(ev, s) == OK
    assert fake.cuStreamWaitEvent(s, ev, 1) == inval              # flags must be 0
    assert fake.cuStreamDestroy(0) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    # freeing or unmapping memory a queued copy still uses
    assert fake.cuMemcpyDtoHAsync(host, dev.address, 16, s) == OK
    assert fake.cuMemFreeHost(host) == not_permitted
    (m_start,) = [a for a in fake.mappings if a <= dev.address < a + fake.mappings[a]["size"]]
    assert fake.cuMemUnmap(m_start, fake.mappings[m_start]["size"]) == not_permitted
    assert fake.cuStreamDestroy(s) == OK                           # runs the queued copy
    assert fake.queued_ops() == 0
    assert fake.cuMemFreeHost(host) == OK
    bad = (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    assert fake.cuStreamSynchronize(s) == bad                      # destroyed
    assert fake.cuEventDestroy(ev) == OK
    assert fake.cuEventRecord(ev, 0) == bad
    assert fake.cuMemFreeHost(host) == inval                       # double free
    assert len(fake.violations) == 9
    fake.paused = True
    _, ev2 = fake.cuEventCreate(0)
    fake.kernel_write(0, dev.address, b"x")
    fake.cuEventRecord(ev2, 0)
    assert fake.cuEventQuery(ev2) == (CUresult.CUDA_ERROR_NOT_READY,)
    assert fake.cuEventSynchronize(ev2) == OK
    assert fake.cuEventQuery(ev2) == OK
    fake.cuEventDestroy(ev2)


# -- PinnedTier ---------------------------------------------------------------------------------
def test_round_trip_bytes_identical(fake, pool, tier) -> None:
    """FAKE driver: bytes written from one device range come back identical into another,
    for several keys, sizes that are not page multiples, and keys crossing slab boundaries."""
    sizes = [3 * MiB, 5000, 3 * MiB + 123, 1]
    srcs = []
    for key, n in enumerate(sizes):
        src = pool.take(n)
        fake.write_device(src.address, pattern(n, key))
        tier.write_async(key, src, n)
        srcs.append(src)
    for key, n in enumerate(sizes):
        dst = pool.take(n)
        tier.read_async(key, dst).result()
        assert fake.read_device(dst.address, n) == pattern(n, key)
        del dst
    st = tier.stats()
    assert st["writes"] == st["reads"] == len(sizes)
    assert st["bytes_written"] == st["bytes_read"] == sum(sizes)
    assert st["slabs"] == 2 and st["pinned_bytes"] == 8 * MiB     # 4 MiB slabs, grown lazily
    assert st["live_bytes"] == sum(sizes) and st["keys"] == 4
    assert fake.violations == []


def test_swap_out_waits_for_the_compute_stream(fake, pool, tier, monkeypatch) -> None:
    """FAKE driver: bytes produced by a kernel still queued on the compute stream are what
    the swap-out copies. Without the tier's event wait (patched out) the same test sees the
    old bytes: the test would catch a missing wait."""
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.kernel_write(0, src.address, pattern(MiB, 3))    # queued on stream 0, not run
    tier.write_async(1, src, MiB).result()
    tier.read_async(1, dst).result()
    assert fake.read_device(dst.address, MiB) == pattern(MiB, 3)

    fake.cuStreamSynchronize(0)
    monkeypatch.setattr(PinnedTier, "_order_after", lambda self, *a, **k: None)
    fake.kernel_write(0, src.address, pattern(MiB, 4))
    tier.write_async(2, src, MiB).result()
    tier.read_async(2, dst).result()
    assert fake.read_device(dst.address, MiB) == pattern(MiB, 3)   # stale: the bug is seen


def test_swap_in_result_and_wait_on(fake, user_ctx, pool, tier) -> None:
    """FAKE driver: a swap-in's destination is stale until ``result()``; ``wait_on(stream)``
    orders that stream after the copy without a host synchronization."""
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.write_device(src.address, pattern(MiB, 5))
    tier.write_async(1, src, MiB).result()
    f = tier.read_async(1, dst)
    assert fake.read_device(dst.address, 1024) == bytes(1024)       # not copied yet
    f.result()
    assert fake.read_device(dst.address, MiB) == pattern(MiB, 5)

    dst2 = pool.take(MiB)
    f = tier.read_async(1, dst2)
    fake.cuStreamSynchronize(0)                                      # compute alone: no copy
    assert fake.read_device(dst2.address, 1024) == bytes(1024)
    f.wait_on(0)
    n_sync = fake.calls.count("cuEventSynchronize")
    fake.cuStreamSynchronize(0)                                      # now the copy runs first
    assert fake.read_device(dst2.address, MiB) == pattern(MiB, 5)
    assert fake.calls.count("cuEventSynchronize") == n_sync         # the host never waited
    f.result()
    assert f.done()


def test_read_right_after_write_waits_on_the_device(fake, pool, tier) -> None:
    """FAKE driver, paused GPU: ``read_async`` straight after ``write_async`` (no result() in
    between) gets the written bytes: the h2d stream waits for the write's event."""
    fake.paused = True
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.write_device(src.address, pattern(MiB, 6))
    w = tier.write_async(1, src, MiB)
    r = tier.read_async(1, dst)
    assert not w.done() and not r.done()
    assert tier.stats()["in_flight"] == 2
    r.result()
    assert fake.read_device(dst.address, MiB) == pattern(MiB, 6)
    assert w.done() and tier.stats()["in_flight"] == 0


def test_a_poll_asks_each_stream_only_up_to_its_first_copy_not_done(fake, pool, tier) -> None:
    """FAKE driver, paused GPU: with writes and reads queued, each tier call polls its copies
    in flight; a stream completes them in order, so the poll asks one event a stream (not one a
    copy: a Llama's step made 2,077 such queries), and once the GPU runs, books them all."""
    fake.paused = True
    srcs = [pool.take(MiB) for _ in range(4)]
    for i, src in enumerate(srcs):
        fake.write_device(src.address, pattern(MiB, 20 + i))
    futures = [tier.write_async(i, src, MiB) for i, src in enumerate(srcs[:3])]
    futures.append(tier.read_async(0, srcs[3]))
    assert tier.stats()["in_flight"] == 4
    before = fake.calls.count("cuEventQuery")
    tier.write_async(9, srcs[0], MiB)   # polls the 4 in flight first
    assert fake.calls.count("cuEventQuery") - before == 2, "one query a stream, not one a copy"
    fake.paused = False
    before = fake.calls.count("cuEventQuery")
    tier.stats()
    tier.write_async(10, srcs[1], MiB)
    assert all(f.done() for f in futures)
    assert fake.calls.count("cuEventQuery") - before >= 5   # each booked in turn
    futures[-1].result()
    assert fake.read_device(srcs[3].address, MiB) == pattern(MiB, 20)


def test_tier_and_pool_leave_the_callers_context_current() -> None:
    """FAKE driver with per-thread contexts, as the real one: a thread that drives device 1
    uses a tier and a pool of device 0. Their copies run (the bytes round-trip), and after
    every public call the thread's current context is device 1's again, not ooc's."""
    fake = FakeCopyDriver(devices=2)
    assert fake.cuInit(0) == OK
    _, dev1 = fake.cuDeviceGet(1)
    _, ctx1 = fake.cuDevicePrimaryCtxRetain(dev1)
    assert fake.cuCtxSetCurrent(ctx1) == OK
    mine = []

    def current() -> int:
        mine.append(int(fake.current))
        return mine[-1]

    pool = CudaDevicePool(8 * MiB, 2 * MiB, driver=fake)
    tier = PinnedTier(driver=fake, capacity_bytes=8 * MiB, compute_stream=lambda: 0)
    assert current() == int(ctx1)
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.write_device(src.address, pattern(MiB, 3))
    tier.write_async(1, src, MiB).result()
    current()
    f = tier.read_async(1, dst)
    current()
    f.wait_on_device()
    current()
    tier.drain()
    current()
    tier.stats()
    current()
    assert fake.read_device(dst.address, MiB) == pattern(MiB, 3)
    del src, dst
    gc.collect()
    tier.close()
    current()
    pool.close()
    assert current() == int(ctx1) and set(mine) == {int(ctx1)}
    fake.cuDevicePrimaryCtxRelease(dev1)
    assert fake.outstanding() == ZERO and fake.violations == []


def test_drain_waits_for_both_directions_with_one_host_synchronization(fake, pool, tier) -> None:
    """FAKE driver, paused GPU: ``drain()`` (the engine's wait at the commit point and at
    the step's end) completes writes and reads in flight with ONE host synchronization (the
    h2d stream waits on the device for the d2h stream); with nothing in flight it waits for
    nothing at all."""
    fake.paused = True
    a, b, c = pool.take(MiB), pool.take(MiB), pool.take(MiB)
    fake.write_device(a.address, pattern(MiB, 7))
    tier.write_async(1, a, MiB).result()
    fake.write_device(b.address, pattern(MiB, 8))
    w = tier.write_async(2, b, MiB)
    r = tier.read_async(1, c)
    before = tier.stats()["host_syncs"]
    tier.drain()
    assert tier.stats()["host_syncs"] - before == 1
    assert w.done() and r.done() and tier.stats()["in_flight"] == 0
    assert fake.read_device(c.address, MiB) == pattern(MiB, 7)
    d = pool.take(MiB)
    tier.read_async(2, d).result()
    assert fake.read_device(d.address, MiB) == pattern(MiB, 8)      # the write had completed
    before = tier.stats()["host_syncs"]
    tier.drain()
    assert tier.stats()["host_syncs"] == before                     # nothing in flight
    assert fake.violations == []


def test_wait_on_device_finishes_a_swap_in_without_the_host(fake, user_ctx, pool) -> None:
    """FAKE driver: the runtime finishes a swap-in with ``wait_on_device()``: kernels queued
    on the tier's compute stream afterwards see the bytes, and the host never waited; the
    slot helper ``block`` waits on the host for either kind of future."""
    from concurrent.futures import Future

    from ooc.runtime.slots import block

    with PinnedTier(driver=fake, capacity_bytes=8 * MiB, compute_stream=lambda: 0) as t:
        src, dst = pool.take(MiB), pool.take(MiB)
        fake.write_device(src.address, pattern(MiB, 9))
        t.write_async(1, src, MiB).result()
        fake.paused = True                          # the GPU runs only what is waited for
        f = t.read_async(1, dst)
        syncs = t.stats()["host_syncs"]
        f.wait_on_device()
        assert t.stats()["host_syncs"] == syncs and not f.done()
        fake.cuStreamSynchronize(0)                 # the compute stream runs: the copy first
        assert fake.read_device(dst.address, MiB) == pattern(MiB, 9)
        g = t.read_async(1, pool.take(MiB))
        block(g)
        assert g.done()
        done: Future = Future()
        done.set_result(None)
        block(done)                                 # a thread pool's future: returns at once


def test_reserve_allocates_pinned_room_before_the_update_or_refuses(fake, pool) -> None:
    """FAKE driver: ``reserve()`` (the engine's commit point) allocates the pinned slabs the
    update's writes will need, so those writes allocate nothing; room beyond the capacity is
    refused with a StorageError naming the bytes before anything is written."""
    src = pool.take(3 * MiB)
    with PinnedTier(driver=fake, capacity_bytes=8 * MiB, slab_bytes=2 * MiB) as t:
        t.write_async(1, src, 2 * MiB).result()
        t.reserve([(1, 2 * MiB), (None, 3 * MiB)])   # key 1 rewrites in place: 3 MiB more
        slabs = t.stats()["slabs"]
        assert slabs * 2 * MiB >= 2 * MiB + 3 * MiB
        allocs = fake.calls.count("cuMemHostAlloc")
        t.write_async(1, src, 2 * MiB).result()
        t.write_async(2, src, 3 * MiB).result()
        assert fake.calls.count("cuMemHostAlloc") == allocs
        with pytest.raises(StorageError, match=r"reserving room.*9 MiB"):
            t.reserve([(None, 9 * MiB)])
        assert t.stats()["keys"] == 2


def test_driver_errors_become_storage_errors(fake, pool, tier) -> None:
    """FAKE driver: a failing call raises StorageError naming the call, the error, the key
    and the bytes; the tier stays usable and leaks no pinned space."""
    src = pool.take(MiB)
    fake.fail_next("cuMemcpyDtoHAsync", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(StorageError, match=r"cuMemcpyDtoHAsync\(.*CUDA_ERROR_INVALID_VALUE "
                                           r"while swapping out key 7 \(1 MiB, 1048576 bytes"):
        tier.write_async(7, src, MiB)
    assert 7 not in tier and tier.stats()["live_bytes"] == 0
    assert tier._slabs.extents.free_bytes == tier._slabs.extents.end          # the space went back

    fake.fail_next("cuEventSynchronize", CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    f = tier.write_async(8, src, MiB)
    with pytest.raises(StorageError, match="cuEventSynchronize.*CUDA_ERROR_ILLEGAL_ADDRESS.*key 8"):
        f.result()
    assert isinstance(f.exception(), StorageError)
    with pytest.raises(StorageError, match="key 8 cannot be swapped in: its swap-out failed"):
        tier.read_async(8, pool.take(MiB))

    fake.fail_next("cuMemcpyHtoDAsync", CUresult.CUDA_ERROR_INVALID_CONTEXT)
    tier.write_async(9, src, MiB).result()
    with pytest.raises(StorageError, match="cuMemcpyHtoDAsync.*CUDA_ERROR_INVALID_CONTEXT.*"
                                           "swapping in key 9"):
        tier.read_async(9, pool.take(MiB))
    dst = pool.take(MiB)
    tier.read_async(9, dst).result()                                 # still usable

    def boom(*args):
        raise RuntimeError("driver library not found")
    fake.cuEventRecord, saved = boom, fake.cuEventRecord
    with pytest.raises(StorageError, match="cuEventRecord.*raised RuntimeError: driver library"):
        tier.write_async(10, src, MiB)
    fake.cuEventRecord = saved
    with pytest.raises(TypeError, match="DevicePtr"):
        tier.write_async(11, memoryview(b"abc"), 3)
    with pytest.raises(KeyError):
        tier.read_async(12345, dst)


def test_pinned_capacity_and_host_oom(fake, pool) -> None:
    """FAKE driver: going over capacity_bytes, or the driver refusing pinned memory, is a
    StorageError naming the key and the bytes."""
    src = pool.take(3 * MiB)
    with PinnedTier(driver=fake, capacity_bytes=4 * MiB, slab_bytes=2 * MiB) as t:
        t.write_async(1, src, 3 * MiB)
        with pytest.raises(StorageError, match=r"no room for key 2: it needs 3 MiB"):
            t.write_async(2, src, 3 * MiB)
        t.discard(1)
        t.write_async(2, src, 3 * MiB).result()                    # the space is reused
    small = FakeCopyDriver(pinned_limit=2 * MiB)
    p2 = CudaDevicePool(8 * MiB, 2 * MiB, driver=small)
    s2 = p2.take(3 * MiB)
    with PinnedTier(driver=small, capacity_bytes=8 * MiB, slab_bytes=2 * MiB) as t:
        with pytest.raises(StorageError, match="cuMemHostAlloc.*CUDA_ERROR_OUT_OF_MEMORY.*key 5"):
            t.write_async(5, s2, 3 * MiB)
        assert t.stats()["slabs"] == 1 and t._slabs.extents.end == 0
        t.write_async(6, s2, MiB).result()
    del s2
    p2.close()
    assert small.outstanding() == ZERO


def test_extents_reused_and_deferred_while_in_flight(fake, pool, tier) -> None:
    """FAKE driver: discarded and overwritten keys give their pinned space back, but not
    while a copy of them is still in flight."""
    src, dst = pool.take(3 * MiB), pool.take(3 * MiB)
    for i in range(6):                                  # overwrite the same key: no growth
        tier.write_async(1, src, 3 * MiB).result()
    assert tier.stats()["pinned_bytes"] == 4 * MiB
    first = tier._records[1].pieces
    tier.discard(1)
    tier.write_async(2, src, 3 * MiB).result()
    assert tier._records[2].pieces == first             # first fit: the same extent
    fake.paused = True
    r = tier.read_async(2, dst)                         # in flight (the GPU is "slow")
    tier.discard(2)
    tier.write_async(3, src, 3 * MiB)
    assert tier._records[3].pieces != first             # not under the read in flight
    r.result()
    tier.discard(3)
    fake.paused = False
    tier.synchronize()
    assert tier._slabs.extents.free_bytes == tier._slabs.extents.end
    assert tier.trim() == 0 and tier.stats()["slabs"] == 0
    assert fake.violations == []


def test_verify_detects_corrupted_pinned_bytes(fake, pool) -> None:
    """FAKE driver: verify=True keeps a CRC of each key and a change in the pinned bytes
    after the swap-out is a StorageError naming the key."""
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.write_device(src.address, pattern(MiB, 9))
    with PinnedTier(driver=fake, capacity_bytes=8 * MiB, verify=True) as t:
        t.write_async(4, src, MiB)
        t.read_async(4, dst).result()                   # verify waits for the write itself
        assert fake.read_device(dst.address, MiB) == pattern(MiB, 9)
        host = t._slabs.segments(t._records[4])[0][0]
        ctypes.memset(host + 100, 0xFF, 1)
        with pytest.raises(StorageError, match="key 4 is corrupted: CRC-32 mismatch"):
            t.read_async(4, dst)


def test_a_tier_holding_the_last_reference_to_the_current_context_closes_cleanly(fake: FakeCopyDriver) -> None:
    """FAKE driver: a tier whose primary context is the thread's current one and which holds
    its last reference (nothing else retained it: no VMM pool beside it, as with
    ``Options(arena="pytorch")`` over the fake) releases it without switching back to it
    afterwards (that context is gone: CUDA_ERROR_INVALID_CONTEXT)."""
    tier = PinnedTier(driver=fake, capacity_bytes=4 * MiB)
    err, dev = fake.cuDeviceGet(0)
    err, ctx = fake.cuDevicePrimaryCtxRetain(dev)
    fake.cuCtxSetCurrent(ctx)                            # the tier's context is current ...
    fake.cuDevicePrimaryCtxRelease(dev)                  # ... and the tier holds its last reference
    tier.close()                                         # raised StorageError before the fix
    assert fake.violations == [] and fake.outstanding()["retained_contexts"] == 0


def test_close_releases_every_driver_object(fake: FakeCopyDriver) -> None:
    """FAKE driver: close() waits for copies in flight (their futures resolve), then destroys
    streams and events, frees the pinned slabs and releases the context: the fake's live
    object counts return to zero. A collected tier without close() is released too."""
    pool = CudaDevicePool(16 * MiB, 2 * MiB, driver=fake)
    src, dst = pool.take(3 * MiB), pool.take(3 * MiB)
    fake.write_device(src.address, pattern(3 * MiB))
    tier = PinnedTier(driver=fake, capacity_bytes=16 * MiB, slab_bytes=2 * MiB)
    tier.write_async(1, src, 3 * MiB)
    fake.paused = True
    tier.write_async(2, src, 3 * MiB)
    r = tier.read_async(1, dst)
    live = fake.outstanding()
    assert live["streams"] == 2 and live["pinned"] == 3 and live["events"] >= 3
    tier.close()
    r.result()                                           # resolved by close()
    assert fake.read_device(dst.address, 3 * MiB) == pattern(3 * MiB)
    tier.close()                                         # idempotent
    with pytest.raises(StorageError, match="closed"):
        tier.write_async(3, src, MiB)
    left = fake.outstanding()
    assert (left["streams"], left["events"], left["pinned"], left["queued_ops"]) == (0, 0, 0, 0)

    t2 = PinnedTier(driver=fake, capacity_bytes=16 * MiB)
    t2.write_async(1, src, MiB)                          # still queued (paused GPU)
    assert fake.queued_ops() > 0
    del t2                                               # no close(): the finalizer syncs
    gc.collect()                                         # before freeing the pinned slab
    del src, dst
    gc.collect()
    pool.close()
    assert fake.outstanding() == ZERO
    assert fake.violations == []


def test_stats_keys(tier) -> None:
    """FAKE driver: stats() is a plain dict with the documented keys."""
    st = tier.stats()
    for k in ("bytes_written", "bytes_read", "writes", "reads", "wait_s", "failed", "live_bytes",
              "peak_live_bytes", "keys", "pinned_bytes", "peak_pinned_bytes", "slabs",
              "in_flight", "capacity_bytes", "slab_bytes", "verify", "device", "host_syncs"):
        assert k in st
    assert st["capacity_bytes"] == 32 * MiB and st["in_flight"] == 0


def test_setup_error_releases_what_was_made(fake: FakeCopyDriver) -> None:
    """FAKE driver: a failure during construction gives back what was already created."""
    fake.fail_next("cuEventCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(StorageError, match="cuEventCreate.*CUDA_ERROR_OUT_OF_MEMORY"):
        PinnedTier(driver=fake, capacity_bytes=MiB)
    assert fake.outstanding() == ZERO


# -- CudaDevicePool -----------------------------------------------------------------------------
def test_pool_take_and_lifetime_rule(fake: FakeCopyDriver) -> None:
    """FAKE driver: take() maps whole chunks (accessible to copies); the range goes back only
    when the last reference to the returned object is gone, at the next take/reap."""
    pool = CudaDevicePool(8 * MiB, 2 * MiB, driver=fake)
    assert not pool.as_tensor
    a = pool.take(3 * MiB)
    assert isinstance(a, DevicePtr) and a.nbytes == 3 * MiB
    fake.write_device(a.address, pattern(3 * MiB))   # mapped with read/write access
    alias = a
    del a
    pool.reap()
    assert pool.stats()["allocations"] == 1           # alias still holds the range
    b = pool.take(4 * MiB)
    with pytest.raises(OutOfBudget):
        pool.take(2 * MiB)                             # 3 + 4 MiB in 2 MiB chunks = 8 MiB
    del alias
    c = pool.take(2 * MiB)                             # reaped at take: fits now
    assert pool.stats()["allocations"] == 2
    with pytest.raises(Exception, match="live"):
        pool.close()
    del b, c
    pool.close()
    assert fake.outstanding() == ZERO


def test_take_makes_the_tensor_outside_the_pools_lock() -> None:
    """FAKE driver (ooc.testing.fake_cuda): the routing callbacks take the pool's lock while
    PyTorch's allocator holds its mutex, so the pool must never call into PyTorch with its
    lock held; ``take`` builds its tensor after letting the lock go, and a failure to build
    it gives the range back."""
    import ooc.testing

    with ooc.testing.fake_cuda():
        pool = CudaDevicePool(8 * MiB, 64 << 10, as_tensor=True)
        held = []
        wrap = pool._rt.wrap_range

        def spy(*args):
            held.append(pool._lock._is_owned())
            return wrap(*args)
        pool._rt.wrap_range = spy
        t = pool.take(MiB)
        assert t.numel() == MiB and held == [False]

        def broken(*args):
            raise RuntimeError("no tensor")
        pool._rt.wrap_range = broken
        with pytest.raises(RuntimeError, match="no tensor"):
            pool.take(MiB)
        assert pool.allocator.live_allocations == 1           # only t's range
        del t
        gc.collect()
        pool.close()


def test_a_pool_with_tensors_still_alive_lingers_until_they_are_gone(caplog) -> None:
    """FAKE driver: an engine closing while a tensor the user kept still lives in its pool
    must neither raise nor unmap it (a use-after-free on a device): the pool stays, says so,
    and closes once the tensor is gone."""
    import ooc.testing

    with ooc.testing.fake_cuda() as drv:
        pool = CudaDevicePool(8 * MiB, 64 << 10, as_tensor=True)
        kept = pool.take(MiB)
        kept.fill_(7)
        with caplog.at_level("WARNING"):
            assert pool.close_or_linger() is False
        assert "1 tensor(s)" in caplog.text and "1 MiB" in caplog.text
        assert drv.outstanding()["mappings"] > 0 and bool((kept == 7).all())
        assert cuda_pool.close_lingering() == 1          # still in use: still waiting
        del kept
        assert cuda_pool.close_lingering() == 0
        assert drv.outstanding()["mappings"] == 0 and drv.outstanding()["retained_contexts"] == 0
        pool2 = CudaDevicePool(8 * MiB, 64 << 10, as_tensor=True)
        assert pool2.close_or_linger() is True           # nothing in use: closed at once
        assert drv.violations == []


@pytest.mark.parametrize("kernel_ran", [True, False])
def test_a_remap_never_waits_for_the_device(kernel_ran: bool) -> None:
    """FAKE driver with lazy streams: a range is let go while a kernel queued on the compute
    stream still writes into it; its chunks are then stolen for another range. If the
    compute stream has run past the release (the range's fence passed), the old mapping is
    removed at once; if not, it stays (the chunk is mapped twice, which the driver allows)
    until the fence passes, and is removed at a later allocation. Neither waits for the
    device, and the queued kernel never lands on unmapped memory (the fake would record a
    violation); the new range's writer, queued after it, has the last word."""
    import ooc.testing

    chunk = 64 << 10
    with ooc.testing.fake_cuda() as drv:
        pool = CudaDevicePool(4 * chunk, chunk, as_tensor=False)
        a, b = pool.take(2 * chunk), pool.take(2 * chunk)
        drv.paused = not kernel_ran                 # paused: the GPU runs only what is waited for
        assert drv.kernel_write(0, a.address + chunk, b"old" * 1000) == OK
        del a
        gc.collect()
        pool.reap()                                 # a's range is parked, with its fence
        calls = pool.backend.calls
        syncs, unmaps = calls.get("cuCtxSynchronize", 0), calls.get("cuMemUnmap", 0)
        c = pool.take(chunk)                        # the pool is full: steals a's last chunk
        assert drv.kernel_write(0, c.address, b"new" * 1000) == OK
        stats = pool.stats()
        assert calls.get("cuCtxSynchronize", 0) == syncs
        if kernel_ran:
            assert (pool.backend.fences_passed, stats["deferred_unmaps"]) == (1, 0)
            assert calls["cuMemUnmap"] == unmaps + 1
        else:
            assert (stats["deferred_unmaps"], stats["quarantined_ranges"]) == (1, 1)
            assert calls.get("cuMemUnmap", 0) == unmaps           # nothing unmapped yet
            drv.paused = False                                    # the device catches up
            d = pool.take(chunk)                    # the next allocation finds the fence passed
            assert pool.stats()["quarantined_ranges"] == 0
            # both of a's mappings go (the chunk it kept went back to the pool, mapped there too)
            assert calls["cuMemUnmap"] == unmaps + 2 and calls.get("cuCtxSynchronize", 0) == syncs
            del d
        _, dev = drv.cuDeviceGet(0)
        _, ctx = drv.cuDevicePrimaryCtxRetain(dev)          # as PyTorch's thread would
        assert drv.cuCtxSetCurrent(ctx) == OK and drv.cuStreamSynchronize(0) == OK
        drv.cuDevicePrimaryCtxRelease(dev)
        assert drv.read_device(c.address, 3000) == b"new" * 1000
        assert drv.violations == []
        del b, c
        gc.collect()
        pool.close()
        assert drv.violations == [] and drv.outstanding()["mappings"] == 0


def test_no_shrink_of_a_range_the_device_may_still_use() -> None:
    """FAKE driver, the GPU behind: a parked 3-chunk range is the natural one to shrink for
    a 2-chunk request, but unmapping its tail would make the host wait. It is left alone;
    the request steals its chunks without unmapping instead (no synchronization)."""
    import ooc.testing

    chunk = 64 << 10
    with ooc.testing.fake_cuda() as drv:
        pool = CudaDevicePool(4 * chunk, chunk, as_tensor=False)
        a, b = pool.take(3 * chunk), pool.take(chunk)
        drv.paused = True
        assert drv.kernel_write(0, a.address, b"x" * 100) == OK
        del a
        gc.collect()
        pool.reap()
        syncs = pool.backend.calls.get("cuCtxSynchronize", 0)
        c = pool.take(2 * chunk)
        st = pool.stats()
        assert pool.backend.calls.get("cuCtxSynchronize", 0) == syncs
        assert (st["reuse_shrink"], st["deferred_unmaps"]) == (0, 1)
        drv.paused = False
        del b, c
        gc.collect()
        pool.close()
        assert drv.violations == [] and drv.outstanding()["mappings"] == 0


def test_the_engines_pools_fence_the_compute_stream() -> None:
    """FAKE driver: the pools the engine makes (with its tier, and on set_budget) record
    fences on the compute stream; without them every remap would wait for the device."""
    import ooc.testing
    from ooc.runtime.devices import make_pool

    with ooc.testing.fake_cuda():
        tier, pool = make_tier_and_pool("cuda", 8 * MiB, 64 << 10)
        other = make_pool("cuda", 8 * MiB, 64 << 10)
        try:
            assert pool.backend.fence() is not None and other.backend.fence() is not None
        finally:
            tier.close()
            pool.close()
            other.close()


def test_trim_waits_once_for_quarantined_ranges() -> None:
    """FAKE driver: chunks may not be released while still mapped at an old address, so a
    trim with ranges in quarantine synchronizes once and unmaps them all first."""
    import ooc.testing

    chunk = 64 << 10
    with ooc.testing.fake_cuda() as drv:
        pool = CudaDevicePool(4 * chunk, chunk, as_tensor=False)
        a, b = pool.take(2 * chunk), pool.take(2 * chunk)
        drv.paused = True
        assert drv.kernel_write(0, a.address, b"x" * 100) == OK
        del a
        gc.collect()
        pool.reap()
        c = pool.take(chunk)
        assert pool.stats()["quarantined_ranges"] == 1
        syncs = pool.backend.calls.get("cuCtxSynchronize", 0)
        del c
        gc.collect()
        pool.trim()
        assert pool.backend.calls.get("cuCtxSynchronize", 0) == syncs + 1
        assert pool.stats()["quarantined_ranges"] == 0 and drv.violations == []
        del b
        gc.collect()
        pool.close()
        assert drv.violations == [] and drv.outstanding()["mappings"] == 0


def test_callbacks_route_sizes_and_pointers(fake: FakeCopyDriver, caplog) -> None:
    """FAKE driver: the Python functions behind the ctypes allocator callbacks, called through
    real C function pointers as PyTorch would: size -> a pool allocation, free by pointer,
    a refused request -> NULL with the budget error kept, unknown pointers ignored."""
    pool = CudaDevicePool(8 * MiB, 2 * MiB, driver=fake)
    router, c_alloc, c_free = make_callbacks(pool)
    alloc = cuda_pool.ALLOC_FN(ctypes.cast(c_alloc, ctypes.c_void_p).value)
    free = cuda_pool.FREE_FN(ctypes.cast(c_free, ctypes.c_void_p).value)
    p = alloc(3 * MiB, 0, None)
    q = alloc(2 * MiB, 0, None)
    assert p and q and p != q
    assert pool.stats()["allocations"] == 2 and pool.stats()["requested_bytes"] == 5 * MiB
    fake.write_device(p, b"x" * 16)
    assert alloc(4 * MiB, 0, None) is None                # over the budget: NULL
    assert isinstance(router.error, OutOfBudget)
    assert alloc(0, 0, None) is None                       # size 0: NULL, nothing taken
    router.error = None
    assert alloc(MiB, 1, None) is None                     # another device's request
    assert "device 1" in str(router.error)
    free(p, 3 * MiB, 0, None)
    assert pool.stats()["allocations"] == 1
    free(p, 3 * MiB, 0, None)                              # unknown now: logged, ignored
    assert "unknown pointer" in caplog.text
    free(None, 0, 0, None)
    free(q, 2 * MiB, 0, None)
    assert pool.stats()["allocations"] == 0 and (router.allocs, router.frees) == (2, 2)
    assert router in pool._routers                         # kept alive with the pool
    pool.close()
    assert fake.outstanding() == ZERO


def test_route_allocations_needs_cuda_torch(fake: FakeCopyDriver) -> None:
    """On this CPU-only PyTorch, routing allocations is refused with a clear OOCError."""
    if torch.cuda.is_available():
        pytest.skip("this PyTorch has CUDA")
    pool = CudaDevicePool(4 * MiB, 2 * MiB, driver=fake)
    with pytest.raises(OOCError, match="needs a CUDA build of PyTorch"):
        with route_allocations(pool):
            pass
    with pytest.raises(OOCError, match="as_tensor=True"):
        CudaDevicePool(4 * MiB, 2 * MiB, driver=FakeCopyDriver(), as_tensor=True)
    pool.close()


# -- devices.py ---------------------------------------------------------------------------------
def test_make_tier_and_pool_by_device(fake: FakeCopyDriver, tmp_path, monkeypatch) -> None:
    """CPU gives (FileTier, CpuDevicePool); CUDA with the FAKE driver gives (PinnedTier,
    CudaDevicePool) working together; CUDA without cuda-python says what to install."""
    from ooc.runtime.cpu_pool import CpuDevicePool
    from ooc.runtime.pool import DevicePool
    from ooc.storage.tier import SlowerTier
    from ooc.storage import FileTier

    tier, pool = make_tier_and_pool("cpu", 8 * MiB, 2 * MiB, str(tmp_path), 1, False)
    assert isinstance(tier, FileTier) and isinstance(pool, CpuDevicePool)
    assert isinstance(tier, SlowerTier) and isinstance(pool, DevicePool)
    tier.close()

    tier, pool = make_tier_and_pool("cuda:0", 8 * MiB, 2 * MiB, None, 2, True, driver=fake,
                                    pinned_capacity="16MiB")
    assert isinstance(tier, PinnedTier) and isinstance(pool, CudaDevicePool)
    assert tier.verify and tier.capacity_bytes == 16 * MiB
    src, dst = pool.take(MiB), pool.take(MiB)
    fake.write_device(src.address, pattern(MiB))
    tier.write_async(1, src, MiB)
    tier.read_async(1, dst).result()
    assert fake.read_device(dst.address, MiB) == pattern(MiB)
    tier.close()
    del src, dst
    pool.close()
    assert fake.outstanding() == ZERO

    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)      # cuda-python "not installed"
    with pytest.raises(OOCError, match=r"pip install 'ooc\[cuda\]'"):
        make_tier_and_pool("cuda", 8 * MiB, 2 * MiB)
    with pytest.raises(OOCError, match=r"pip install 'ooc\[cuda\]'"):
        PinnedTier()
    with pytest.raises(OOCError, match="cpu' and 'cuda"):
        make_tier_and_pool("meta", 8 * MiB, 2 * MiB)


def test_byte_view_for() -> None:
    """CPU storages give a writable memoryview; CUDA ones a DevicePtr (a stand-in storage
    here, since this PyTorch has no CUDA)."""
    s = torch.arange(16, dtype=torch.uint8).untyped_storage()
    v = byte_view_for(s)
    assert isinstance(v, memoryview) and bytes(v) == bytes(range(16))

    class CudaStorage:
        device = torch.device("cuda", 0)

        def data_ptr(self) -> int:
            return 0x7F00_0000_0000

        def nbytes(self) -> int:
            return 4096

    assert byte_view_for(CudaStorage()) == DevicePtr(0x7F00_0000_0000, 4096)
    with pytest.raises(ValueError):
        DevicePtr(-1, 4)


def test_the_seam_asks_pytorch_for_the_raw_stream_handle_where_it_can(monkeypatch) -> None:
    """``CudaRuntime.compute_stream`` calls PyTorch's raw current-stream handle for the device
    it was made for (no ``Stream`` object a transfer), and falls back to
    ``torch.cuda.current_stream`` on a build without it (this CPU build: not called here)."""
    from ooc.runtime.cuda_seam import CudaRuntime

    asked = []

    def raw(index: int) -> int:
        asked.append(index)
        return 0x7000 + index

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw, raising=False)
    current = CudaRuntime().compute_stream(2)
    assert (current(), current(), asked) == (0x7002, 0x7002, [2, 2])
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    assert callable(CudaRuntime().compute_stream(0)) and asked == [2, 2]
