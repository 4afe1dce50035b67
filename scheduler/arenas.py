"""Where a plan's bytes sit on a GPU, by allocator: the step's device peak, one arena or two.

On a GPU every tensor a step makes is born in PyTorch's caching allocator (activations,
the backward's gradients of activations and temporaries, weights, gradients, optimizer
state), while what ooc swaps back in comes from its own VMM pool (``Options(arena="pool")``,
the default) or from PyTorch's allocator too (``Options(arena="pytorch")``). With two arenas
the pool cannot reuse what PyTorch's allocator keeps from the forward, so the device needs
the *sum of the two peaks*; with one it needs the *peak of the sum*. The budget bounds only
the managed bytes, so neither is the budget. On the H100 (``benchmarks/results/gpu-memory.md``)
this model, for ResNet-50 and GPT-2 at half and a quarter of their in-core peaks, came within
3.0-3.7 GiB under the measured two-arena peaks (allocator rounding and caching, cuDNN's
workspaces, chunks the pool kept mapped, the first steps), and put one arena 2-3.5 GiB under
two at the same plan.

:func:`device_peaks` walks the plan's allocations (``scheduler.memory_events``) and puts each
in its arena: a managed activation while it is born or recomputed, in PyTorch's; from its
swap-in to its free, in the pool; what the plan does not manage (the variables of ``full``
that are not in the plan's sequence), in PyTorch's from its first use to its last. Bytes
only: no allocator's rounding, no cached blocks, no workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.actions import Op
from scheduler.ir import VariableSequence
from scheduler.memory_events import allocation_events
from scheduler.schedule import Schedule

__all__ = ["DevicePeaks", "device_peaks"]


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """Modelled peaks in bytes: PyTorch's allocator (``torch``), ooc's pool (``pool``), the
    device with both (``two_arenas``, their sum) and with one (``one_arena``)."""

    torch: int
    pool: int
    two_arenas: int
    one_arena: int

    def of(self, arena: str) -> int:
        """The device's peak where swap-ins live in ``arena``, as ``Options(arena=...)``:
        "pytorch" (one arena) or "pool" (ooc's pool beside PyTorch's allocator)."""
        return self.one_arena if arena == "pytorch" else self.two_arenas


def device_peaks(full: VariableSequence, schedule: Schedule) -> DevicePeaks:
    """The device's peaks for ``schedule``, a plan of ``full`` or of a managed view of it
    (``scheduler.managed.managed_view``: the same functions, a subset of its variables)."""
    n = len(full.functions)
    if len(schedule.sequence.functions) != n:
        raise ValueError(f"the plan has {len(schedule.sequence.functions)} functions, the step {n}: "
                         "plan the step itself or a managed view of it")
    torch_side, pool = [0] * (n + 1), [0] * (n + 1)
    swapped_in = [{a.var for acts in (schedule.before[i], schedule.after[i]) for a in acts
                   if a.op is Op.SWAP_IN} for i in range(n)]
    held: dict[int | str, tuple[bool, int]] = {}   # key -> (in the pool, bytes)
    t_now = p_now = 0
    for e in allocation_events(schedule):
        i = min(int(e.time), n)
        if e.action == "alloc":
            in_pool, nbytes = i < n and e.key in swapped_in[i], e.nbytes
            held[e.key] = (in_pool, nbytes)
        else:
            in_pool, nbytes = held.pop(e.key, (False, e.nbytes))
            nbytes = -nbytes
        if in_pool:
            p_now += nbytes
        else:
            t_now += nbytes
        torch_side[i], pool[i] = max(torch_side[i], t_now), max(pool[i], p_now)
    unmanaged = _unmanaged(full, schedule.sequence)
    t_peak = max(t + u for t, u in zip(torch_side, unmanaged))
    return DevicePeaks(t_peak, max(pool), t_peak + max(pool),
                       max(t + p + u for t, p, u in zip(torch_side, pool, unmanaged)))


def _unmanaged(full: VariableSequence, planned: VariableSequence) -> list[int]:
    """Bytes of ``full``'s variables the plan does not hold, live at each gap."""
    n = len(full.functions)
    first, last = full.first_use, full.last_use
    other = [0] * (n + 2)   # a difference array over each one's life
    for v, var in full.variables.items():
        if v in planned.variables or v not in first:
            continue
        other[0 if var.live_in else first[v]] += var.nbytes
        other[(n if var.live_out else last[v]) + 1] -= var.nbytes
    running, out = 0, []
    for i in range(n + 1):
        running += other[i]
        out.append(running)
    return out
