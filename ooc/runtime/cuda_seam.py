"""The one seam between the runtime and CUDA outside the driver, and what a device pointer is.

Everything the CUDA path asks of CUDA besides driver calls (is there a device, which one, the
compute stream, where its tensors live, a tensor over a pool range, op timing events) is a
method of :class:`CudaRuntime`; :func:`cuda_runtime` returns the one in use. It answers with
PyTorch's ``torch.cuda``, cupy and cuda-python's driver (imported by
:func:`vmm.cuda_driver.import_driver`, the module every driver call goes through).
:func:`ooc.testing.fake_cuda` installs a runtime over a FAKE driver (CPU tensors standing for
device memory), so that the real pinned tier, CUDA pool and copy-stream logic run end to end
on a machine without a GPU.

This module imports nothing else from the runtime: the pool, the tier, the slots and the
factory (:mod:`ooc.runtime.devices`) all import it, never the other way round.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vmm.cuda_driver import import_driver

__all__ = ["CudaRuntime", "DevicePtr", "cuda_runtime", "cuda_torch", "device_range", "has_cupy",
           "set_cuda_runtime"]


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


def device_range(obj: Any, what: str) -> tuple[int, int]:
    """``(address, nbytes)`` of a :class:`DevicePtr` (anything with int ``address`` and
    ``nbytes``); TypeError naming ``what`` otherwise."""
    try:
        return int(obj.address), int(obj.nbytes)
    except AttributeError:
        raise TypeError(f"PinnedTier: {what} must be a DevicePtr (device address and nbytes), "
                        f"got {type(obj).__name__}") from None


class CudaRuntime:
    """The seam between the runtime and CUDA: every question the engine, the stepper and the
    pool ask of ``torch.cuda`` (or cuda-python, for the driver) is a method here.

    This class answers with the real thing; :func:`ooc.testing.fake_cuda` installs a subclass
    over a FAKE driver for the duration of a ``with`` block (see :func:`set_cuda_runtime`).
    """

    fake = False

    def driver(self, what: str = "the CUDA path") -> Any:
        """``cuda.bindings.driver``, or OOCError naming ``pip install 'ooc[cuda]'``."""
        return import_driver(what)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def compute_stream(self, index: int) -> Any:
        """The stream whose kernels produce and consume swapped bytes: an int handle, a
        ``CUstream`` or a callable returning one at each transfer (PyTorch's current stream).
        PyTorch's raw handle where its build has one: ``torch.cuda.current_stream`` makes a
        Python ``Stream`` at each call (6 ms over the 480 of an anchored Llama step at 1/2 on an
        H200's host, under cProfile), and the tier asks at every transfer."""
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, int(index))
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
        return cuda_torch() and has_cupy()

    def wrap_range(self, address: int, nbytes: int, device: int, owner: Any) -> torch.Tensor:
        """A flat uint8 tensor over device memory ``[address, address + nbytes)``, zero-copy,
        keeping ``owner`` alive as long as any storage uses the memory."""
        return _wrap_range(address, nbytes, device, owner)

    def timing_event(self) -> Any:
        """An event with ``record()``, ``synchronize()`` and ``elapsed_time(end)`` (ms), for
        the run time of an op (``torch.cuda.Event(enable_timing=True)``)."""
        return torch.cuda.Event(enable_timing=True)

    def keep_busy(self) -> None:
        """Before an op's start event: ``keep_stream_busy`` (why: there)."""
        keep_stream_busy()

    def device_done(self) -> None:
        """Block the host until the current stream has run what was queued on it so far (one
        host synchronization: an event recorded now, waited for)."""
        done = self.timing_event()
        done.record()
        done.synchronize()


#: GPU cycles the stream sleeps before each timed op (~0.1 ms at 2 GHz). Without it the events
#: time the host too: an idle GPU records the start event at once and runs the op's kernels
#: only when the host has launched them, so each op gains the recorder's and the dispatcher's
#: host time (a ~320 M Llama in bf16, 5,872 ops: 215 ms of op time against a 99 ms step, on an
#: H200; ResNet-50 b256's long kernels hid it: 123.5 ms against 122.6 ms).
SLEEP_CYCLES = 200_000


def keep_stream_busy() -> None:
    """Queue a sleep on the current stream, so that the start event, the op's kernels and the
    end event that the host queues after it run back to back: the events time the op alone.
    Costs the recording ~0.1 ms an op, the step it times only."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SLEEP_CYCLES)


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


def _wrap_range(address: int, nbytes: int, device: int, owner: Any) -> torch.Tensor:
    """A flat uint8 CUDA tensor over ``[address, address + nbytes)``, zero-copy.

    cupy's ``UnownedMemory`` wraps memory it does not own and keeps ``owner`` alive; the
    ndarray over it goes to torch through DLPack, whose deleter keeps the ndarray (and so the
    owner) alive for as long as any torch storage uses the memory. Run on an H100.
    """
    import cupy

    with cupy.cuda.Device(device):
        mem = cupy.cuda.UnownedMemory(address, max(nbytes, 1), owner, device_id=device)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    try:
        return torch.from_dlpack(arr)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - older stacks
        return torch.as_tensor(arr, device=f"cuda:{device}")  # __cuda_array_interface__


def cuda_torch() -> bool:
    """Whether this PyTorch is a CUDA build with a visible device."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def has_cupy() -> bool:
    """Whether cupy (the bridge from pool ranges to tensors) imports."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True
