"""What an engine holds outside itself, and how it lets go of it.

Hooks on the model and the optimizer, the tier's threads and file, the pool's device memory,
and the process effects of its steps (``ooc/runtime/process_effects.py``) are given back by
``close()``, or when the engine is garbage-collected without it (``collected``). The CPU
allocator's bounds for a step are here too: they decide how much of the process's memory
outside the budget the engine may keep between ops.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Collection

from ooc.runtime.cpu_allocator import NO_CAP
from ooc.runtime.process_effects import ProcessEffects


def weakly(method: Any) -> Any:
    """``method`` called through a weak reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else m(*args, **kwargs)
    return call


@dataclass
class Held:
    """The engine's tier and its current pool, for ``collected``."""

    tier: Any
    pool: Any


def collected(hooks: list, effects: ProcessEffects, held: Held) -> None:
    """An engine was garbage-collected without ``close()``: remove its hooks from the model
    and optimizer, stop its tier's threads, give its pool back, undo its process effects.
    (After ``close()`` each of these is done already and does nothing.)"""
    for h in hooks:
        h.remove()
    try:
        held.tier.close()
        close_pool(held.pool)
    finally:
        effects.undo()


def close_pool(pool: Any) -> None:
    """Give a pool's device memory back for good: a GPU pool also releases its VMM chunks and
    ranges and the CUDA context it retained (trim alone leaves the context retained), as soon
    as no tensor the user kept lives in it (``CudaDevicePool.close_or_linger``). The CPU pool
    has nothing beyond trim."""
    close = getattr(pool, "close_or_linger", None)
    if close is not None:
        from ooc.runtime.cuda_pool import close_lingering

        close_lingering()   # earlier engines' pools whose last tensors are gone by now
        close()


def recycle_bytes(budget: int) -> int:
    """The CPU allocator's floor: bytes of freed blocks it may keep even above the step's live
    peak (an eighth of the budget, 32-64 MiB). Above the live peak they would count in the
    process's memory, outside the budget: a fixed 256 MiB cache cost a 2 GiB-budget GPT
    +270 MiB of training memory."""
    return min(max(budget // 8, 32 << 20), 64 << 20)


def cache_cap(budget: int, manage: Collection[str]) -> int:
    """The most the CPU allocator may keep cached in a step that runs a plan.

    With parameters, gradients or optimizer state managed, half the budget, at most 256 MiB:
    the budget then stands for the training memory, and within the live-peak bound alone what
    the cache held at moments when PyTorch's other memory peaked still added up: +20-30 MiB
    steady peak on VGG16 at 1/2 and 1/4 of its peak (+11-24 MiB re-measured on 2026-11-25),
    +370 MiB on a 2 GiB-budget GPT of depth 24 (caps of 1/2 and 1/4 of the budget brought VGG16
    back to the old allocator's peak).

    With activations alone managed (plain steps included), no cap beyond the live-peak bound:
    the weights, their gradients and state and the unmanaged temporaries are in-core training's
    own, which glibc would cache the same way, and the cap only made the kernel zero them again
    each step. ResNet-18 at 32 px and a small budget re-faulted its weight gradients every
    step (+20%, plain steps). GPT 6x256 batch 8 at 1/4 of its activations' peak: its 64 MiB
    vocabulary-sized blocks never fit the 54 MiB cap, and page zeroing took ~10% of both cores
    (perf); lifted, 1.41x -> 1.15x in-core at the same rise (368 -> 367 MiB, 3 fresh-process rounds). ResNet-50 batch 8
    at 1/4: 1.38x -> 1.33x, rise 509 -> 506 MiB; small CNN at 1/4 and 1/8: rise 211 -> 188 and
    177 -> 175 MiB, time within noise."""
    if set(manage) <= {"activations"}:
        return NO_CAP
    return min(budget // 2, 256 << 20)
