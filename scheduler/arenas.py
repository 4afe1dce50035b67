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

:func:`device_peaks` replays the plan through the transition table (``scheduler.actions``),
at the points ``check`` counts (after each action, while each function runs, with a
recompute's temporaries while its chain runs), and puts each allocation in its arena: a
managed activation while it is born or recomputed, in PyTorch's; from its swap-in to its
free, in the pool; what the plan does not manage (the variables of ``full`` that are not in
the plan's sequence), in PyTorch's from its first use to its last (while a function runs,
what it makes and what it reads last; between functions, what lives across). One arena's
peak is the most of the sum at one point: until 2026-11-29 it added each arena's most within
a function, which at points apart put a GPT-2 plan 0.3 GiB over its true sum, and it missed
a function with no action of the plan, where PyTorch's bytes may peak. Bytes only: no
allocator's rounding, no cached blocks, no workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.actions import Ledger, Op
from scheduler.beside import unmanaged_across, unmanaged_bytes
from scheduler.ir import VariableSequence
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
    during, across = unmanaged_bytes(full, schedule.sequence), unmanaged_across(full, schedule.sequence)
    ledger = Ledger(schedule.sequence, schedule.initial_resident)
    nbytes, in_pool = ledger.nbytes, {}   # in_pool: var -> whether its bytes are the pool's
    t_now, p_now = sum(nbytes[v] for v in schedule.initial_resident), 0
    t_peak = p_peak = one = 0

    def note(beside: int, transient: int = 0) -> None:   # one point, with PyTorch's bytes there
        nonlocal t_peak, p_peak, one
        t_peak, p_peak = max(t_peak, t_now + transient + beside), max(p_peak, p_now)
        one = max(one, t_now + p_now + transient + beside)

    note(across[0])
    for i in range(n):
        for phase, acts, gap in (("before", schedule.before[i], i), ("after", schedule.after[i], i + 1)):
            for a in acts:
                eff = ledger.apply(a.op, a.var, i, phase, a.chain)
                nb = nbytes[a.var]
                if eff.device > 0:
                    in_pool[a.var] = a.op is Op.SWAP_IN
                    t_now, p_now = (t_now, p_now + nb) if in_pool[a.var] else (t_now + nb, p_now)
                elif eff.device < 0:
                    t_now, p_now = (t_now, p_now - nb) if in_pool.pop(a.var, False) else (t_now - nb, p_now)
                note(across[gap], ledger.chain.temporaries_bytes if eff.needs_chain else 0)
            if phase == "before":   # the function runs: what it creates is born in PyTorch's arena
                t_now += sum(nbytes[v] for v in ledger.run(i))
                note(during[i])
    return DevicePeaks(t_peak, p_peak, t_peak + p_peak, one)

