"""The CUDA tier and pool on a REAL GPU. Every test is marked ``gpu`` and skips where
``torch.cuda.is_available()`` is false (tests/conftest.py), which is every machine of this
project so far: THESE TESTS HAVE NOT RUN. They are the first thing to run on a GPU machine
(``pytest -m gpu tests/ooc/test_cuda_gpu.py``); the same code paths are exercised against a
fake driver in ``test_cuda_tier.py``.

Needs the ``cuda`` extra (cuda-python, cupy, nvtx): tests that need a missing piece skip.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def driver():
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    from ooc.runtime.cuda_tier import import_driver

    torch.cuda.init()   # PyTorch makes the primary context the tier and pool retain
    return import_driver()


def _ptr(t: torch.Tensor):
    from ooc.runtime.devices import DevicePtr

    return DevicePtr(t.data_ptr(), t.numel() * t.element_size())


def test_gpu_pinned_round_trip(driver) -> None:
    """REAL GPU: bytes produced by a kernel on the compute stream go to pinned memory and come
    back identical into another tensor; result() synchronizes."""
    from ooc.runtime.cuda_tier import PinnedTier

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    with PinnedTier(capacity_bytes=64 * MiB, slab_bytes=16 * MiB, verify=True,
                    compute_stream=stream) as tier:
        x = torch.randn(3 * MiB // 4, device="cuda") * 3 + 1   # a kernel still queued, maybe
        tier.write_async(1, _ptr(x), x.nbytes).result()
        y = torch.empty_like(x)
        tier.read_async(1, _ptr(y)).result()
        assert torch.equal(x, y)
        st = tier.stats()
        assert st["bytes_written"] == st["bytes_read"] == x.nbytes


def test_gpu_wait_on_orders_the_compute_stream(driver) -> None:
    """REAL GPU: wait_on(current stream) instead of result(): kernels queued afterwards on that
    stream see the swapped-in bytes without a host synchronization."""
    from ooc.runtime.cuda_tier import PinnedTier

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    with PinnedTier(capacity_bytes=64 * MiB, compute_stream=stream) as tier:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        tier.write_async(7, _ptr(x), x.nbytes).result()
        y = torch.zeros_like(x)
        f = tier.read_async(7, _ptr(y))
        f.wait_on(torch.cuda.current_stream().cuda_stream)
        assert torch.equal(y * 2, x * 2)                      # ordered on the stream
        f.result()


def test_gpu_pool_tensor_and_lifetime(driver) -> None:
    """REAL GPU: CudaDevicePool.take gives a zero-copy uint8 CUDA tensor over a VMM range;
    the range goes back when the last view of it dies."""
    pytest.importorskip("cupy", reason="needs cupy: pip install 'ooc[cuda]'")
    from ooc.runtime.cuda_pool import CudaDevicePool

    pool = CudaDevicePool(16 * MiB, 2 * MiB)
    t = pool.take(3 * MiB)
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 3 * MiB
    t.fill_(7)
    view = t[MiB:].view(torch.int32)
    del t
    pool.reap()
    assert pool.stats()["allocations"] == 1
    assert int(view[0]) == 0x07070707
    del view
    torch.cuda.synchronize()
    pool.reap()
    assert pool.stats()["allocations"] == 0
    pool.close()


def test_gpu_route_allocations_into_the_pool(driver) -> None:
    """REAL GPU: PyTorch's allocations inside route_allocations come from the VMM pool."""
    from ooc.runtime.cuda_pool import CudaDevicePool, route_allocations

    pool = CudaDevicePool(64 * MiB, 2 * MiB)
    with route_allocations(pool):
        x = torch.ones(1 << 20, device="cuda")
        y = x * 2
    assert pool.stats()["allocations"] >= 1
    assert float(y.sum()) == 2 * (1 << 20)
    del x, y


def test_gpu_tiny_out_of_core_step() -> None:
    """REAL GPU: a tiny OutOfCore training step on cuda matches in-core training bitwise.
    Not yet run on hardware (no GPU on this project's machines)."""
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python: pip install 'ooc[cuda]'")
    import copy

    import torch.nn as nn

    from ooc.engine import OutOfCore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10)).cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(512, 256, device="cuda")
    target = torch.randint(0, 10, (512,), device="cuda")
    engine = OutOfCore(model, opt, budget="4MiB", device="cuda", chunk="2MiB", min_bytes=4096)
    for _ in range(3):
        with engine.step():
            nn.functional.cross_entropy(model(x), target).backward()
            engine.optimizer_step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), target).backward()
        ref_opt.step()
    engine.close()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
