"""``ooc.Options``: the engine's advanced knobs, in one object.

``OutOfCore`` takes what most training scripts set (model, optimizer, budget, device, what to
manage, recomputation, pins, where the swap file goes); everything else has a default that
adapts or measured well, and lives here, as ``torch.utils.checkpoint``'s rarely used flags
would: one frozen object, validated once, printed whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ooc.errors import OOCError
from ooc.runtime.torch_arena import ARENAS
from vmm.units import parse_size

RECOMPUTE = ("auto", "never", "prefer")   # OutOfCore(recompute=...): the scheduler's words
BUDGET_COVERS = ("managed", "step")   # Options(budget_covers=...): what the budget bounds
MAX_PLANS = 16   # plans kept (start x shape), least recently used out (ooc/engine/plan_cache.py)


@dataclass(frozen=True, slots=True)
class Options:
    """Advanced settings of ``ooc.OutOfCore`` (``options=ooc.Options(...)``).

    Args:
        chunk: physical chunk size of the device pool, bytes or a size string. Default
            (None): it adapts. The engine starts at 2 MiB (on the CPU, at most the budget
            rounded down to a power of two), and after its first recording step, if the
            activations it saved exceed the budget and those under half a chunk (left to
            PyTorch) take more than an eighth of it, it halves the chunk until they do not,
            down to the page size on the CPU (the VMM granularity, 2 MiB, on a GPU: there it
            warns instead), and records again (``scheduler/chunk_size.py``); where a
            recording's plan is refused, it tries half the chunk first
            (``ooc/engine/chunk_choice.py``). Given (or with ``min_bytes``), it is fixed.
        min_bytes: tensors smaller than this stay with PyTorch (default: chunk / 2, and it
            adapts with the default chunk).
        window: the planner's prefetch window in bytes or a size string (default: the
            scheduler's).
        threads: I/O threads of the CPU swap file (default 2: on a 2-core host more threads
            take compute from the ops).
        verify: checksum swapped bytes and raise ``StorageError`` on corruption.
        hook_steps: let a settled plan run without intercepting ops, at autograd's
            saved-tensor hooks (``steps.plain``, ``steps.anchored`` in ``stats()``): one that
            moves nothing, swaps, or recomputes the chains its templates rerun
            (docs/guide/steps.md, "The template form"). False: every planned step
            runs per op (to measure that path).
        max_plans: plans kept, per start state and step shape, least recently used out.
        arena: where swapped-in tensors live. ``"auto"`` (default): ``"pytorch"`` on CUDA,
            ``"pool"`` on the CPU. ``"pytorch"`` (CUDA only): PyTorch's caching allocator,
            where the blocks the forward's swapped-out activations left serve the backward's
            swap-ins (one arena, one peak; fragmentation is PyTorch's, see its
            ``expandable_segments``): measured on an H100 1.2-3.2 GiB under the pool at the
            same budget and speed. ``"pool"``: ooc's own VMM pool, chunks sized to the
            budget, free of fragmentation, beside PyTorch's caching allocator (their peaks add
            up). The budget bounds ooc's bytes either way (``ooc/runtime/torch_arena.py``
            says why).
        budget_covers: what the budget bounds. ``"managed"`` (default): the tensors ooc
            manages; the step's other bytes (weights, gradients, optimizer state, the
            backward's temporaries, tensors under ``min_bytes``) sit beside them. ``"step"``:
            every tensor byte the step holds, as a device of that size would (a 16 GiB GPU, a
            board with 2 GiB of RAM): after the first step records the whole step, the
            managed tensors get what is left where the step holds the most beside them (less,
            on the CPU, the allocator's cache and the engine's records:
            ``scheduler/whole_step.py``). ``stats()``' ``budget`` is then that managed budget,
            ``step_budget`` the one given and ``step_held_bytes`` the most the step held beside
            it. The recording step bounds its managed tensors only (within the budget less what
            the step starts with); a later shape that holds more beside them lowers their share.

    Example::

        engine = ooc.OutOfCore(model, opt, budget="256MiB", options=ooc.Options(chunk="64KiB"))
    """

    chunk: int | str | None = None
    min_bytes: int | str | None = None
    window: int | str | None = None
    threads: int = 2
    verify: bool = False
    hook_steps: bool = True
    max_plans: int = MAX_PLANS
    arena: str = "auto"
    budget_covers: str = "managed"

    def __post_init__(self) -> None:
        if self.arena not in ARENAS:
            raise OOCError(f"Options.arena must be one of {list(ARENAS)}, got {self.arena!r}")
        if self.budget_covers not in BUDGET_COVERS:
            raise OOCError(f"Options.budget_covers must be one of {list(BUDGET_COVERS)}, got {self.budget_covers!r}")
        for name in ("chunk", "min_bytes", "window"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_size(value, what=name))
        for name in ("threads", "max_plans"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OOCError(f"Options.{name} must be a positive int, got {value!r}")


def recompute_word(recompute: Any) -> str:
    """The scheduler's word for ``recompute``. The booleans of ooc 0.1 still work, with a
    DeprecationWarning: True was "auto", False "never" (unambiguous, so a script written for
    0.1 keeps its plans for one more release)."""
    if recompute is True or recompute is False:
        word = "auto" if recompute else "never"
        warnings.warn(f"OutOfCore(recompute={recompute}) is deprecated: use recompute={word!r} "
                      "(the scheduler's words: 'auto', 'never', 'prefer')", DeprecationWarning, stacklevel=3)
        return word
    if recompute not in RECOMPUTE:
        raise OOCError(f"recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    return recompute
