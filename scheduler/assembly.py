"""The window planner's last step: the action lists around each function, in the order the
executor runs them.

Phase 1 of ``scheduler.window`` decides what leaves the device and when its bytes come back;
step (a) (``scheduler.prefetch``) decides how early each swap-in is issued. The order within
one function's list matters to ``check`` and to the executor: a swap-out's bytes must be
returned (wait_out) before a swap-in may use them, and a function's own inputs are waited
for (wait_in) last, so that the prefetches for later functions are already on the way.
"""

from __future__ import annotations

from typing import Sequence

from scheduler.ir import VariableSequence
from scheduler.replay import Chain
from scheduler.schedule import Action, Op, Schedule

__all__ = ["assemble_window"]


def assemble_window(seq: VariableSequence, budget: int, window: int, waits: Sequence[list[int]],
                    demand: Sequence[list[tuple[int, bool]]], prefetch: Sequence[list[int]],
                    regen: Sequence[list[Chain]], after: list[list[Action]],
                    initial_resident: frozenset[int], beside: tuple[int, ...] = ()) -> Schedule:
    """Before f_i: (b) wait for swap-outs, then the swap-ins (demanded by f_i and not hoisted,
    then prefetched for later functions), then wait_in for f_i's own, then the recomputes
    f_i needs. The end of the step (index ``n`` of ``waits`` and ``demand``) goes after the
    last function. ``demand[i]`` holds (var, hoisted) as step (a) rewrote it."""
    n = len(seq.functions)
    before: list[tuple[Action, ...]] = []
    for i in range(n):
        acts = [Action(Op.WAIT_OUT, v) for v in waits[i]]
        acts += [Action(Op.SWAP_IN, v) for v, hoisted in demand[i] if not hoisted]
        acts += [Action(Op.SWAP_IN, v) for v in prefetch[i]]
        acts += [Action(Op.WAIT_IN, v) for v, _ in demand[i]]
        acts += [Action(Op.RECOMPUTE, c.var, c.functions) for c in regen[i]]
        before.append(tuple(acts))
    end = [Action(Op.WAIT_OUT, v) for v in waits[n]]
    end += [Action(Op.SWAP_IN, v) for v, hoisted in demand[n] if not hoisted]
    end += [Action(Op.WAIT_IN, v) for v, _ in demand[n]]
    after[n - 1].extend(end)
    return Schedule(sequence=seq, budget=budget, policy="window", window=window,
                    before=tuple(before), after=tuple(map(tuple, after)),
                    initial_resident=initial_resident, beside=beside)
