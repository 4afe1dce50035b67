"""A plan bounded by the device's whole peak: the budget less what the step holds beside it.

Why: a budget bounds the bytes ooc manages, and beside them PyTorch holds what it does not
manage (weights, the backward's gradients of activations, its temporaries), which peak where
they peak. A flat budget must leave room for that peak at every function, so where PyTorch
holds little (the forward, most of the backward) the plan moves or recomputes what the device
had room for. Bounding the plan at each function by the device less what PyTorch holds there
(``beside``) spends the room where it is free. On the H200 profile of ResNet-50 b256 the
flat budgets' device peak is not even monotone in the budget (``scheduler.device_fit``);
this one is at most the device by construction, as modelled by ``scheduler.arenas``.

The window planner takes ``beside`` (``plan(..., beside=...)``); ``check`` proves the plan
within ``budget - beside[i]`` before, during and after each function ``i``. The engine, given a
budget for the whole step with one arena (``Options(budget_covers="step")``), records what the
step held beside its managed tensors in the recording's meta (``HELD_BESIDE``) and plans so.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.errors import BudgetTooSmall
from scheduler.ir import VariableSequence

__all__ = ["HELD_BESIDE", "held_beside_of", "limits", "require_fit", "unmanaged_across", "unmanaged_bytes"]

#: A recording's meta: per function, the bytes its step held beside the managed tensors
#: (``scheduler.whole_step.held_beside``), where the engine plans them bounded by a step budget.
HELD_BESIDE = "held_beside"


def held_beside_of(seq: VariableSequence) -> tuple[int, ...]:
    """``seq``'s ``HELD_BESIDE`` where it has one per function, else ``()`` (plan flat)."""
    held = seq.meta.get(HELD_BESIDE) or ()
    return tuple(held) if len(held) == len(seq.functions) else ()


def limits(budget: int, beside: Sequence[int], n: int) -> list[int]:
    """The most a plan of ``n`` functions may hold at each: ``budget`` less ``beside`` (empty:
    flat)."""
    if not beside:
        return [budget] * n
    if len(beside) != n or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in beside):
        raise ValueError(f"beside must be {n} byte counts >= 0, one per function, got {len(beside)}")
    return [budget - b for b in beside]


def require_fit(seq: VariableSequence, budget: int, beside: Sequence[int], sizes: Sequence[int]) -> None:
    """``BudgetTooSmall`` at the first function whose working set ``sizes[i]`` and ``beside[i]``
    exceed ``budget``; its ``minimum`` is the budget at which every function's do."""
    if not beside:
        return
    need = [s + b for s, b in zip(sizes, beside)]
    if max(need, default=0) > budget:
        i = next(k for k, b in enumerate(need) if b > budget)
        raise BudgetTooSmall(function=i, name=seq.functions[i].name, working_set=need[i],
                             budget=budget, minimum=max(need))


def unmanaged_bytes(full: VariableSequence, planned: VariableSequence) -> list[int]:
    """Bytes of ``full``'s variables that ``planned`` (a managed view of it) does not hold,
    live while each of its functions runs (what it makes and what it reads last included, and
    what the program held past its last use: ``Variable.held_to``), and one more: at the end
    of the step."""
    return _live(full, planned, across=False)


def unmanaged_across(full: VariableSequence, planned: VariableSequence) -> list[int]:
    """The same, between functions: at gap ``g`` (before function ``g``, after ``g - 1``) what
    was made before it and is read after it, ``n + 1`` gaps. No more than either function's
    ``unmanaged_bytes``: the plan's actions around a function run in its gaps."""
    return _live(full, planned, across=True)


def _live(full: VariableSequence, planned: VariableSequence, across: bool) -> list[int]:
    n = len(full.functions)
    first, last = full.first_use, full.last_use
    other = [0] * (n + 2)   # a difference array over each one's life
    for v, var in full.variables.items():
        if v in planned.variables or v not in first:
            continue
        other[0 if var.live_in else first[v] + across] += var.nbytes
        end = n if var.live_out else max(last[v], -1 if var.held_to is None else min(var.held_to, n - 1))
        other[end + 1] -= var.nbytes   # (held past its last use: Variable.held_to)
    running, out = 0, []
    for i in range(n + 1):
        running += other[i]
        out.append(running)
    return out
