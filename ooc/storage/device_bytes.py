"""What the slower tier copies from or into for a storage: a byte view of it.

CPU: a zero-copy writable ``memoryview`` (:func:`byte_view`); CUDA (or the fake of
:func:`ooc.testing.fake_cuda`): a :class:`~ooc.runtime.cuda_seam.DevicePtr`.
"""

from __future__ import annotations

import ctypes

import torch

from ooc.errors import OOCError
from ooc.runtime.cuda_seam import DevicePtr, cuda_runtime

__all__ = ["byte_view", "byte_view_for"]


def byte_view(storage: torch.UntypedStorage) -> memoryview:
    """A zero-copy, writable view of a CPU storage's bytes for the I/O threads.

    Built from the data pointer, not ``Tensor.numpy()``: numpy export marks the storage
    non-resizable, and persistent storages must be resized to release their bytes. The
    caller keeps ``storage`` alive while the view is in use (``Slot.pending``).
    """
    n = storage.nbytes()
    return memoryview((ctypes.c_char * n).from_address(storage.data_ptr())).cast("B")


def byte_view_for(storage: torch.UntypedStorage) -> "memoryview | DevicePtr":
    """What the device's tier copies from or into for ``storage``.

    CPU: a zero-copy writable ``memoryview`` (:func:`byte_view`).
    CUDA: a :class:`DevicePtr` over the storage's data pointer and size. Either way the caller
    keeps ``storage`` alive while the transfer runs (the engine's ``Slot.pending``).
    """
    kind = storage.device.type
    rt = cuda_runtime()
    if kind == "cuda" or rt.holds(storage):   # under the fake: CPU storages stand for it
        return rt.device_ptr(storage)
    if kind == "cpu":
        return byte_view(storage)
    raise OOCError(f"storage on {storage.device}: the runtime handles cpu and cuda devices only")
