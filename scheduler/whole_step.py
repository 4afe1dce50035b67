"""A budget for the whole step: the managed budget that leaves room for everything else.

Why: a budget bounds the tensors ooc manages, and beside them the step holds what it does not
manage (weights, gradients, optimizer state, the input, the backward's gradients of
activations, tensors under ``min_bytes``), which peaks where it peaks. A user knows the device
(a 16 GiB GPU, a board with 2 GiB of RAM), not the managed share of it. So the engine records
the whole step once (``held_beside``: its bytes per op less the managed tensors) and gives
the managed tensors what is left of the step's budget where the step holds the most
(``managed_budget``).

Why a flat budget here: a step without a plan, or one that left its plan, may hold its managed
tensors anywhere under their budget at any op, so only a flat one bounds them wherever PyTorch's
bytes peak. A larger budget whose plan happened to avoid those places was tried (the fastest of
a grid of budgets whose plan's modelled peak with the held bytes fitted, as
``scheduler.device_fit`` does for ``ooc fit``): on ResNet-18 at batch 32 on this CPU, at a 500
MiB step budget, it kept 256 MiB for the managed tensors, modelled a 402 MiB peak, and the
process's peak rose 535 MiB once the plan was priced again; in another run no budget of the
grid fitted. A plan itself, with one arena, is bounded op by op instead (``scheduler.beside``:
the budget less ``held_beside`` at each function, which ``check`` proves and every re-priced
or anchored form of it keeps), and its replays fit the flat share, so that a step that leaves
it can rerun them (docs/guide/budgets.md, "A budget for the whole step").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from scheduler.errors import BudgetTooSmall
from scheduler.ir import Kind, Variable, VariableSequence
from scheduler.step_plans import round_activations
from scheduler.working_sets import working_sets
from vmm.units import format_size

__all__ = ["held_beside", "least_budget", "managed_budget"]


def held_beside(whole: VariableSequence, managed: VariableSequence, skipped: Sequence[int] = (),
                size: Callable[[int], int] = lambda nbytes: nbytes, read_later: Sequence[int] = (),
                min_bytes: int = 0, kinds: frozenset[Kind] | None = None) -> tuple[int, ...]:
    """Bytes the step holds beside its managed tensors during each of ``managed``'s functions:
    what the whole recording has live there, less the managed tensors (both at eager
    lifetimes, ``VariableSequence.live_bytes``, and what the program held past its last use
    that is not managed, of a kind not managed (``kinds``; None: those ``managed`` has) or
    under ``min_bytes``: ``Variable.held_to``),
    where what the step makes and leaves (the
    optimizer's state on its first step, gradients kept for accumulation) counts from the start
    too: the next step begins with it. ``skipped``: indices of ``managed``'s
    functions the whole recording leaves out (``OpInfo.skip``: profiler markers,
    ``lift_fresh``), which hold what the function before them held. ``size``: what a tensor
    of so many bytes takes (the CPU allocator's blocks: ``ooc.host.cpu_allocator.block_bytes``).
    ``read_later``: variables of a step recorded so far that what follows reads (the gradients
    its update reads), live to its end."""
    early = _outliving(whole, size)
    outliving = itertools.accumulate(_outliving(managed, size, (Kind.PARAM, Kind.OPTIMIZER_STATE)))
    mine = [live + e for live, e in zip(managed.live_bytes_sized(size), outliving)]
    # held past their last use (a Python name, a gradient until zero_grad: Variable.held_to),
    # if the engine does not manage them (a managed one's bytes go when ooc lets them go)
    kinds = {v.kind for v in managed.variables.values()} if kinds is None else kinds

    def unmanaged(var: Variable) -> bool:
        return var.kind not in kinds or var.nbytes < min_bytes

    held = whole.held_after_use_sized(size, unmanaged)
    for v in read_later:   # after its last use so far (and its hold, counted above), until the end
        var = whole.variables[v]
        if not var.live_out and v in whole.last_use:
            held_to = var.held_to if var.held_to is not None and unmanaged(var) else -1
            early[max(whole.last_use[v], min(held_to, len(whole.functions) - 1)) + 1] += size(var.nbytes)
            early[len(whole.functions)] -= size(var.nbytes)
    total = [live + e + h for live, e, h in zip(whole.live_bytes_sized(size), itertools.accumulate(early), held)]
    skip = set(skipped)
    if len(managed.functions) - len(skip) != len(total):
        raise ValueError(f"the whole recording has {len(total)} functions, the managed one "
                         f"{len(managed.functions)} with {len(skip)} left out: not the same step")
    out, j = [], 0
    for i in range(len(mine)):
        k = max(j - 1, 0) if i in skip else j
        j += i not in skip
        out.append(max(0, (total[k] if total else 0) - mine[i]))
    return tuple(out)


def _outliving(seq: VariableSequence, size: Callable[[int], int],
               kinds: tuple[Kind, ...] | None = None) -> list[int]:
    """Per function (a difference array, one longer), the bytes of what ``seq``'s step makes
    and leaves (of ``kinds``; None: any) before its first use: the next step starts with it. In
    the managed recording too, of the kinds the whole one leaves to the next step (parameters,
    optimizer state; gradients it does not mark): counted in the whole only, the optimizer
    state a first update makes with every kind managed (Adam's: twice the weights) was counted
    beside the managed tensors as well as among them, and the step budget named was that much
    too large."""
    early = [0] * (len(seq.functions) + 1)
    for v, var in seq.variables.items():
        if var.live_out and not var.live_in and seq.first_use.get(v) and (kinds is None or var.kind in kinds):
            early[0] += size(var.nbytes)
            early[seq.first_use[v]] -= size(var.nbytes)
    return early


def share_beside(budget: int, held: int, *, reserve: Callable[[int], int] = lambda budget: 0, arenas: int = 1,
                 granule: int = 2 << 20) -> int:
    """What a step ``budget`` leaves the managed tensors beside ``held`` bytes: less
    ``reserve(budget)``, shared by ``arenas``, in whole ``granule``s (never less for a larger
    budget, which ``least_budget`` needs)."""
    return (budget - reserve(budget) - held) // arenas // granule * granule


def managed_budget(managed: VariableSequence, held: Sequence[int], budget: int, *,
                   reserve: Callable[[int], int] = lambda budget: 0, arenas: int = 1,
                   granule: int = 2 << 20, kept: Callable[[int], str] = lambda budget: "") -> int:
    """The managed budget for a step ``budget``: what is left of it, less ``reserve(budget)``
    (bytes the device keeps beside any plan: the CPU allocator's cache), where the step holds the
    most beside its managed tensors (``held``: per function, and one more for an update measured
    before it ran, ``ooc.engine.step_budget.Update``), shared by ``arenas`` (2: ooc's pool beside
    PyTorch's allocator, whose blocks the pool cannot reuse), in whole ``granule``s.
    ``kept(budget)`` says what the reserve is made of, for the refusal's note.
    ``BudgetTooSmall`` where that is under the step's largest working set: it names the
    function where the step holds the most, and the step budget that leaves that working set.
    Both as the planner counts them: each activation in whole ``granule``s (the pool's chunks,
    ``round_activations``); in its own bytes, two 4-byte activations of a tiny module peaked at
    8 B, and the plan, which needs two 4 KiB chunks, was refused at every step budget.

    Not capped at this step's in-core peak: the share is what the budget leaves, which a step
    that needs less does not fill (its plan moves nothing), and the engine plans every shape of
    the step at it. Capped, a batch of 458 after one of 928 (an epoch's last) set the share to
    its own peak, 2 MiB, and the next batch of 928 was refused under a 64 MiB step budget by a
    refusal that named 22 MiB as the least that works."""
    if not held:
        raise ValueError("no bytes per function: record the step whole first")
    managed = round_activations(managed, granule)
    most = max(held)

    def share(b: int) -> int:
        return share_beside(b, most, reserve=reserve, arenas=arenas, granule=granule)

    left, low = share(budget), max(max(working_sets(managed), default=0), granule)
    if left < low:
        i = held.index(most)
        minimum = least_budget(share, low, most + arenas * low, granule)
        name = managed.functions[i].name if i < len(managed.functions) else "the optimizer's update"
        err = BudgetTooSmall(function=i, name=name, working_set=most + low,
                             budget=budget, minimum=minimum)
        reserved, words = reserve(budget), kept(budget)
        err.add_note(f"ooc: the budget covers the whole step (Options(budget_covers='step')): beside its "
                     f"managed tensors the step holds up to {format_size(most)} there (weights, gradients, "
                     f"optimizer state, PyTorch's temporaries), and one function needs {format_size(low)} of "
                     f"managed tensors at once" + (" in each of two arenas" if arenas > 1 else "")
                     + (f"; {format_size(reserved)} is kept back"
                        + (f": {words}" if words else " (the CPU allocator's cache, the engine's records)")
                        if reserved else ""))
        try:
            raise err
        finally:   # the frame its traceback keeps must not hold it: a cycle, the caller's frames with it
            del err
    return left


def least_budget(share: Callable[[int], int], need: int, guess: int, granule: int) -> int:
    """The least budget, in whole ``granule``s and from ``guess`` on, whose ``share`` (what a
    budget leaves for the managed tensors: never less for a larger budget) is ``need``."""
    low = max(-(-guess // granule), 1)
    high = low
    while share(high * granule) < need:   # a reserve that grows with the budget: double until it holds
        low, high = high + 1, high * 2
    while low < high:
        mid = (low + high) // 2
        if share(mid * granule) >= need:
            high = mid
        else:
            low = mid + 1
    return high * granule
