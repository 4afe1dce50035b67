"""The value types of the FAKE ``cuda.bindings.driver`` as cuda-python spells them: result
codes, enums, handle wrappers (``CUdeviceptr``, ``CUstream``...) and the property structs the
VMM calls take. Not CUDA; tests only.

Apart from :mod:`ooc.testing.fake_cuda_driver` (the calls and the contract they enforce)
because these are plain values that every fake driver module shares.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["CUresult", "CUmemAllocationType", "CUmemLocationType", "CUmemAllocationGranularity_flags", "CUmemAccess_flags", "CUdeviceptr", "CUdevice", "CUcontext", "CUstream", "CUmemGenericAllocationHandle", "CUmemLocation", "CUmemAllocationProp", "CUmemAccessDesc"]


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Handle:
    """Like cuda-python's opaque handle classes: wraps an int, ``int()`` gives it back."""

    def __init__(self, value: int = 0) -> None:
        self._value = int(value)

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and int(other) == self._value

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdeviceptr(_Handle):
    pass


class CUdevice(_Handle):
    pass


class CUcontext(_Handle):
    pass


class CUstream(_Handle):
    pass


class CUmemGenericAllocationHandle(_Handle):
    pass


class CUmemLocation:
    def __init__(self) -> None:
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.location = CUmemLocation()
        self.requestedHandleTypes = 0


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


_OK = (CUresult.CUDA_SUCCESS,)
_INVALID = CUresult.CUDA_ERROR_INVALID_VALUE


def _addr(value: Any) -> int | None:
    """A CUdeviceptr argument: cuda-python accepts the wrapper or a plain int."""
    if isinstance(value, (CUdeviceptr, int)) and not isinstance(value, bool):
        return int(value)
    return None
