"""The CPU device pool: memory for swapped-in tensors from a ``vmm`` chunk pool sized to the budget.

One of the two :class:`~ooc.runtime.pool.DevicePool` implementations (the other is
:class:`~ooc.runtime.cuda_pool.CudaDevicePool`).

Why a pool and not ``torch.empty``: the pool's physical size *is* the budget (going over is
``OutOfBudget``, never a silent overflow), its ranges are page-aligned so reads can use
O_DIRECT, and chunks are reused without fragmenting. The allocator is ooc's
(``vmm.SmallBlockAllocator``, the one ``ooc frag`` replays as ``vmm-N``): a tensor smaller
than a chunk shares a chunk with others (page-aligned blocks), a larger one gets a contiguous
range of whole chunks whose unused tail takes small ones.

Lifetime rule (a violation is a segfault, not an exception): a pool range is returned only
when the last tensor viewing it is gone. ``torch.from_numpy`` keeps the numpy array alive as
long as any tensor uses its storage, so a ``weakref.finalize`` on that array frees the range
exactly when PyTorch lets go of it. The range is handed back to the allocator at the next
``take`` or ``reap`` (not inside the finalizer, which runs while numpy still holds its buffer
view and possibly on an I/O thread).
"""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np
import torch

import vmm
from ooc.errors import OOCError

__all__ = ["CpuDevicePool"]


class CpuDevicePool:
    """Page-aligned byte buffers for managed tensors, backed by ``vmm.SmallBlockAllocator``
    over a ``vmm.VirtualAllocator`` of host chunks (memfd + mmap). Conforms to
    :class:`~ooc.runtime.pool.DevicePool`."""

    def __init__(self, budget: int, chunk: int, backend: "vmm.Backend | None" = None, *,
                 on_physical: Callable[[int, int], None] | None = None) -> None:
        """``on_physical(used, idle)`` hears, whenever they change, the bytes of chunks under
        live tensors and of chunks that exist but hold none: the CPU allocator counts the used
        ones as live and bounds the idle ones together with its cache."""
        self.backend = backend if backend is not None else vmm.HostBackend()
        capacity = max(chunk, budget // chunk * chunk)
        self.pool = vmm.ChunkPool(self.backend, chunk_bytes=chunk, capacity_bytes=capacity)
        # ooc's allocator with its default tiers, as ``ooc frag`` replays it, with blocks
        # packed at page alignment: reads and writes of the storage tier stay O_DIRECT. It
        # never maps more than the plan's chunk-rounded sizes (vmm.small_blocks: the bound).
        page = self.backend.granularity
        self.allocator = vmm.SmallBlockAllocator(vmm.VirtualAllocator(self.pool), align=page)
        self._dead: list[vmm.Allocation] = []
        self._on_physical = on_physical
        self._reported = (0, 0)
        self._closed = False
        if on_physical is not None:   # a pool dropped without trim() holds nothing any more
            weakref.finalize(self, on_physical, 0, 0)

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor of ``nbytes`` over a fresh pool range (raises OutOfBudget)."""
        if self._closed:
            raise OOCError("CpuDevicePool is closed")
        self.reap()
        allocation = self.allocator.alloc(nbytes)
        self._report()
        array = np.frombuffer(allocation.buffer(), dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._dead.append, allocation)
        return torch.from_numpy(array)

    def _report(self) -> None:
        used = self.allocator.mapped_bytes
        now = (used, self.pool.created * self.pool.chunk_bytes - used)
        if now != self._reported and self._on_physical is not None:
            self._on_physical(*now)
        self._reported = now

    def reap(self) -> None:
        """Hand back the ranges whose last tensor died since the previous call."""
        if not self._dead:
            return
        while self._dead:
            self.allocator.free(self._dead.pop())
        self._report()

    def trim(self, limit: int | None = None) -> int:
        """Give the physical pages of unused chunks back: every one (``engine.close()``, and
        where no CPU allocator bounds the idle chunks: the end of each step), or whole chunks
        covering ``limit`` bytes (the allocator's bound asks for them), the others staying
        populated for the next swap-ins. Returns the bytes given back.

        Without the full trim, chunks the backward's swap-ins touched stay resident through
        the next forward, whose own activations then come on top: the process would hold up
        to twice the budget.
        """
        self.reap()
        freed = self.allocator.trim(limit)
        self._report()
        return freed

    @property
    def granularity(self) -> int:
        """The chunk's smallest size and the alignment of every range: the page."""
        return self.backend.granularity

    @property
    def alignment(self) -> int:
        """What every range's address is a multiple of: the page (blocks are page-aligned)."""
        return self.allocator.alignment

    def stats(self) -> dict:
        """The allocator's statistics (see ``vmm.SmallBlockAllocator.stats``)."""
        return self.allocator.stats()

    def close(self) -> None:
        """Give every chunk and the address space back (the memfd is closed). Refuses while
        ranges are in use (a tensor over them would point at unmapped memory: a segfault):
        drop them first. Idempotent. The engine does not call it: a CPU pool it lets go of is
        trimmed and freed with its last tensor (the backend's finalizer)."""
        if self._closed:
            return
        self.reap()
        self.allocator.close()   # raises AllocationError while allocations are live
        self.backend.close()
        self._closed = True
        self._report()
