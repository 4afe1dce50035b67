"""A backend of addresses and bookkeeping only: simulate a 16-80 GB device on a laptop.

Nothing is allocated. Chunks are numbers, address ranges come from a bump pointer in a
64-bit space, and every call checks the same contract as the real backends (granularity,
map only inside a reserved range, no double map, unmap before release, no mapping left in a
freed range), so an allocator that misuses the interface fails here, in simulation, with a
:class:`vmm.backend.ContractError` rather than later on a device.
"""

from __future__ import annotations

from typing import Any, Sequence

from vmm.backend import Backend, ContractError, DeviceOutOfMemory, Ledger
from vmm.units import format_size

_BASE = 0x7F00_0000_0000  # where simulated address space starts (looks like a device VA)


class SimBackend(Backend):
    """Simulated chunks and address ranges; optionally a physical capacity.

    Args:
        granularity: bytes every size and address must be a multiple of (default 2 MiB,
            the CUDA VMM minimum granularity on current GPUs).
        capacity_bytes: if given, ``create_chunk`` fails with
            :class:`vmm.backend.DeviceOutOfMemory` once this many bytes of chunks exist,
            like ``cuMemCreate`` on a full device. ``None`` means unlimited (the pool's
            budget is then the only limit).

    ``calls`` counts every call by name, for tests and benchmarks.
    """

    name = "sim"

    def __init__(self, granularity: int = 2 << 20, *, capacity_bytes: int | None = None) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ContractError(f"sim backend: granularity must be a power of two, got {granularity}")
        self.granularity = granularity
        self.capacity_bytes = capacity_bytes
        self.ledger = Ledger(granularity, "sim")
        self.physical_bytes = 0
        self.calls: dict[str, int] = dict.fromkeys(
            ("create_chunk", "release_chunk", "reserve_range", "free_range", "map",
             "set_access", "unmap"), 0)
        self._next_handle = 0
        self._next_address = _BASE

    def create_chunk(self, nbytes: int) -> int:
        self.calls["create_chunk"] += 1
        self.ledger.check_size("create_chunk", nbytes)
        if self.capacity_bytes is not None and self.physical_bytes + nbytes > self.capacity_bytes:
            raise DeviceOutOfMemory(
                f"sim backend: create_chunk of {format_size(nbytes)} fails: "
                f"{format_size(self.physical_bytes)} of {format_size(self.capacity_bytes)} "
                "already exist")
        handle = self._next_handle
        self._next_handle += 1
        self.ledger.add_chunk(handle, nbytes)
        self.physical_bytes += nbytes
        return handle

    def release_chunk(self, handle: Any) -> None:
        self.calls["release_chunk"] += 1
        self.physical_bytes -= self.ledger.remove_chunk(handle)

    def reserve_range(self, nbytes: int, alignment: int = 0) -> int:
        self.calls["reserve_range"] += 1
        self.ledger.check_size("reserve_range", nbytes)
        align = max(alignment, self.granularity)
        if align & (align - 1):
            raise ContractError(f"sim backend: alignment {alignment} is not a power of two")
        address = -(-self._next_address // align) * align
        # Leave one granule of unreserved space between ranges, so an off-by-one mapping
        # past a range's end lands in no range and is caught rather than silently
        # touching the next range.
        self._next_address = address + nbytes + self.granularity
        self.ledger.add_range(address, nbytes)
        return address

    def free_range(self, address: int, nbytes: int) -> None:
        self.calls["free_range"] += 1
        self.ledger.remove_range(address, nbytes)

    def map(self, address: int, handle: Any, nbytes: int) -> None:
        self.calls["map"] += 1
        self.ledger.add_mappings(address, (handle,), nbytes)

    def map_many(self, address: int, handles: Sequence[Any], chunk_bytes: int) -> None:
        self.calls["map"] += len(handles)
        self.ledger.add_mappings(address, handles, chunk_bytes)

    def set_access(self, address: int, nbytes: int) -> None:
        self.calls["set_access"] += 1
        if not self.ledger.is_mapped(address, nbytes, whole=True):
            raise ContractError(f"sim backend: set_access on [0x{address:x}, +{nbytes}) "
                                "which is not fully mapped")

    def unmap(self, address: int, nbytes: int, fence: Any = None) -> None:
        self.calls["unmap"] += 1
        self.ledger.remove_mappings(address, nbytes)

    def close(self) -> None:
        """Forget everything (there is nothing real to give back)."""
        self.ledger = Ledger(self.granularity, "sim")
        self.physical_bytes = 0
