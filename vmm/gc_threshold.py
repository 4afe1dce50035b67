"""``garbage_collection_threshold``: give back old cached segments before reserved nears a cap.

PyTorch (``garbage_collect_cached_blocks`` in ``c10/cuda/CUDACachingAllocator.cpp``) runs
this only when ``PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:T`` (0 < T < 1) is set
**and** the process has a memory cap (``torch.cuda.set_per_process_memory_fraction``): without
the cap it does nothing at all. Why it exists: instead of the costly "free every cached
segment and retry" at an out-of-memory, it frees the cached segments that have gone unused
longest, early, each time a request misses the cache while reserved is above ``T * cap``.

The rules followed:

- *when*: a request found no free block in its pool (before a new segment is asked for),
  and reserved bytes exceed ``T * cap``; the goal is to reclaim ``reserved - T * cap``;
- *what*: only whole free segments of the **large** pool (a free block with no neighbour;
  split segments and the small pool are left alone), never expandable segments;
- *age*: a free block's age counts the block searches made in its pool since it was last
  put back in the pool;
- *order*: in passes: each pass takes the mean age of the remaining candidates and frees,
  walking the pool in (size, address) order, every candidate at least that old; passes
  repeat while the goal is not met and the last pass freed something. A pass does not stop
  at the goal: it may free more than asked, as PyTorch does.

The allocator (:class:`vmm.CachingAllocator`) keeps the ages and releases the segments;
this module holds the choice, as a pure function the tests can drive by hand.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["check_threshold", "segments_to_release"]


def check_threshold(threshold: float) -> float:
    """``threshold`` if PyTorch accepts it (strictly between 0 and 1), else ValueError."""
    if not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"garbage_collection_threshold:{threshold} is outside (0, 1); give a "
                         f"fraction of the memory cap such as 0.6, as PyTorch requires")
    return float(threshold)


def segments_to_release(candidates: Sequence[tuple[int, int]], reserved: int, cap: int,
                        threshold: float) -> list[int]:
    """Which candidates to free: indices into ``candidates``, a list of ``(size, age)`` of
    the whole free large-pool segments in pool order (size, then address).

    Returns ``[]`` while ``reserved <= threshold * cap`` (PyTorch truncates the product to
    whole bytes, as here).
    """
    limit = int(threshold * cap)
    if reserved <= limit or not candidates:
        return []
    target = reserved - limit
    alive = list(range(len(candidates)))
    total_age = float(sum(age for _, age in candidates))
    reclaimed = 0
    chosen: list[int] = []
    freed_any = True
    while reclaimed < target and freed_any and alive:
        mean = total_age / len(alive)
        freed_any = False
        keep = []
        for i in alive:
            size, age = candidates[i]
            if age >= mean:
                freed_any = True
                reclaimed += size
                total_age -= age
                chosen.append(i)
            else:
                keep.append(i)
        alive = keep
    return chosen
