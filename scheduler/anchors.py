"""A plan whose actions run only where the runtime can act without watching every op.

A step that runs each op through a dispatch mode can act between any two ops, at a cost per op
(on a CPU, Python's dispatch and the engine's bookkeeping: ~70 ms of a 0.6 s GPT 6x256 step).
A step watched only by autograd's saved-tensor hooks can act at those hooks alone: when an op
saves a tensor (forward) and when a backward node unpacks one. Those moments are *anchors*.

``anchor(schedule, gaps)`` moves each action of ``schedule`` to an anchor, in the direction
that keeps it safe:

- what brings a variable back (``swap_in``, ``wait_in``) moves *earlier*, to the last anchor
  at or before it: the bytes are there sooner, held longer;
- a ``wait_out`` moves *earlier* too: the write it waits for is over sooner, its bytes given
  back sooner (a wait that makes room for a large output must not slip past it);
- what lets a variable go after its uses (``swap_out``, ``drop``, ``free``) moves *later*, to
  the first anchor at or after it: never before a use;
- a variable's actions keep their order (a ``wait_out`` stays after its ``swap_out``), and
  none runs before ``first[v]``, the anchor where the runtime first sees the variable.

Holding bytes longer may take the step over its budget: ``scheduler.check`` on the result is
the proof, as for any plan. Recomputation cannot move (a chain is rerun from the ops' own
arguments, which only the per-op path sees): a schedule with ``recompute`` has no anchored form.

Gaps number the places between functions: gap ``g`` is after function ``g - 1`` and before
function ``g`` (gap 0 is the step's start, gap ``n`` its end; both are always anchors). An
action *before* function i sits in gap i, one *after* function i in gap i + 1. In the result,
every action sits before the function that follows its gap (after the last, for gap n).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Iterable, Mapping

from scheduler.actions import Op
from scheduler.schedule import Action, Schedule

__all__ = ["anchor", "EARLIER", "LATER"]

EARLIER = frozenset({Op.SWAP_IN, Op.WAIT_IN, Op.WAIT_OUT})   # wait sooner: move earlier
LATER = frozenset({Op.SWAP_OUT, Op.DROP, Op.FREE})           # let go after the uses: move later


def anchor(schedule: Schedule, gaps: Iterable[int], first: Mapping[int, int] | None = None) -> Schedule | None:
    """``schedule`` with every action moved to one of ``gaps`` (see the module docstring), or
    None when it recomputes or discards (no anchored form). Not checked: call ``check``."""
    n = len(schedule.sequence.functions)
    points = sorted({0, n, *(g for g in gaps if 0 <= g <= n)})
    first = first or {}
    moved: list[tuple[int, int, Action]] = []   # (gap, original order, action)
    last: dict[int, int] = {}                    # var -> gap of its latest action so far
    order = 0
    for i in range(n):
        for phase, g in ((schedule.before[i], i), (schedule.after[i], i + 1)):
            for a in phase:
                if a.op in EARLIER:
                    to = points[bisect_right(points, g) - 1]
                elif a.op in LATER:
                    to = points[bisect_left(points, g)]
                else:   # discard, recompute: only the per-op path can rerun a chain
                    return None
                to = max(to, last.get(a.var, 0), first.get(a.var, 0))
                last[a.var] = to
                moved.append((to, order, a))
                order += 1
    moved.sort(key=lambda m: (m[0], m[1]))
    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    for g, _, a in moved:
        (before[g] if g < n else after[n - 1]).append(a)
    return Schedule(schedule.sequence, schedule.budget, schedule.policy, schedule.window,
                    tuple(map(tuple, before)), tuple(map(tuple, after)), schedule.initial_resident)
