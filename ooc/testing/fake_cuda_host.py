"""A FAKE CUDA driver whose device memory is real host memory at the device addresses.

Not CUDA. :class:`HostBackedFakeDriver` is :class:`~ooc.testing.fake_cuda_copies.FakeCopyDriver`
(the VMM contract, streams, events, pinned memory, lazy async copies; every rule still
enforced) with one change that lets PyTorch's CPU kernels work on "device" memory: a device
address IS a host address.

- ``cuMemAddressReserve`` reserves host address space, ``mmap(PROT_NONE, MAP_PRIVATE |
  MAP_ANONYMOUS | MAP_NORESERVE)``, and returns its (granularity-aligned) address;
  ``cuMemAddressFree`` unmaps it.
- ``cuMemCreate`` backs each physical chunk with its own ``memfd``; ``cuMemMap`` maps it with
  ``mmap(MAP_SHARED | MAP_FIXED)`` at the device address, so the chunk's bytes follow it
  wherever it is mapped (as ``vmm.host`` does for the CPU pool); ``cuMemUnmap`` puts the
  ``PROT_NONE`` reservation back over the span; ``cuMemRelease`` closes the memfd.
- Device memory outside every reserved range is PyTorch's own (the caching allocator's, on a
  GPU; torch's CPU allocator here). The fake knows only the storages registered with
  :meth:`HostBackedFakeDriver.register_storage` (``fake_cuda``'s seam registers each storage
  the tier is handed): a copy may touch one of those, within its bytes, and when the copy
  runs that storage must still be alive with those bytes (freed or resized to 0 before the
  copy ran is a use-after-free: a violation and a sticky ``CUDA_ERROR_ILLEGAL_ADDRESS``,
  not a segfault). Inside a reserved range the VMM checks apply (mapped, access set).

So ``torch.frombuffer`` over a mapped range gives a CPU tensor over the device bytes, the
pool's ranges can be handed to the engine as tensors, and a copy that has not run when a
kernel reads its destination shows stale bytes. A mapping is host-readable before
``cuMemSetAccess`` (the copies still refuse it): do not rely on the fake for a kernel's
access check. Linux only (memfd, ``MAP_FIXED``).
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
from bisect import bisect_right
from typing import Any

from ooc.testing import fake_cuda_copies as copies
from ooc.testing.fake_cuda_driver import _addr
from vmm.host import (MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, MAP_SHARED,
                      PROT_NONE, PROT_READ, PROT_WRITE, _libc, _mmap_checked, _munmap_checked)

__all__ = ["HostBackedFakeDriver"]

_RESERVE = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
_OK = copies.CUresult.CUDA_SUCCESS


class HostBackedFakeDriver(copies.FakeCopyDriver):
    """The copy fake with device memory in host memory at the device addresses (see the
    module docstring). Same arguments as :class:`~ooc.testing.fake_cuda_copies.FakeCopyDriver`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._host_res: dict[int, tuple[int, int]] = {}   # start -> (mmap base, mmap bytes)
        self._chunk_fd: dict[int, int] = {}               # cuMemCreate handle -> its memfd
        self._storages: dict[int, tuple[int, Any]] = {}   # address -> (bytes, StorageWeakRef)

    def register_storage(self, storage: Any) -> None:
        """Make a PyTorch storage (CPU memory standing for device memory) known to the copies."""
        from torch.multiprocessing.reductions import StorageWeakRef

        with self._mutex:
            address = int(storage.data_ptr())
            if len(self._storages) > 4096:   # forget the dead ones now and then
                self._storages = {a: v for a, v in self._storages.items() if not v[1].expired()}
            self._storages[address] = (int(storage.nbytes()), StorageWeakRef(storage))

    # -- address ranges ----------------------------------------------------------------
    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple:  # noqa: N802
        if not (isinstance(size, int) and size > 0 and isinstance(alignment, int)
                and alignment >= 0):
            return super().cuMemAddressReserve(size, alignment, addr, flags)   # refuses
        align = max(alignment, self.granularity)
        total = size + align
        base = _mmap_checked(_libc(), None, total, PROT_NONE, _RESERVE, -1, 0)
        start = -(-base // align) * align
        self._next_va = start          # the VMM fake hands out this address
        result = super().cuMemAddressReserve(size, alignment, addr, flags)
        if result[0] != _OK or int(result[1]) != start:
            _munmap_checked(_libc(), base, total)
            return result if result[0] != _OK else (copies.CUresult.CUDA_ERROR_INVALID_VALUE, None)
        self._host_res[start] = (base, total)
        return result

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple:  # noqa: N802
        result = super().cuMemAddressFree(ptr, size)
        if result[0] == _OK:
            base, total = self._host_res.pop(_addr(ptr))
            _munmap_checked(_libc(), base, total)
        return result

    # -- chunks ------------------------------------------------------------------------
    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:  # noqa: N802
        result = super().cuMemCreate(size, prop, flags)
        if result[0] == _OK:
            handle = int(result[1])
            fd = os.memfd_create("ooc-fake-cuda-chunk", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            self._chunk_fd[handle] = fd
            self.chunk_bytes[handle] = _mmap.mmap(fd, size)   # read_device / write_device
        return result

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:  # noqa: N802
        result = super().cuMemMap(ptr, size, offset, handle, flags)
        if result[0] == _OK:
            _mmap_checked(_libc(), _addr(ptr), size, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_FIXED, self._chunk_fd[int(handle)], offset)
        return result

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple:  # noqa: N802
        result = super().cuMemUnmap(ptr, size)
        if result[0] == _OK:   # the reservation again: nothing else can land in the hole
            _mmap_checked(_libc(), _addr(ptr), size, PROT_NONE, _RESERVE | MAP_FIXED, -1, 0)
        return result

    def _forget_released(self) -> None:
        for h in [h for h in self.chunk_bytes if h not in self.handles]:
            self.chunk_bytes.pop(h).close()
            os.close(self._chunk_fd.pop(h))

    # -- PyTorch's own device memory ----------------------------------------------------
    def _storage_at(self, start: int, size: int) -> Any:
        """The live registered storage whose bytes hold ``[start, start + size)``, or None."""
        import torch

        i = bisect_right(self._res_starts, start + size - 1) - 1
        if i >= 0:
            r = self._res_starts[i]
            if r + self.reservations[r] > start:
                return None   # inside (or across) a reserved range: the VMM checks apply
        def live(address: int) -> Any:
            entry = self._storages.get(address)
            if entry is None or not address <= start or start + size > address + entry[0]:
                return None
            s = torch.UntypedStorage._new_with_weak_ptr(entry[1].cdata)
            if s is not None and s.data_ptr() == address and s.nbytes() >= start + size - address:
                return s
            return None

        # The storage starting here, else any: the first is a copy's usual case, and the walk
        # over every registered storage (up to 4,096) cost ~10 ms a step of a 20-layer model.
        found = live(start)
        if found is not None:
            return found
        for address in list(self._storages):
            found = live(address)
            if found is not None:
                return found
        return None

    def _device_guard(self, start: int, size: int) -> Any:
        s = self._storage_at(start, size)
        if s is None:
            return None
        from torch.multiprocessing.reductions import StorageWeakRef

        ref, address = StorageWeakRef(s), int(s.data_ptr())

        def still_there() -> bool:
            import torch

            now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            return (now is not None and now.data_ptr() == address
                    and now.nbytes() >= start + size - address)
        return still_there

    def _outside_device_pieces(self, start: int, size: int) -> list | None:
        if self._storage_at(start, size) is None:
            return None   # not PyTorch memory the fake knows: the VMM checks decide
        view = memoryview((ctypes.c_char * size).from_address(start)).cast("B")
        return [(view, 0, size)]
