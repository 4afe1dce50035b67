"""PyTorch's size rules for its caching allocator: how a request is rounded and how large a
segment it gets (``c10/cuda/CUDACachingAllocator.cpp``: ``kMinBlockSize``, ``kSmallSize``,
``kSmallBuffer``, ``kLargeBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``, ``round_size``,
``get_allocation_size``).

Apart from :mod:`vmm.caching` because both models of PyTorch's allocator use them: the default
one (:class:`vmm.caching.CachingAllocator`) and the one with expandable segments
(:class:`vmm.expandable.ExpandableAllocator`).
"""

from __future__ import annotations

from vmm.roundup import round_up

__all__ = ["K_MIN_BLOCK_SIZE", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_LARGE_BUFFER",
           "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "round_size", "allocation_size", "block_size"]

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20

def round_size(nbytes: int) -> int:
    """PyTorch's ``round_size``: at least 512, else up to a multiple of 512."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """PyTorch's ``get_allocation_size``: the segment a rounded request would get."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def block_size(nbytes: int, roundup_divisions: int = 1) -> int:
    """PyTorch's ``round_size``: 512-byte multiples, or the ``roundup_power2_divisions``
    rounding when it is set (more than one division)."""
    if roundup_divisions > 1:
        return round_up(nbytes, roundup_divisions)
    return K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else \
        -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

