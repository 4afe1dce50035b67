"""A FAKE ``cuda.bindings.driver``: no GPU, no memory, just the documented contract.

This is not CUDA. It stands in for cuda-python's driver module in tests on machines
without a GPU, and it is deliberately strict, so that code passing against it follows
the rules the real driver documents for the virtual memory management API:

- every function returns a tuple ``(CUresult, *values)``, errors included, never raises;
- nothing works before ``cuInit`` (``CUDA_ERROR_NOT_INITIALIZED``); memory calls need a
  current context (``CUDA_ERROR_INVALID_CONTEXT``), and the current context is per thread
  (``cuCtxSetCurrent`` / ``cuCtxGetCurrent``; a new thread has none, NULL unsets it);
- ``cuMemCreate`` / ``cuMemAddressReserve`` / ``cuMemMap`` sizes, offsets and addresses
  must be multiples of the granularity; flags must be 0; the allocation property must be
  pinned device memory on an existing device (``CUDA_ERROR_INVALID_VALUE``);
  ``cuMemCreate`` past the device's memory gives ``CUDA_ERROR_OUT_OF_MEMORY``;
- ``cuMemMap`` only inside one reserved range and never over an existing mapping;
- ``cuMemSetAccess`` only over a fully mapped span; a mapping starts inaccessible and
  :meth:`FakeDriver.launch` (a pretend kernel) on it fails with
  ``CUDA_ERROR_ILLEGAL_ADDRESS`` until access is set;
- ``cuMemUnmap`` only of whole mappings; ``cuMemAddressFree`` only of a whole reservation
  with nothing mapped in it.

Where the real driver is more lenient than our backends' own contract, ``strict=True``
(default) makes the fake refuse too, with ``CUDA_ERROR_NOT_PERMITTED``, and records the
breach in ``violations``: ``cuMemRelease`` of a handle that is still mapped (the driver
defers the free) and ``cuMemUnmap`` while a launched kernel has not been synchronized
(a use-after-free on a real device).

``calls`` lists every call by name in order; ``outstanding()`` tells what is still
allocated, for teardown tests; ``fail_next(name, error)`` injects a driver error.

Where the pieces are: the value types (``CUresult``, enums, handles, property structs) in
:mod:`ooc.testing.fake_cuda_types`, initialisation, devices and contexts in
:mod:`ooc.testing.fake_cuda_contexts`; here the VMM calls and the contract they enforce.
"""

from __future__ import annotations

import threading
import types
from bisect import bisect_right, insort
from typing import Any

from ooc.testing.fake_cuda_contexts import FakeContexts
from ooc.testing.fake_cuda_types import (  # noqa: F401 - the old import path
    CUresult, CUmemAllocationType, CUmemLocationType, CUmemAllocationGranularity_flags,
    CUmemAccess_flags, CUdeviceptr, CUdevice, CUcontext, CUstream,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemAllocationProp, CUmemAccessDesc,
    _INVALID, _OK, _addr)


class FakeDriver(FakeContexts):
    """One fake driver instance (its own devices, memory, calls). Pass it where
    ``cuda.bindings.driver`` is expected, or install :meth:`as_module` in ``sys.modules``.

    Args:
        devices: number of devices.
        memory_bytes: physical memory per device.
        granularity: what ``cuMemGetAllocationGranularity`` reports.
        strict: also refuse what the real driver tolerates but our contract forbids
            (see the module docstring).
    """

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAccess_flags = CUmemAccess_flags
    CUdeviceptr = CUdeviceptr
    CUdevice = CUdevice
    CUcontext = CUcontext
    CUstream = CUstream
    CUmemGenericAllocationHandle = CUmemGenericAllocationHandle
    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, *, devices: int = 1, memory_bytes: int = 16 << 30,
                 granularity: int = 2 << 20, strict: bool = True) -> None:
        self.devices = devices
        self.memory_bytes = memory_bytes
        self.granularity = granularity
        self.strict = strict
        self.calls: list[str] = []
        self.violations: list[str] = []
        self.initialized = False
        self._thread = threading.local()        # the current context is per thread
        self.retained: dict[int, int] = {}      # device -> primary context refcount
        self.handles: dict[int, dict] = {}      # handle -> {size, device, mapped}
        self.used_bytes = 0
        self.reservations: dict[int, int] = {}  # start -> size
        self._res_starts: list[int] = []
        self.mappings: dict[int, dict] = {}     # start -> {size, handle, access}
        self._map_starts: list[int] = []
        self.pending_work = False               # a launched kernel not yet synchronized
        self._next_handle = 0x1000
        self._next_va = 0x7F00_0000_0000
        self._fail: dict[str, CUresult] = {}

    # -- fake-only helpers -------------------------------------------------------------
    def fail_next(self, name: str, error: CUresult) -> None:
        """Make the next call of ``name`` return ``error`` (error injection)."""
        self._fail[name] = error

    def outstanding(self) -> dict[str, int]:
        """What is still allocated: handles, reservations, mappings, retained contexts."""
        return {"handles": len(self.handles), "reservations": len(self.reservations),
                "mappings": len(self.mappings),
                "retained_contexts": sum(self.retained.values())}

    def launch(self, ptr: Any, size: int) -> tuple:
        """A pretend kernel touching ``[ptr, ptr + size)``: every byte must be mapped with
        read/write access set. Leaves pending work until a synchronize. It stands for a
        kernel PyTorch launches (PyTorch makes its own context current: none is asked of the
        calling thread)."""
        self.calls.append("launch")
        start = _addr(ptr)
        for m_start, m in self._covering(start, size):
            if m is None or m["access"] != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        self.pending_work = True
        return _OK

    def as_module(self) -> types.ModuleType:
        """This driver as a module object (for ``sys.modules['cuda.bindings.driver']``)."""
        module = types.ModuleType("cuda.bindings.driver", "FAKE cuda driver (tests only)")
        for name in dir(self):
            if name.startswith("cu") or name.startswith("CU"):
                setattr(module, name, getattr(self, name))
        module.fake = self
        return module

    # -- internals ---------------------------------------------------------------------
    def _enter(self, name: str, *, needs_init: bool = True, needs_ctx: bool = False):
        self.calls.append(name)
        if name in self._fail:
            return (self._fail.pop(name),)
        if needs_init and not self.initialized:
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED,)
        if needs_ctx and self.current is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        return None

    def _violation(self, what: str):
        self.violations.append(what)
        return (CUresult.CUDA_ERROR_NOT_PERMITTED,) if self.strict else None

    def _aligned(self, *values: int) -> bool:
        return all(isinstance(v, int) and v % self.granularity == 0 for v in values)

    def _check_prop(self, prop: Any) -> bool:
        return (isinstance(prop, CUmemAllocationProp)
                and prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and isinstance(prop.location.id, int) and 0 <= prop.location.id < self.devices)

    def _reservation_of(self, start: int, size: int) -> int | None:
        i = bisect_right(self._res_starts, start) - 1
        if i >= 0:
            r = self._res_starts[i]
            if start + size <= r + self.reservations[r]:
                return r
        return None

    def _covering(self, start: int, size: int):
        """(mapping start, mapping) pieces covering the span; mapping None for a gap."""
        pos, stop = start, start + size
        i = bisect_right(self._map_starts, pos) - 1
        while pos < stop:
            if 0 <= i < len(self._map_starts):
                m_start = self._map_starts[i]
                m = self.mappings[m_start]
                if m_start <= pos < m_start + m["size"]:
                    yield m_start, m
                    pos = m_start + m["size"]
                    i += 1
                    continue
            yield pos, None
            return

    # -- the driver API: memory (contexts and devices: FakeContexts) -------------------
    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemGetAllocationGranularity")) is not None:
            return r + (None,)
        if not self._check_prop(prop) or not isinstance(option, CUmemAllocationGranularity_flags):
            return (_INVALID, None)
        return (CUresult.CUDA_SUCCESS, self.granularity)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemCreate", needs_ctx=True)) is not None:
            return r + (None,)
        if not self._aligned(size) or size <= 0 or flags != 0 or not self._check_prop(prop):
            return (_INVALID, None)
        if self.used_bytes + size > self.memory_bytes:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = {"size": size, "device": prop.location.id, "mapped": 0}
        self.used_bytes += size
        return (CUresult.CUDA_SUCCESS, CUmemGenericAllocationHandle(handle))

    def cuMemRelease(self, handle: Any) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemRelease", needs_ctx=True)) is not None:
            return r
        if not isinstance(handle, CUmemGenericAllocationHandle) or int(handle) not in self.handles:
            return (_INVALID,)
        h = self.handles[int(handle)]
        if h.get("released"):
            return (_INVALID,)
        if h["mapped"]:
            if (v := self._violation(f"cuMemRelease of handle {int(handle):#x} still mapped "
                                     f"{h['mapped']} time(s)")):
                return v
            h["released"] = True  # the real driver frees it at the last unmap
            return _OK
        del self.handles[int(handle)]
        self.used_bytes -= h["size"]
        return _OK

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemAddressReserve", needs_ctx=True)) is not None:
            return r + (None,)
        if (not self._aligned(size) or size <= 0 or flags != 0 or _addr(addr) is None
                or not isinstance(alignment, int) or alignment < 0
                or alignment & (alignment - 1)):
            return (_INVALID, None)
        align = max(alignment, self.granularity)
        start = -(-self._next_va // align) * align
        self._next_va = start + size + self.granularity  # a guard gap between ranges
        self.reservations[start] = size
        insort(self._res_starts, start)
        return (CUresult.CUDA_SUCCESS, CUdeviceptr(start))

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemAddressFree", needs_ctx=True)) is not None:
            return r
        start = _addr(ptr)
        if start is None or self.reservations.get(start) != size:
            return (_INVALID,)
        i = bisect_right(self._map_starts, start + size - 1) - 1
        if i >= 0 and self._map_starts[i] + self.mappings[self._map_starts[i]]["size"] > start:
            return (_INVALID,)  # something is still mapped inside
        del self.reservations[start]
        self._res_starts.remove(start)
        return _OK

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemMap", needs_ctx=True)) is not None:
            return r
        start = _addr(ptr)
        if (start is None or not self._aligned(start, size, offset) or size <= 0
                or flags != 0 or not isinstance(handle, CUmemGenericAllocationHandle)):
            return (_INVALID,)
        h = self.handles.get(int(handle))
        if h is None or h.get("released") or offset + size > h["size"]:
            return (_INVALID,)
        if self._reservation_of(start, size) is None:
            return (_INVALID,)  # not inside one reserved range
        if any(m is not None for _, m in self._covering(start, size)):
            return (_INVALID,)  # already mapped (double map)
        i = bisect_right(self._map_starts, start)
        if i < len(self._map_starts) and self._map_starts[i] < start + size:
            return (_INVALID,)
        self.mappings[start] = {"size": size, "handle": int(handle),
                                "access": CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE}
        insort(self._map_starts, start)
        h["mapped"] += 1
        return _OK

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemSetAccess", needs_ctx=True)) is not None:
            return r
        start = _addr(ptr)
        if (start is None or not self._aligned(start, size) or size <= 0
                or not isinstance(desc, (list, tuple)) or count != len(desc) or count == 0):
            return (_INVALID,)
        for d in desc:
            if (not isinstance(d, CUmemAccessDesc)
                    or d.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    or not 0 <= d.location.id < self.devices
                    or not isinstance(d.flags, CUmemAccess_flags)):
                return (_INVALID,)
        pieces = list(self._covering(start, size))
        if any(m is None for _, m in pieces):
            return (_INVALID,)  # not fully mapped
        first_start, _ = pieces[0]
        last_start, last = pieces[-1]
        if first_start != start or last_start + last["size"] != start + size:
            return (_INVALID,)  # must cover whole mappings
        for _, m in pieces:
            m["access"] = desc[-1].flags
        return _OK

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple:  # noqa: N802
        if (r := self._enter("cuMemUnmap", needs_ctx=True)) is not None:
            return r
        start = _addr(ptr)
        m = self.mappings.get(start) if start is not None else None
        if m is None or m["size"] != size:
            return (_INVALID,)  # only a whole mapping can be unmapped
        if self.pending_work and (v := self._violation(
                f"cuMemUnmap of {start:#x} while a launched kernel was not synchronized")):
            return v
        del self.mappings[start]
        self._map_starts.remove(start)
        h = self.handles[m["handle"]]
        h["mapped"] -= 1
        if h.get("released") and not h["mapped"]:
            del self.handles[m["handle"]]
            self.used_bytes -= h["size"]
        return _OK


def new(**kwargs: Any) -> FakeDriver:
    """A fresh fake driver (see :class:`FakeDriver` for the arguments)."""
    return FakeDriver(**kwargs)
