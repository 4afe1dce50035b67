"""Which slower tier and which device pool serve a device, and how the runtime names bytes.

The engine moves bytes between a device pool and a slower tier; what a "pointer to bytes" is
depends on the device:

========  ====================================  ==========================================
device    slower tier / device pool              bytes handed to the tier
========  ====================================  ==========================================
cpu       :class:`~ooc.storage.FileTier` /       a ``memoryview`` over the storage
          :class:`~ooc.runtime.pool.DevicePool`  (:func:`ooc.runtime.slots.byte_view`)
cuda      :class:`~ooc.runtime.cuda_tier.        a :class:`DevicePtr` (device address and
          PinnedTier` / :class:`~ooc.runtime.    byte count); the tier copies with the
          cuda_pool.CudaDevicePool`              driver's async memcpy on its own streams
========  ====================================  ==========================================

:func:`make_tier_and_pool` and :func:`byte_view_for` are the two calls the engine makes; the
rest of the runtime does not look at the device.

The CUDA half ran on an H100 (benchmarks/results/gpu.md); CI has no GPU, so it is also tested
against a fake driver that enforces the driver's contract (``tests/fakes/fake_cuda_copies.py``);
the real-GPU tests in ``tests/ooc/test_cuda_gpu.py`` skip on machines without CUDA.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ooc.errors import OOCError

__all__ = ["DevicePtr", "byte_view_for", "make_pool", "make_tier_and_pool"]

_pool_ids = itertools.count(1)   # names each CPU pool to the allocator's bound


@dataclass(frozen=True, slots=True, weakref_slot=True)
class DevicePtr:
    """``nbytes`` bytes of device memory at ``address`` (a plain int, as the driver takes it).

    Carries no ownership: whoever made it keeps the memory alive while a copy uses it.
    :meth:`CudaDevicePool.take <ooc.runtime.cuda_pool.CudaDevicePool.take>` is the exception
    that proves the rule: there, the returned object *is* the owner (its pool range goes back
    when the last reference to it is dropped), so do not rebuild it with ``replace()``.
    """

    address: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.address < 0 or self.nbytes < 0:
            raise ValueError(f"DevicePtr(address={self.address:#x}, nbytes={self.nbytes}): "
                             "negative address or size")

    def __repr__(self) -> str:
        return f"DevicePtr(0x{self.address:x}, {self.nbytes})"


def byte_view_for(storage: torch.UntypedStorage) -> "memoryview | DevicePtr":
    """What the device's tier copies from or into for ``storage``.

    CPU: a zero-copy writable ``memoryview`` (:func:`ooc.runtime.slots.byte_view`).
    CUDA: a :class:`DevicePtr` over the storage's data pointer and size. Either way the caller
    keeps ``storage`` alive while the transfer runs (the engine's ``Slot.pending``).
    """
    kind = storage.device.type
    if kind == "cpu":
        from ooc.runtime.slots import byte_view

        return byte_view(storage)
    if kind == "cuda":
        return DevicePtr(int(storage.data_ptr()), int(storage.nbytes()))
    raise OOCError(f"storage on {storage.device}: the runtime handles cpu and cuda devices only")


def make_tier_and_pool(device: "str | torch.device", budget: int, chunk: int,
                       storage: str | None = None, threads: int = 2, verify: bool = False, *,
                       driver: Any = None, pinned_capacity: int | str | None = None,
                       compute_stream: Any = None) -> tuple[Any, Any]:
    """The slower tier and the budgeted device pool for ``device``: ``(tier, pool)``.

    - ``cpu``: ``(FileTier(storage, threads=threads, verify=verify, chunk_bytes=chunk),
      DevicePool(budget, chunk))``.
    - ``cuda[:i]``: ``(PinnedTier(...), CudaDevicePool(budget, chunk, device=i))``; ``storage``
      and ``threads`` do not apply (the slower tier is pinned host memory, moved by copy
      streams). ``pinned_capacity`` caps the pinned memory (default: half the host RAM).
      ``compute_stream`` is the stream whose kernels produce and consume the swapped bytes
      (an int handle, a ``CUstream`` or a callable returning one); default: PyTorch's current
      stream on that device at each transfer, or the driver's default stream 0 when
      ``driver`` is given.

    ``driver`` replaces ``cuda.bindings.driver`` (tests pass a fake; the pool then hands out
    :class:`DevicePtr`). Without it CUDA needs cuda-python, cupy and a CUDA build of PyTorch;
    a missing one raises :class:`~ooc.errors.OOCError` (``pip install 'ooc[cuda]'``).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        from ooc.storage import FileTier

        pool = make_pool(dev, budget, chunk)
        return FileTier(storage, threads=threads, verify=verify, chunk_bytes=chunk), pool
    if dev.type != "cuda":
        raise OOCError(f"device {dev}: the runtime handles 'cpu' and 'cuda' devices only")

    from ooc.runtime.cuda_pool import CudaDevicePool
    from ooc.runtime.cuda_tier import PinnedTier, import_driver

    real = driver is None
    if real:
        driver = import_driver(f"device {dev}")  # OOCError naming pip install 'ooc[cuda]'
        if not torch.cuda.is_available():
            raise OOCError(f"device {dev}: this PyTorch has no usable CUDA "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                           "install a CUDA build of PyTorch or use device='cpu'")
    index = dev.index if dev.index is not None else (
        torch.cuda.current_device() if real else 0)
    if compute_stream is None:
        compute_stream = (lambda: torch.cuda.current_stream(index).cuda_stream) if real else 0
    # On a GPU the engine needs pool ranges as torch tensors (cupy bridges them): refuse
    # clearly here rather than hand it DevicePtrs. A fake driver gets DevicePtrs.
    pool = CudaDevicePool(budget, chunk, driver=driver, device=index,
                          as_tensor=True if real else None)
    try:
        tier = PinnedTier(driver=driver, device=index, capacity_bytes=pinned_capacity,
                          verify=verify, compute_stream=compute_stream)
    except BaseException:
        pool.close()
        raise
    return tier, pool


def make_pool(device: "str | torch.device", budget: int, chunk: int) -> Any:
    """A fresh budgeted pool for ``device`` (``set_budget`` swaps pools between steps)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        from ooc.runtime import cpu_allocator
        from ooc.runtime.pool import DevicePool

        # the recycling allocator hears the pool's size: it bounds the idle chunks with its cache
        return DevicePool(budget, chunk,
                          on_physical=functools.partial(cpu_allocator.external, source=next(_pool_ids)))
    from ooc.runtime.cuda_pool import CudaDevicePool

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return CudaDevicePool(budget, chunk, device=index, as_tensor=True)
