"""CudaBackend against a FAKE driver (tests/fakes/fake_cuda_driver.py), plus real-GPU tests.

Everything here except the tests marked ``gpu`` runs against the fake driver module: it
checks that the backend calls the documented driver API in the right order and cleans up
completely, and that the fake itself refuses misuse (so passing against it means
something). The ``gpu`` tests run the same allocator on a real device and skip without one.
"""

from __future__ import annotations

import sys

import pytest

from tests.fakes import fake_cuda_driver as fake_mod
from tests.fakes.fake_cuda_driver import CUresult, FakeDriver
from vmm import ChunkPool, CudaBackend, OutOfBudget, VirtualAllocator, VMMError
from vmm.backend import BackendCallError, ContractError, DeviceOutOfMemory

MiB = 1 << 20
SETUP = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuMemGetAllocationGranularity"]
CONTEXT_CALLS = ("cuCtxGetCurrent", "cuCtxSetCurrent")


def _driver_calls(fake: FakeDriver) -> list[str]:
    """The calls that do the work: context switches are checked on their own below."""
    return [c for c in fake.calls if c not in ("launch", "cuGetErrorName") + CONTEXT_CALLS]


# -- the backend, against the fake driver -----------------------------------------------------
def test_fake_driver_backend_setup_and_granularity() -> None:
    """FAKE driver: setup calls in order, granularity from the driver."""
    fake = FakeDriver(granularity=4 * MiB)
    backend = CudaBackend(0, driver=fake)
    assert _driver_calls(fake) == SETUP
    assert backend.granularity == 4 * MiB
    assert fake.retained == {0: 1} and fake.current is None   # the thread had none: still none
    backend.close()
    assert fake.outstanding() == {"handles": 0, "reservations": 0, "mappings": 0,
                                  "retained_contexts": 0}


def test_fake_driver_call_order_and_complete_teardown() -> None:
    """FAKE driver: create -> reserve -> map each chunk -> set access; then synchronize
    before unmapping, unmap each chunk, free the range, release the chunks, release the
    context. Nothing is left outstanding and the strict fake saw no violation."""
    fake = FakeDriver()
    backend = CudaBackend(driver=fake)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 64 * MiB), keep_mapped=False)
    a = va.alloc(5 * MiB)
    assert _driver_calls(fake)[len(SETUP):] == (
        ["cuMemCreate"] * 3 + ["cuMemAddressReserve"] + ["cuMemMap"] * 3 + ["cuMemSetAccess"])
    assert fake.launch(a.address, a.mapped_bytes) == (CUresult.CUDA_SUCCESS,)
    n = len(_driver_calls(fake))
    va.free(a)
    assert _driver_calls(fake)[n:] == ["cuCtxSynchronize"] + ["cuMemUnmap"] * 3
    va.close()
    backend.close()
    tail = _driver_calls(fake)[-5:]
    assert tail == ["cuMemAddressFree"] + ["cuMemRelease"] * 3 + ["cuDevicePrimaryCtxRelease"]
    assert fake.violations == []
    assert fake.outstanding() == {"handles": 0, "reservations": 0, "mappings": 0,
                                  "retained_contexts": 0}
    assert fake.used_bytes == 0


def test_fake_driver_close_tears_down_live_state() -> None:
    """FAKE driver: closing the backend with chunks still mapped unmaps (after a
    synchronize), releases and frees everything."""
    fake = FakeDriver()
    backend = CudaBackend(driver=fake)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 64 * MiB))
    a = va.alloc(7 * MiB)
    fake.launch(a.address, a.nbytes)                 # work still pending
    backend.close()
    assert fake.violations == []
    assert fake.outstanding() == {"handles": 0, "reservations": 0, "mappings": 0,
                                  "retained_contexts": 0}
    backend.close()                                  # idempotent
    with pytest.raises(VMMError, match="after close"):
        backend.create_chunk(2 * MiB)


def test_fake_driver_stream_synchronize_is_used_when_given() -> None:
    """FAKE driver: with a stream, the backend waits on it instead of the context."""
    fake = FakeDriver()
    backend = CudaBackend(driver=fake, stream=fake.CUstream(7))
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 8 * MiB), keep_mapped=False)
    va.free(va.alloc(MiB))
    assert "cuStreamSynchronize" in fake.calls and "cuCtxSynchronize" not in fake.calls


def test_fake_driver_error_becomes_clear_vmm_error() -> None:
    """FAKE driver: an error code names the call and the CUDA error."""
    fake = FakeDriver()
    backend = CudaBackend(driver=fake)
    fake.fail_next("cuMemMap", CUresult.CUDA_ERROR_INVALID_VALUE)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 64 * MiB))
    with pytest.raises(BackendCallError, match=r"cuMemMap\(.*CUDA_ERROR_INVALID_VALUE"):
        va.alloc(4 * MiB)
    va.check()                                       # the allocator's books are intact
    a = va.alloc(4 * MiB)                            # and it still works afterwards
    va.free(a)
    va.close()
    backend.close()
    assert fake.outstanding()["mappings"] == 0 and fake.outstanding()["handles"] == 0


def test_fake_driver_out_of_memory_is_out_of_budget() -> None:
    """FAKE driver: CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate is an OutOfBudget."""
    fake = FakeDriver(memory_bytes=6 * MiB)
    backend = CudaBackend(driver=fake)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 64 * MiB))
    with pytest.raises(OutOfBudget, match="cuMemCreate.*CUDA_ERROR_OUT_OF_MEMORY") as err:
        va.alloc(8 * MiB)
    assert isinstance(err.value, DeviceOutOfMemory)
    va.check()
    # the chunks made before the failure are cached, not leaked, and serve the next request
    assert va.pool.handed_out == 0 and va.pool.cached == 3
    a = va.alloc(6 * MiB)
    va.free(a)
    va.trim()
    assert fake.used_bytes == 0 and fake.outstanding()["handles"] == 0


@pytest.mark.parametrize("mode", [{"lean": True}, {}])
def test_fake_driver_failure_after_stealing_loses_no_chunk(mode) -> None:
    """FAKE driver: a request that first steals parked chunks and then fails in the
    driver (out of memory, or cuMemSetAccess refused) leaves every chunk accounted for."""
    fake = FakeDriver(memory_bytes=8 * MiB)
    backend = CudaBackend(driver=fake)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 64 * MiB), **mode)
    va.free(va.alloc(4 * MiB))                    # 2 chunks parked
    with pytest.raises(DeviceOutOfMemory):
        va.alloc(10 * MiB)                        # 5 chunks: 2 stolen (lean) + 3 new > 8 MiB
    va.check()
    fake.fail_next("cuMemSetAccess", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(BackendCallError, match="cuMemSetAccess"):
        va.alloc(6 * MiB)
    va.check()
    a = va.alloc(8 * MiB)                         # all four chunks the device has
    va.free(a)
    va.close()
    backend.close()
    assert fake.outstanding() == {"handles": 0, "reservations": 0, "mappings": 0,
                                  "retained_contexts": 0}


def test_fake_driver_stealing_from_several_ranges_synchronizes_once() -> None:
    """FAKE driver: a request that steals chunks from three parked ranges unmaps all three
    after one device synchronization (nothing is queued between the unmaps); two requests
    that each steal synchronize once each (work may be queued in between)."""
    fake = FakeDriver()
    backend = CudaBackend(driver=fake)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 6 * MiB))
    parts = [va.alloc(2 * MiB) for _ in range(3)]
    for a in parts:
        va.free(a)                                # three one-chunk ranges parked, budget full
    syncs = fake.calls.count("cuCtxSynchronize")
    big = va.alloc(6 * MiB)                       # three chunks, all stolen
    assert fake.calls.count("cuCtxSynchronize") - syncs == 1
    assert va.stats()["unmap_calls"] == 3
    va.free(big)
    small = [va.alloc(2 * MiB) for _ in range(2)]  # each shrinks/steals from the parked range
    assert fake.calls.count("cuCtxSynchronize") - syncs == 1 + 2
    for a in small:
        va.free(a)
    va.close()
    backend.close()


def test_fake_driver_setup_errors() -> None:
    """FAKE driver: a bad device ordinal / no device fail at construction, named."""
    with pytest.raises(BackendCallError, match="cuDeviceGet.*CUDA_ERROR_INVALID_DEVICE"):
        CudaBackend(3, driver=FakeDriver())
    with pytest.raises(BackendCallError, match="cuInit.*CUDA_ERROR_NO_DEVICE"):
        CudaBackend(driver=FakeDriver(devices=0))


def test_fake_driver_exception_in_binding_is_wrapped() -> None:
    """FAKE driver: a binding that raises (no libcuda) becomes a BackendCallError."""
    fake = FakeDriver()

    def broken(flags):
        raise RuntimeError("libcuda.so not found")

    fake.cuInit = broken
    with pytest.raises(BackendCallError, match="cuInit.*RuntimeError.*libcuda"):
        CudaBackend(driver=fake)


def test_fake_driver_backend_rejects_misuse_before_the_driver() -> None:
    """FAKE driver: the backend's own ledger refuses a double map without calling the driver."""
    fake = FakeDriver()
    b = CudaBackend(driver=fake)
    h = b.create_chunk(2 * MiB)
    r = b.reserve_range(4 * MiB)
    b.map(r, h, 2 * MiB)
    n = len(_driver_calls(fake))
    with pytest.raises(ContractError, match="double map"):
        b.map(r, h, 2 * MiB)
    assert len(_driver_calls(fake)) == n
    b.close()


def _spy_context(fake: FakeDriver, names: tuple[str, ...]) -> list[tuple[str, int]]:
    """Record, for each call of ``names``, which context was current when it ran."""
    seen: list[tuple[str, int]] = []
    for name in names:
        real = getattr(fake, name)

        def spy(*args, _real=real, _name=name):
            seen.append((_name, int(fake.current) if fake.current is not None else 0))
            return _real(*args)
        setattr(fake, name, spy)
    return seen


def test_fake_driver_backend_runs_in_its_context_and_restores_the_callers() -> None:
    """FAKE driver (per-thread contexts, as the real one): a thread working on device 1 uses
    a backend of device 0. Every driver call of the backend runs in device 0's context, and
    after each public call the thread's current context is device 1's again; a thread with
    no context is left with none."""
    import threading

    fake = FakeDriver(devices=2)
    assert fake.cuInit(0) == (CUresult.CUDA_SUCCESS,)
    _, dev1 = fake.cuDeviceGet(1)
    _, ctx1 = fake.cuDevicePrimaryCtxRetain(dev1)
    assert fake.cuCtxSetCurrent(ctx1) == (CUresult.CUDA_SUCCESS,)
    seen = _spy_context(fake, ("cuMemCreate", "cuMemAddressReserve", "cuMemMap",
                               "cuMemSetAccess", "cuCtxSynchronize", "cuMemUnmap",
                               "cuMemRelease", "cuMemAddressFree"))
    backend = CudaBackend(0, driver=fake)
    assert int(fake.current) == int(ctx1)
    va = VirtualAllocator(ChunkPool(backend, 2 * MiB, 16 * MiB), keep_mapped=False)
    a = va.alloc(3 * MiB)
    assert int(fake.current) == int(ctx1)
    va.free(a)
    assert int(fake.current) == int(ctx1)

    left: list = []

    def elsewhere() -> None:
        b = va.alloc(2 * MiB)
        va.free(b)
        left.append(fake.current)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert left == [None]
    va.close()
    backend.close()
    assert int(fake.current) == int(ctx1)
    names = {name for name, _ in seen}
    assert {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"} <= names
    assert {ctx for _, ctx in seen} == {0xC0}, seen   # device 0's primary context, always
    fake.cuDevicePrimaryCtxRelease(dev1)
    assert fake.outstanding()["retained_contexts"] == 0


def test_fake_driver_lazy_import_path(monkeypatch) -> None:
    """FAKE driver installed as ``cuda.bindings.driver``: CudaBackend() imports it lazily."""
    import types

    fake = FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = fake.as_module()
    cuda_pkg = types.ModuleType("cuda")
    cuda_pkg.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", bindings.driver)
    backend = CudaBackend()
    assert _driver_calls(fake) == SETUP
    backend.close()


def test_missing_cuda_python_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(VMMError, match="needs cuda-python"):
        CudaBackend()


def test_vmm_import_does_not_import_cuda_python() -> None:
    import subprocess

    code = ("import sys, vmm; vmm.VirtualAllocator; vmm.CachingAllocator; vmm.HostBackend;"
            "import vmm.replay; print(any(m.startswith('cuda') for m in sys.modules),"
            " 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# -- the fake is not a pushover --------------------------------------------------------------
@pytest.fixture()
def drv() -> FakeDriver:
    d = FakeDriver()
    assert d.cuInit(0) == (CUresult.CUDA_SUCCESS,)
    _, dev = d.cuDeviceGet(0)
    _, ctx = d.cuDevicePrimaryCtxRetain(dev)
    d.cuCtxSetCurrent(ctx)
    return d


def _prop(d: FakeDriver, device: int = 0):
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def _rw(d: FakeDriver):
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = 0
    a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [a]


INVALID = (CUresult.CUDA_ERROR_INVALID_VALUE,)


def test_fake_driver_refuses_calls_before_init_and_without_context() -> None:
    d = FakeDriver()
    assert d.cuDeviceGet(0)[0] == CUresult.CUDA_ERROR_NOT_INITIALIZED
    d.cuInit(0)
    assert d.cuMemCreate(2 * MiB, _prop(d), 0)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT


def test_fake_driver_refuses_bad_sizes_props_and_flags(drv) -> None:
    d = drv
    assert d.cuMemCreate(3 * MiB, _prop(d), 0) == INVALID + (None,)
    assert d.cuMemCreate(2 * MiB, _prop(d, device=5), 0)[0] == INVALID[0]
    assert d.cuMemCreate(2 * MiB, d.CUmemAllocationProp(), 0)[0] == INVALID[0]   # not pinned
    assert d.cuMemCreate(2 * MiB, _prop(d), 1)[0] == INVALID[0]
    assert d.cuMemAddressReserve(MiB, 0, 0, 0)[0] == INVALID[0]
    assert d.cuMemAddressReserve(2 * MiB, 3, 0, 0)[0] == INVALID[0]            # alignment
    assert d.cuMemCreate(32 << 30, _prop(d), 0)[0] == CUresult.CUDA_ERROR_OUT_OF_MEMORY


def test_fake_driver_refuses_mapping_misuse(drv) -> None:
    d = drv
    _, h = d.cuMemCreate(4 * MiB, _prop(d), 0)
    _, h2 = d.cuMemCreate(2 * MiB, _prop(d), 0)
    _, va = d.cuMemAddressReserve(8 * MiB, 0, 0, 0)
    base = int(va)
    assert d.cuMemMap(base + 8 * MiB, 2 * MiB, 0, h2, 0) == INVALID        # outside the range
    assert d.cuMemMap(base + 6 * MiB, 4 * MiB, 0, h, 0) == INVALID         # runs past its end
    assert d.cuMemMap(base + MiB, 2 * MiB, 0, h2, 0) == INVALID            # unaligned
    assert d.cuMemMap(base, 4 * MiB, 2 * MiB, h, 0) == INVALID             # offset+size > handle
    assert d.cuMemMap(base, 4 * MiB, 0, h, 0) == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemMap(base + 2 * MiB, 2 * MiB, 0, h2, 0) == INVALID        # double map
    assert d.cuMemMap(base, 2 * MiB, 0, h2, 0) == INVALID                  # double map
    # access before set: a kernel touching it faults
    assert d.launch(base, 4 * MiB) == (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
    assert d.cuMemSetAccess(base, 8 * MiB, _rw(d), 1) == INVALID           # not fully mapped
    assert d.cuMemSetAccess(base, 4 * MiB, _rw(d), 2) == INVALID           # count mismatch
    assert d.cuMemSetAccess(base, 4 * MiB, _rw(d), 1) == (CUresult.CUDA_SUCCESS,)
    assert d.launch(base, 4 * MiB) == (CUresult.CUDA_SUCCESS,)
    assert d.launch(base, 6 * MiB) == (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
    # teardown order
    assert d.cuMemUnmap(base, 2 * MiB) == INVALID                          # part of a mapping
    assert d.cuMemAddressFree(base, 8 * MiB) == INVALID                    # still mapped
    assert d.cuMemAddressFree(base, 4 * MiB) == INVALID                    # not the whole range
    assert d.cuMemRelease(h)[0] == CUresult.CUDA_ERROR_NOT_PERMITTED       # still mapped
    assert d.cuMemUnmap(base, 4 * MiB)[0] == CUresult.CUDA_ERROR_NOT_PERMITTED  # unsynced
    assert len(d.violations) == 2
    assert d.cuCtxSynchronize() == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemUnmap(base, 4 * MiB) == (CUresult.CUDA_SUCCESS,)
    assert d.launch(base, 2 * MiB) == (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)  # unmapped
    assert d.cuMemRelease(h) == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemRelease(h) == INVALID                                    # twice
    assert d.cuMemMap(base, 4 * MiB, 0, h, 0) == INVALID                   # released handle
    assert d.cuMemAddressFree(base, 8 * MiB) == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemRelease(h2) == (CUresult.CUDA_SUCCESS,)
    assert d.outstanding()["handles"] == 0 and d.used_bytes == 0


def test_fake_driver_lenient_mode_defers_release_like_the_real_driver(drv) -> None:
    d = FakeDriver(strict=False)
    d.cuInit(0)
    _, dev = d.cuDeviceGet(0)
    _, ctx = d.cuDevicePrimaryCtxRetain(dev)
    d.cuCtxSetCurrent(ctx)
    _, h = d.cuMemCreate(2 * MiB, _prop(d), 0)
    _, va = d.cuMemAddressReserve(2 * MiB, 0, 0, 0)
    d.cuMemMap(va, 2 * MiB, 0, h, 0)
    assert d.cuMemRelease(h) == (CUresult.CUDA_SUCCESS,)    # allowed, memory kept until unmap
    assert d.used_bytes == 2 * MiB and d.violations
    d.cuMemUnmap(va, 2 * MiB)
    assert d.used_bytes == 0 and d.outstanding()["handles"] == 0


def test_fake_driver_returns_tuples_and_error_names(drv) -> None:
    assert drv.cuGetErrorName(CUresult.CUDA_ERROR_OUT_OF_MEMORY) == (
        CUresult.CUDA_SUCCESS, b"CUDA_ERROR_OUT_OF_MEMORY")
    assert isinstance(drv.cuCtxSynchronize(), tuple)
    assert fake_mod.new().calls == []


# -- a real GPU (skipped here: no device) -----------------------------------------------------
@pytest.mark.gpu
def test_gpu_virtual_allocation_round_trip() -> None:
    """REAL driver: map chunks, write through torch, read back through a second range."""
    torch = pytest.importorskip("torch")
    backend = CudaBackend(torch.cuda.current_device())
    va = VirtualAllocator(ChunkPool(backend, backend.granularity, 16 * backend.granularity))
    a = va.alloc(3 * backend.granularity)

    class _Ptr:
        def __init__(self, ptr: int, n: int) -> None:
            self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1",
                                             "data": (ptr, False), "version": 3}

    t = torch.as_tensor(_Ptr(a.address, a.nbytes), device="cuda")
    t.fill_(7)
    torch.cuda.synchronize()
    chunk0 = a.chunks[0]
    r = backend.reserve_range(backend.granularity)
    backend.map(r, chunk0.handle, backend.granularity)
    backend.set_access(r, backend.granularity)
    other = torch.as_tensor(_Ptr(r, backend.granularity), device="cuda")
    assert int(other.sum()) == 7 * backend.granularity
    del t, other
    backend.unmap(r, backend.granularity)
    backend.free_range(r, backend.granularity)
    va.free(a)
    va.close()
    backend.close()


@pytest.mark.gpu
def test_gpu_out_of_budget_and_teardown() -> None:
    torch = pytest.importorskip("torch")
    backend = CudaBackend(torch.cuda.current_device())
    g = backend.granularity
    va = VirtualAllocator(ChunkPool(backend, g, 4 * g))
    a = va.alloc(4 * g)
    with pytest.raises(OutOfBudget):
        va.alloc(1)
    va.free(a)
    va.close()
    backend.close()
