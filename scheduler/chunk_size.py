"""Which tensors are worth managing: the chunk size, and with it the size threshold.

The runtime manages a tensor only from half a chunk up (``min_bytes = chunk / 2``): a smaller
one would take a whole chunk of the pool for its bytes, and moving it costs bookkeeping and
a transfer of its own for little memory. With a fixed 2 MiB chunk a small model (ResNet-18 at
batch 8, 64x64) saves almost every activation in tensors under 1 MiB: nothing is managed, a
budget of a quarter of its activations moves no byte and the process saves nothing.

So, by default, the chunk follows the sizes one recorded step saved and the budget:
:func:`choose_chunk` picks the largest chunk whose threshold leaves at most an eighth of the
budget in saved activations that stay outside it (a larger chunk means fewer, larger
transfers and less bookkeeping; a smaller one manages more tensors). The eighth is the share
of the budget that the CPU allocator may already keep above the live tensors (its floor):
what is left outside the budget stays of that order. Pure arithmetic on sizes: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Saved activations below the threshold may take at most this share of the budget.
UNMANAGED_SHARE = 8


def unmanaged_bytes(saved: Iterable[int], min_bytes: int) -> int:
    """Bytes of the saved tensors smaller than ``min_bytes``: with that threshold they stay
    with PyTorch, outside the budget."""
    return sum(n for n in saved if n < min_bytes)


def choose_chunk(saved: Iterable[int], budget: int, chunk: int, floor: int) -> int:
    """The chunk to manage a step with, from the sizes of the storages it saved for backward.

    Returns ``chunk`` itself when everything saved fits the budget together (nothing has to
    move, so there is nothing to gain) or when its threshold (``chunk / 2``) already leaves
    at most ``budget / UNMANAGED_SHARE`` unmanaged. Otherwise the largest ``chunk / 2**k``
    that is a multiple of ``floor`` (the backend's granularity: the page size on a CPU, the
    VMM granularity, 2 MiB, on a GPU) and leaves at most that; ``floor``'s own multiple, the
    smallest candidate, when none does. Never larger than ``chunk``: a smaller budget never
    gets a larger chunk (less budget must never mean more memory).

    Args:
        saved: bytes of each distinct storage autograd saved in the step (managed or not).
        budget: the budget in bytes.
        chunk: the current chunk size in bytes.
        floor: the smallest chunk the pool's backend can map, in bytes.
    """
    sizes = list(saved)
    if sum(sizes) <= budget:
        return chunk
    allowed = budget // UNMANAGED_SHARE
    best = chunk
    candidate = chunk
    while True:
        if candidate % floor == 0:
            best = candidate
            if unmanaged_bytes(sizes, candidate // 2) <= allowed:
                return candidate
        if candidate // 2 < floor:
            return best
        candidate //= 2
