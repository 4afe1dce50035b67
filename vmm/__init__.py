"""Device memory without fragmentation: fixed-size physical chunks mapped onto contiguous
virtual ranges (Hayakawa & Narihira), over a host (memfd + mmap, or anonymous pages moved with
mremap), CUDA (VMM driver API) or simulated backend; plus a model of PyTorch's best-fit
caching allocator to compare against.

No torch here. Public names are loaded on first use, so the CUDA backend's optional
dependency is only imported by code that asks for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from vmm.errors import OOCError, OutOfBudget, VMMError
from vmm.units import SizeError, format_size, parse_size

_EXPORTS = {
    "Backend": "backend",
    "HostBackend": "host",
    "AnonHostBackend": "anon_host",
    "SimBackend": "sim",
    "CudaBackend": "cuda",
    "ChunkPool": "pool",
    "VirtualAllocator": "virtual", "Allocation": "allocation",
    "CachingAllocator": "caching",
    "SmallBlockAllocator": "small_blocks", "SmallBlock": "small_blocks",
    "default_tiers": "small_blocks",
}

__all__ = sorted([*_EXPORTS, "OOCError", "OutOfBudget", "VMMError", "SizeError",
                  "format_size", "parse_size"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"vmm.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vmm' has no attribute {name!r}")
