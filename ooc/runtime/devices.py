"""Which slower tier and which device pool serve a device: :func:`make_tier_and_pool`.

The engine moves bytes between a device pool (:class:`~ooc.runtime.pool.DevicePool`) and a
slower tier (:class:`~ooc.storage.tier.SlowerTier`); which ones, and what a "pointer to
bytes" is, depends on the device:

======  ==================================  ===========================================
device  slower tier / device pool            bytes handed to the tier
======  ==================================  ===========================================
cpu     ``FileTier`` / ``CpuDevicePool``     a ``memoryview`` over the storage
cuda    ``PinnedTier`` / ``CudaDevicePool``  a ``DevicePtr`` (device address and bytes);
                                             the tier copies with the driver's async
                                             memcpy on its own streams
======  ==================================  ===========================================

On CUDA, ``arena="pytorch"`` (``ooc.Options(arena=...)``) takes the swap-ins from PyTorch's
caching allocator instead (:class:`~ooc.runtime.torch_arena.TorchArenaPool`: one arena, why
there); the tier is the same.

:func:`make_tier_and_pool` (and :func:`make_pool` when the chunk changes) and
:func:`~ooc.storage.device_bytes.byte_view_for` are the calls the engine makes; the rest of the
runtime does not look at the device. CUDA outside the driver goes through one seam,
:func:`~ooc.runtime.cuda_seam.cuda_runtime` (re-exported here with :class:`DevicePtr`,
:class:`CudaRuntime`, :func:`set_cuda_runtime` and :func:`byte_view_for`, their old home).

This module is the top of the runtime's device layer: it imports the tiers and pools, and
none of them imports it.

The CUDA half runs on an H100 (``benchmarks/bench_gpu.py``, ``tests/ooc/test_cuda_gpu.py``,
which skip without CUDA) and, in CI, over the fake driver
(``tests/ooc/test_cuda_fake_e2e.py``).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from ooc.errors import OOCError
from ooc.host import cpu_allocator
from ooc.storage.device_bytes import byte_view_for
from ooc.runtime.cpu_pool import CpuDevicePool
from ooc.runtime.cuda_pool import CudaDevicePool
from ooc.runtime.cuda_seam import CudaRuntime, DevicePtr, cuda_runtime, set_cuda_runtime
from ooc.storage.cuda_tier import PinnedTier
from ooc.runtime.pool import DevicePool
from ooc.runtime.torch_arena import TorchArenaPool, resolve_arena
from ooc.storage import FileTier
from ooc.storage.tier import SlowerTier
from vmm.cuda_driver import CudaDriver
from vmm.pool import ChunkSizeError
from vmm.units import format_size

__all__ = ["CudaRuntime", "DevicePtr", "byte_view_for", "cuda_runtime", "make_pool",
           "make_tier_and_pool", "set_cuda_runtime"]

_pool_ids = itertools.count(1)   # names each CPU pool to the allocator's bound


def make_tier_and_pool(device: "str | torch.device", budget: int, chunk: int,
                       storage: str | None = None, threads: int = 2, verify: bool = False, *,
                       driver: Any = None, pinned_capacity: int | str | None = None,
                       compute_stream: Any = None, arena: str = "pool") -> tuple[SlowerTier, DevicePool]:
    """The slower tier and the budgeted device pool for ``device``: ``(tier, pool)``.

    - ``cpu``: ``(FileTier(storage, threads=threads, verify=verify, chunk_bytes=chunk),
      CpuDevicePool(budget, chunk, share_pages=True))``: its chunks' pages come from and go
      back to ooc's CPU allocator's cache.
    - ``cuda[:i]``: ``(PinnedTier(...), CudaDevicePool(budget, chunk, device=i))``; ``storage``
      and ``threads`` do not apply (the slower tier is pinned host memory, moved by copy
      streams). ``pinned_capacity`` caps the pinned memory (default: half the host RAM).
      ``compute_stream`` is the stream whose kernels produce and consume the swapped bytes
      (an int handle, a ``CUstream`` or a callable returning one); default: PyTorch's current
      stream on that device at each transfer, or the driver's default stream 0 when
      ``driver`` is given.

    ``arena="pytorch"`` (CUDA only; what ``"auto"`` is on CUDA, see
    :func:`~ooc.runtime.torch_arena.resolve_arena`): a
    :class:`~ooc.runtime.torch_arena.TorchArenaPool` instead of the VMM pool, with the VMM
    granularity the pool would have had. The default here stays ``"pool"``: the engine passes
    its resolved ``Options.arena``.

    ``driver`` replaces ``cuda.bindings.driver`` (tests pass a fake; the pool then hands out
    :class:`DevicePtr`). Without it, the driver, the device index, the compute stream and the
    pool's tensors come from :func:`cuda_runtime` (the real CUDA: cuda-python, cupy and a CUDA
    build of PyTorch, a missing one raising :class:`~ooc.errors.OOCError` naming
    ``pip install 'ooc[cuda]'``; or the fake one of :func:`ooc.testing.fake_cuda`).
    """
    dev = torch.device(device)
    arena = resolve_arena(dev, arena)
    if dev.type == "cpu":
        pool = make_pool(dev, budget, chunk)
        return FileTier(storage, threads=threads, verify=verify, chunk_bytes=chunk), pool
    if dev.type != "cuda":
        raise OOCError(f"device {dev}: the runtime handles 'cpu' and 'cuda' devices only")

    rt = cuda_runtime()
    real = driver is None   # the seam's driver ("real" to this function, fake or not)
    if real:
        driver = rt.driver(f"device {dev}")  # OOCError naming pip install 'ooc[cuda]'
        if not rt.is_available():
            raise OOCError(f"device {dev}: this PyTorch has no usable CUDA "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                           "install a CUDA build of PyTorch or use device='cpu'")
    index = dev.index if dev.index is not None else (rt.current_device() if real else 0)
    if compute_stream is None:
        compute_stream = rt.compute_stream(index) if real else 0
    # On a GPU the engine needs pool ranges as torch tensors (cupy bridges them): refuse
    # clearly here rather than hand it DevicePtrs. A fake driver gets DevicePtrs.
    if arena == "pytorch":
        pool = _arena(budget, chunk, index, driver)
    else:
        pool = CudaDevicePool(budget, chunk, driver=driver, device=index,
                              as_tensor=True if real else False, fence_stream=compute_stream)
    try:
        tier = PinnedTier(driver=driver, device=index, capacity_bytes=pinned_capacity,
                          verify=verify, compute_stream=compute_stream)
    except BaseException:
        pool.close()
        raise
    return tier, pool


def make_pool(device: "str | torch.device", budget: int, chunk: int, arena: str = "pool") -> DevicePool:
    """A fresh budgeted pool for ``device`` (``set_budget`` swaps pools between steps)."""
    dev = torch.device(device)
    arena = resolve_arena(dev, arena)
    if dev.type == "cpu":
        # the recycling allocator hears the pool's size: it bounds the idle chunks with its cache
        hear = functools.partial(cpu_allocator.external, source=next(_pool_ids))
        return CpuDevicePool(budget, chunk, on_physical=hear, share_pages=True)
    rt = cuda_runtime()
    index = dev.index if dev.index is not None else rt.current_device()
    if arena == "pytorch":
        return _arena(budget, chunk, index, rt.driver(f"device {dev}"))
    return CudaDevicePool(budget, chunk, driver=rt.driver(f"device {dev}"), device=index,
                          as_tensor=True, fence_stream=rt.compute_stream(index))


def _arena(budget: int, chunk: int, index: int, driver: Any) -> TorchArenaPool:
    """The one-arena pool, on the device where the engine's tensors live, with the VMM pool's
    granularity (the same chunk, the same managed tensors, the same plans) and its check of
    the chunk against it."""
    cu = CudaDriver(driver, label="arena='pytorch'", device=index, what="arena='pytorch'")
    cu.call("cuInit", 0)   # no context: the granularity needs none, and none is retained here
    granularity = int(cu.call("cuMemGetAllocationGranularity", cu.allocation_prop(), cu.granularity_minimum()))
    if chunk % granularity:
        raise ChunkSizeError(f"chunk size {chunk} B ({format_size(chunk)}) is not a multiple of the "
                             f"cuda backend's granularity {granularity} B ({format_size(granularity)})")
    device = cuda_runtime().tensor_device(torch.device("cuda", index))
    return TorchArenaPool(budget, device, granularity=granularity)
