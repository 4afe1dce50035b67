"""What an engine holds outside itself, and how it lets go of it.

Hooks on the model and the optimizer, the tier's threads and file, the pool's device memory,
and the process effects of its steps (``ooc/host/process_effects.py``) are given back by
``close()``, or when the engine is garbage-collected without it (``collected``). The CPU
allocator's bounds for a step are here too: they decide how much of the process's memory
outside the budget the engine may keep between ops.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ooc.host.process_effects import ProcessEffects
from ooc.runtime.user_hooks import UserHook
from ooc.storage import reaper


def weak_method(method: Any) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object (a no-op once it is gone): a
    part given the engine's method does not keep the engine alive. A bound method did (a cycle
    engine -> part -> method -> engine), so a dropped engine, with the model, optimizer and
    state it refers to, waited for the cyclic collector: a run that makes a new engine after a
    refused one held the old optimizer's state beside the new step (48 MiB of AdamW's on a
    GPT-2 of 20 MiB of weights)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else m(*args, **kwargs)
    return call


def weakly(method: Any) -> UserHook:
    """``weak_method(method)`` as a hook on the user's objects (inert in their copies)."""
    return UserHook(weak_method(method))


@dataclass
class Held:
    """The engine's tier and its current pool, for ``collected``."""

    tier: Any
    pool: Any


def collected(hooks: list, effects: ProcessEffects, held: Held) -> None:
    """An engine was garbage-collected without ``close()``: remove its hooks from the model
    and optimizer, undo its process effects, and have the reaper thread stop its tier's
    threads and give its pool back (joining threads inside a finalizer can hang:
    ``ooc/storage/reaper.py``). (After ``close()`` each of these is done already and does
    nothing.)"""
    for h in hooks:
        h.remove()
    try:
        reaper.later(_let_go, held.tier, held.pool)
    finally:
        effects.undo()


def _let_go(tier: Any, pool: Any) -> None:
    try:
        tier.close()
    finally:
        close_pool(pool)


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


def recycle_bytes(budget: int, *, whole_step: bool = False) -> int:
    """The CPU allocator's floor: bytes of freed blocks it may keep even above the step's live
    peak (an eighth of the budget, 32-64 MiB). Above the live peak they would count in the
    process's memory, outside the budget: a fixed 256 MiB cache cost a 2 GiB-budget GPT
    +270 MiB of training memory. A budget for the whole step (``whole_step``,
    ``Options(budget_covers="step")``) covers the cache too, which takes an eighth of it, at
    most 64 MiB, with no floor: a small step budget would go to the cache.

    Beyond the live-peak bound, the cache has no cap, whatever is managed. With parameters,
    gradients or optimizer state managed it was capped at half the budget (at most 256 MiB)
    until 2026-11-25: parameters built before the engine then re-allocated through glibc at
    each swap-in, memory the live-peak bound could not see, and without the cap the cache came
    on top of it (+20-30 MiB steady peak on VGG16 at 1/2 and 1/4 of its peak, +370 MiB on a
    2 GiB-budget GPT of depth 24). Since the engine moves those parameters into this
    allocator (``cpu_allocator.claim``), the cap only made the kernel zero pages again each
    step: VGG16 (update inside the backward) at 0.35 of its peak 1.27x -> 1.22x in-core at the
    same rise (105 -> 106 MiB), at 1/4 1.33x -> 1.27x; the GPT of depth 24 at 2 GiB 10.3 ->
    7.9 s a step at the same training memory (2,156 -> 2,158 MiB). With activations alone
    managed it was lifted earlier: the cap re-faulted ResNet-18's weight gradients every step
    (+20%), GPT 6x256 at 1/4 ran 1.41x -> 1.15x in-core once lifted, at the same rise."""
    return min(budget // 8 if whole_step else max(budget // 8, 32 << 20), 64 << 20)
