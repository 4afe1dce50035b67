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
                 on_physical: Callable[[int, int], None] | None = None) -> None:
        """``on_physical(used, idle)`` hears, whenever they change, the bytes of chunks under
        live tensors and of chunks that exist but hold none: the CPU allocator counts the used
        ones as live and bounds the idle ones together with its cache."""
        self.backend = backend if backend is not None else vmm.HostBackend()
        capacity = max(chunk, budget // chunk * chunk)
        self.pool = vmm.ChunkPool(self.backend, chunk_bytes=chunk, capacity_bytes=capacity)
        self.allocator = vmm.VirtualAllocator(self.pool)
        self._dead: list[vmm.Allocation] = []
        self._on_physical = on_physical
        self._reported = (0, 0)
        if on_physical is not None:   # a pool dropped without trim() holds nothing any more
            weakref.finalize(self, on_physical, 0, 0)

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU tensor of ``nbytes`` over a fresh pool range (raises OutOfBudget)."""
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

    def stats(self) -> dict:
        return self.allocator.stats()
