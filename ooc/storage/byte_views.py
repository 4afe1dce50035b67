"""The caller's buffers as bytes: what :class:`~ooc.storage.FileTier` accepts as ``src`` and
``dst`` (C-contiguous buffer-protocol objects and contiguous CPU torch tensors, any dtype).

Apart from the tier because it is about the caller's objects, not the file: which exports
are safe to take (a numpy export would pin a torch storage's size for good), and which views
must be released before a transfer's future resolves.
"""

from __future__ import annotations

import ctypes

__all__ = ["byte_view", "tensor_bytes"]


def byte_view(obj, *, writable: bool) -> tuple[memoryview, memoryview]:
    """(base, bytes) memoryviews of a C-contiguous buffer or a contiguous CPU torch tensor.
    Both must be released by the caller (base last)."""
    if hasattr(obj, "untyped_storage") and hasattr(obj, "data_ptr"):  # a torch tensor
        obj = tensor_bytes(obj)
    base = memoryview(obj)
    if not base.c_contiguous:
        base.release()
        raise ValueError("FileTier needs a C-contiguous buffer")
    if writable and base.readonly:
        base.release()
        raise ValueError("FileTier.read_async needs a writable dst buffer")
    if base.format == "B" and base.ndim == 1:
        return base, base[:]
    try:
        return base, base.cast("B")
    except TypeError:  # a format cast() refuses (non-native byte order, complex): numpy can
        base.release()
        import numpy as np

        base = memoryview(np.frombuffer(obj, dtype=np.uint8))
        return base, base[:]


def tensor_bytes(tensor):
    """The bytes of a contiguous CPU tensor as a ctypes array over its data pointer.

    Not ``tensor.numpy()``: a numpy export marks the storage non-resizable for good, and the
    runtime releases swapped storages with ``resize_(0)``. The array keeps the tensor alive
    while the tier's views of it exist.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("FileTier needs a contiguous CPU tensor")
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return bytearray()
    arr = (ctypes.c_char * n).from_address(tensor.data_ptr())
    arr._ooc_owner = tensor
    return arr
