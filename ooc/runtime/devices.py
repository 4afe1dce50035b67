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

Everything the CUDA path asks of CUDA outside the driver (is there a device, which one, the
compute stream, where its tensors live, a tensor over a pool range, op timing events) goes
through ONE seam, :func:`cuda_runtime`: a :class:`CudaRuntime` object that answers with
PyTorch's ``torch.cuda`` and cuda-python's driver. :func:`ooc.testing.fake_cuda` swaps in a
runtime over a FAKE driver (CPU tensors standing for device memory), so that the real pinned
tier, CUDA pool and copy-stream logic run end to end on a machine without a GPU.

The CUDA half runs on an H100 (``benchmarks/bench_gpu.py``, ``tests/ooc/test_cuda_gpu.py``,
which skip without CUDA) and, in CI, over the fake driver
(``tests/ooc/test_cuda_fake_e2e.py``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ooc.errors import OOCError

__all__ = ["CudaRuntime", "DevicePtr", "byte_view_for", "cuda_runtime", "make_pool",
           "make_tier_and_pool", "set_cuda_runtime"]

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


class CudaRuntime:
    """The seam between the runtime and CUDA: every question the engine, the stepper and the
    pool ask of ``torch.cuda`` (or cuda-python, for the driver) is a method here.

    This class answers with the real thing; :func:`ooc.testing.fake_cuda` installs a subclass
    over a FAKE driver for the duration of a ``with`` block (see :func:`set_cuda_runtime`).
    """

    fake = False

    def driver(self, what: str = "the CUDA path") -> Any:
        """``cuda.bindings.driver``, or OOCError naming ``pip install 'ooc[cuda]'``."""
        from ooc.runtime.cuda_tier import import_driver

        return import_driver(what)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def compute_stream(self, index: int) -> Any:
        """The stream whose kernels produce and consume swapped bytes: an int handle, a
        ``CUstream`` or a callable returning one at each transfer (PyTorch's current stream)."""
        return lambda: torch.cuda.current_stream(index).cuda_stream

    def tensor_device(self, device: torch.device) -> torch.device:
        """Where the tensors of the engine's ``device`` live (parameters, batches, ranges)."""
        return device

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is device memory (the tier copies it as a :class:`DevicePtr`)."""
        return storage.device.type == "cuda"

    def device_ptr(self, storage: torch.UntypedStorage) -> "DevicePtr":
        """The :class:`DevicePtr` the tier copies from or into for a device ``storage``."""
        return DevicePtr(int(storage.data_ptr()), int(storage.nbytes()))

    def can_wrap_ranges(self) -> bool:
        """Whether :meth:`wrap_range` works here (a CUDA PyTorch with a device, and cupy)."""
        from ooc.runtime.cuda_pool import _cuda_torch, _has_cupy

        return _cuda_torch() and _has_cupy()

    def wrap_range(self, address: int, nbytes: int, device: int, owner: Any) -> torch.Tensor:
        """A flat uint8 tensor over device memory ``[address, address + nbytes)``, zero-copy,
        keeping ``owner`` alive as long as any storage uses the memory."""
        from ooc.runtime.cuda_pool import _wrap_range

        return _wrap_range(address, nbytes, device, owner)

    def timing_event(self) -> Any:
        """An event with ``record()``, ``synchronize()`` and ``elapsed_time(end)`` (ms), for
        the run time of an op (``torch.cuda.Event(enable_timing=True)``)."""
        return torch.cuda.Event(enable_timing=True)


_CUDA = CudaRuntime()


def cuda_runtime() -> CudaRuntime:
    """The CUDA seam in use (the real one unless :func:`ooc.testing.fake_cuda` is active)."""
    return _CUDA


def set_cuda_runtime(runtime: CudaRuntime) -> CudaRuntime:
    """Install ``runtime`` as the CUDA seam for the whole process; returns the previous one
    (to restore). Engines made under one runtime must be closed under it."""
    global _CUDA
    previous, _CUDA = _CUDA, runtime
    return previous


def byte_view_for(storage: torch.UntypedStorage) -> "memoryview | DevicePtr":
    """What the device's tier copies from or into for ``storage``.

    CPU: a zero-copy writable ``memoryview`` (:func:`ooc.runtime.slots.byte_view`).
    CUDA: a :class:`DevicePtr` over the storage's data pointer and size. Either way the caller
    keeps ``storage`` alive while the transfer runs (the engine's ``Slot.pending``).
    """
    kind = storage.device.type
    if kind == "cuda" or _CUDA.holds(storage):   # under the fake: CPU storages stand for it
        return _CUDA.device_ptr(storage)
    if kind == "cpu":
        from ooc.runtime.slots import byte_view

        return byte_view(storage)
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
    :class:`DevicePtr`). Without it, the driver, the device index, the compute stream and the
    pool's tensors come from :func:`cuda_runtime` (the real CUDA: cuda-python, cupy and a CUDA
    build of PyTorch, a missing one raising :class:`~ooc.errors.OOCError` naming
    ``pip install 'ooc[cuda]'``; or the fake one of :func:`ooc.testing.fake_cuda`).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        from ooc.storage import FileTier

        pool = make_pool(dev, budget, chunk)
        return FileTier(storage, threads=threads, verify=verify, chunk_bytes=chunk), pool
    if dev.type != "cuda":
        raise OOCError(f"device {dev}: the runtime handles 'cpu' and 'cuda' devices only")

    from ooc.runtime.cuda_pool import CudaDevicePool
    from ooc.runtime.cuda_tier import PinnedTier

    rt = _CUDA
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
    pool = CudaDevicePool(budget, chunk, driver=driver, device=index,
                          as_tensor=True if real else False, fence_stream=compute_stream)
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

    index = dev.index if dev.index is not None else _CUDA.current_device()
    return CudaDevicePool(budget, chunk, driver=_CUDA.driver(f"device {dev}"), device=index,
                          as_tensor=True, fence_stream=_CUDA.compute_stream(index))
