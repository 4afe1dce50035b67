"""What the runtime asks of a device pool: the :class:`DevicePool` protocol.

The device pool is the budget: memory for swapped-in tensors, whose physical size is the
budget, so that going over it is :class:`~ooc.errors.OutOfBudget`, never a silent overflow.
Two pools implement it, both over ooc's allocator,
``vmm.SmallBlockAllocator(vmm.VirtualAllocator(vmm.ChunkPool(backend)))`` (tensors below a
chunk share chunks; larger ones get contiguous ranges of whole chunks):

==================================================  =======================================
:class:`~ooc.runtime.cpu_pool.CpuDevicePool` (CPU)   host chunks (memfd + mmap); ``take``
                                                     gives a flat uint8 CPU tensor
:class:`~ooc.runtime.cuda_pool.CudaDevicePool`       CUDA VMM chunks; ``take`` gives a flat
(GPU)                                                uint8 CUDA tensor (a ``DevicePtr`` over
                                                     a driver passed in, as tests do)
==================================================  =======================================

``tests/ooc/test_pool_protocol.py`` runs one conformance suite over both (the CUDA pool over
the fake CUDA driver): what is written here is what it checks.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["DevicePool", "RangeSource", "STATS_KEYS"]

#: Keys every pool's :meth:`DevicePool.stats` has (``vmm.VirtualAllocator.stats``; ints).
STATS_KEYS = ("allocations", "peak_allocations", "mapped_bytes", "peak_mapped_bytes")


@runtime_checkable
class RangeSource(Protocol):
    """Where a swap-in takes its destination: the device pool, or (for an on-demand step that
    has already failed its budget) plain memory outside it."""

    def take(self, nbytes: int) -> Any:
        """A fresh range of ``nbytes``: a flat uint8 tensor (or a ``DevicePtr``) that owns it;
        the range goes back when that object and every view of it are gone."""


@runtime_checkable
class DevicePool(RangeSource, Protocol):
    """Budgeted device memory for managed tensors; exactly what the runtime calls.

    Guarantees every implementation gives (and the conformance suite checks):

    * ``take(nbytes)`` gives a range of at least ``nbytes`` whose address is a multiple of
      :attr:`alignment`, distinct from every live range; past the budget it raises
      :class:`~ooc.errors.OutOfBudget` and the pool stays usable.
    * A range is handed back only when its last user is gone, at the next ``take`` or
      ``reap`` (never in a finalizer, which may run on any thread).
    * ``close()`` gives everything back; it refuses while ranges are in use, is idempotent,
      and ``take`` on a closed pool raises :class:`~ooc.errors.OOCError`.
    """

    @property
    def granularity(self) -> int:
        """The smallest chunk the engine may choose (a page on the CPU, the VMM granularity
        on a GPU); a range of whole chunks starts at a multiple of it."""

    @property
    def alignment(self) -> int:
        """Bytes every range's address is a multiple of (a page on the CPU, 512 on a GPU:
        ranges smaller than a chunk are packed into shared chunks)."""

    def reap(self) -> None:
        """Hand back the ranges whose last user died since the previous call."""

    def trim(self, limit: int | None = None) -> int:
        """Give back unused chunks: every one (``limit=None``), or whole chunks covering
        ``limit`` bytes. Returns the bytes given back."""

    def stats(self) -> dict[str, Any]:
        """Counters as a flat dict with at least the keys in :data:`STATS_KEYS`."""

    def close(self) -> None:
        """Give every chunk back to the backend. Refuses (``vmm`` AllocationError) while
        ranges are in use. Idempotent."""
