"""The CPU device pool: memory for swapped-in tensors from a ``vmm`` chunk pool sized to the budget.

One of the two :class:`~ooc.runtime.pool.DevicePool` implementations (the other is
:class:`~ooc.runtime.cuda_pool.CudaDevicePool`).

Why a pool and not ``torch.empty``: the pool's physical size *is* the budget (going over is
``OutOfBudget``, never a silent overflow), its ranges are page-aligned so reads can use
O_DIRECT, and chunks are reused without fragmenting. The allocator is ooc's
(``vmm.SmallBlockAllocator``, the one ``ooc frag`` replays as ``vmm-N``): a tensor smaller
than a chunk shares a chunk with others (page-aligned blocks), a larger one gets a contiguous
range of whole chunks whose unused tail takes small ones.

Its chunks are anonymous pages (``vmm.AnonHostBackend``) lent by ooc's CPU allocator
(``ooc.host.cpu_allocator``) and given back to it as soon as a freed range leaves them
unused: one cache of populated pages serves the step's tensors and the pool's swap-ins alike,
where a pool of its own would make the kernel zero fresh pages each time memory changed sides.

Lifetime rule (a violation is a segfault, not an exception): a pool range is returned only
when the last tensor viewing it is gone. ``torch.from_numpy`` keeps the numpy array alive as
long as any tensor uses its storage, so a ``weakref.finalize`` on that array frees the range
exactly when PyTorch lets go of it. The range is handed back to the allocator at the next
``take`` or ``reap`` (not inside the finalizer, which runs while numpy still holds its buffer
view and possibly on an I/O thread).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import numpy as np
import torch

import vmm
from ooc.errors import OOCError
from ooc.host import cpu_allocator

__all__ = ["CpuDevicePool"]

log = logging.getLogger(__name__)


def _anonymous(share_pages: bool) -> "vmm.Backend":
    """Anonymous chunks (their pages shared with the CPU allocator's cache when asked), or
    memfd chunks on a kernel without ``MREMAP_DONTUNMAP``, where moving anonymous pages is
    not safe beside other threads (``vmm.anon_host``): same results, more page faults."""
    try:
        return (vmm.AnonHostBackend(lend=cpu_allocator.lend, adopt=cpu_allocator.adopt)
                if share_pages else vmm.AnonHostBackend())
    except vmm.VMMError as e:
        log.info("ooc's CPU pool uses memfd chunks: %s", e)
        return vmm.HostBackend()


class CpuDevicePool:
    """Page-aligned byte buffers for managed tensors, backed by ``vmm.SmallBlockAllocator``
    over a ``vmm.VirtualAllocator`` of host chunks (anonymous pages moved with mremap, or the
    ``backend`` given). Conforms to
    :class:`~ooc.runtime.pool.DevicePool`."""

    def __init__(self, budget: int, chunk: int, backend: "vmm.Backend | None" = None, *,
                 on_physical: Callable[[int, int], None] | None = None,
                 share_pages: bool = False) -> None:
        """``on_physical(used, idle)`` hears, whenever they change, the bytes of chunks under
        live tensors and of chunks that exist but hold none: the CPU allocator counts the used
        ones as live and bounds the idle ones together with its cache. ``share_pages`` (the
        engine's pools; ``backend`` must be None): chunks take their pages from the CPU
        allocator's cache and, while it is installed, give them back as soon as a freed range
        leaves them unused (``reap``)."""
        if share_pages and backend is not None:
            raise OOCError("CpuDevicePool: share_pages needs the pool's own backend (backend=None)")
        if backend is None:
            backend = _anonymous(share_pages)
            share_pages = share_pages and isinstance(backend, vmm.AnonHostBackend)
        self._shared = share_pages
        self.backend = backend
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
        if self._shared and cpu_allocator.lending():
            self.allocator.trim()   # their chunks' pages serve the next tensor or chunk alike
        self._report()

    def trim(self, limit: int | None = None) -> int:
        """Release the unused chunks (every one, or whole chunks covering ``limit`` bytes):
        their pages go to the CPU allocator's cache where it is in use, else back to the
        kernel. The engine trims at each step's end and at ``close()``. Returns the bytes
        released.

        Without it, chunks the backward's swap-ins touched would stay resident through the
        next forward, whose own activations then come on top: the process would hold up to
        twice the budget.
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
