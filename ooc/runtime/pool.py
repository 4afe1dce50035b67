"""Device memory for swapped-in tensors, taken from a ``vmm`` chunk pool sized to the budget.

Why a pool and not ``torch.empty``: the pool's physical size *is* the budget (going over is
``OutOfBudget``, never a silent overflow), its ranges are page-aligned so reads can use
O_DIRECT, and chunks are reused without fragmenting.

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


class DevicePool:
    """Page-aligned byte buffers for managed tensors, backed by ``vmm.VirtualAllocator``."""

    def __init__(self, budget: int, chunk: int, backend: "vmm.Backend | None" = None, *,
                 on_physical: Callable[[int], None] | None = None) -> None:
        """``on_physical(nbytes)`` hears the pool's physical size (chunks that exist) whenever
        it changes: the CPU allocator's cache makes room as the pool grows."""
        self.backend = backend if backend is not None else vmm.HostBackend()
        capacity = max(chunk, budget // chunk * chunk)
        self.pool = vmm.ChunkPool(self.backend, chunk_bytes=chunk, capacity_bytes=capacity)
        self.allocator = vmm.VirtualAllocator(self.pool)
        self._dead: list[vmm.Allocation] = []
        self._on_physical = on_physical
        self._physical = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor of ``nbytes`` over a fresh pool range (raises OutOfBudget)."""
        self.reap()
        allocation = self.allocator.alloc(nbytes)
        self._report()
        array = np.frombuffer(allocation.buffer(), dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._dead.append, allocation)
        return torch.from_numpy(array)

    def _report(self) -> None:
        physical = self.pool.created * self.pool.chunk_bytes
        if physical != self._physical and self._on_physical is not None:
            self._on_physical(physical)
        self._physical = physical

    def reap(self) -> None:
        """Hand back the ranges whose last tensor died since the previous call."""
        while self._dead:
            self.allocator.free(self._dead.pop())

    def trim(self) -> int:
        """Give the physical pages of every unused chunk back (at the end of a step).

        Without this, chunks the backward's swap-ins touched stay resident through the next
        forward, whose own activations then come on top: the process would hold up to
        twice the budget.
        """
        self.reap()
        freed = self.allocator.trim()
        self._report()
        return freed

    def stats(self) -> dict:
        return self.allocator.stats()
