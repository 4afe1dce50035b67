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
the proof, as for any plan.

Recomputation moves only for a runtime that can rerun a chain at a hook (``recompute=True``:
chains rerun from templates, ``ooc/runtime/templates.py``): a ``discard`` moves *later* (the
bytes go after the uses, as a ``drop``, and after the saves its template reads), a
``recompute`` *earlier* (the bytes are back sooner), and not before the anchor where its
chain's inputs got their last action so far (a ``wait_in`` that brings one back). Without it
(today's per-op path reruns a chain from the ops' own arguments, which only it sees), a
schedule with ``discard`` or ``recompute`` has no anchored form.

Gaps number the places between functions: gap ``g`` is after function ``g - 1`` and before
function ``g`` (gap 0 is the step's start, gap ``n`` its end; both are always anchors). An
action *before* function i sits in gap i, one *after* function i in gap i + 1. In the result,
every action sits before the function that follows its gap (after the last, for gap n).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Iterable, Mapping

from scheduler.actions import Op
from scheduler.ir import Kind, VariableSequence
from scheduler.replay import chain_inputs
from scheduler.schedule import Action, Schedule

__all__ = ["anchor", "estimated_anchors", "EARLIER", "LATER"]

EARLIER = frozenset({Op.SWAP_IN, Op.WAIT_IN, Op.WAIT_OUT})   # wait sooner: move earlier
LATER = frozenset({Op.SWAP_OUT, Op.DROP, Op.FREE})           # let go after the uses: move later


def anchor(schedule: Schedule, gaps: Iterable[int], first: Mapping[int, int] | None = None, *,
           recompute: bool = False, ready: Mapping[int, int] | None = None) -> Schedule | None:
    """``schedule`` with every action moved to one of ``gaps`` (see the module docstring), or
    None when it recomputes or discards and ``recompute`` is False (no anchored form);
    ``ready``: function -> the gap from which the runtime holds what its template reads (a
    ``discard`` for a chain of it waits until then). Not checked: call ``check``."""
    n = len(schedule.sequence.functions)
    points = sorted({0, n, *(g for g in gaps if 0 <= g <= n)})
    first = first or {}
    earlier = EARLIER | {Op.RECOMPUTE} if recompute else EARLIER
    later = LATER | {Op.DISCARD} if recompute else LATER
    moved: list[tuple[int, int, Action]] = []   # (gap, original order, action)
    rebuilt: dict[int, list[tuple[int, tuple[int, ...]]]] = {}   # var -> (gap, chain) of its recomputes
    for i, actions in enumerate(schedule.before):
        for a in actions:
            if a.op is Op.RECOMPUTE:
                rebuilt.setdefault(a.var, []).append((i, a.chain))
    last: dict[int, int] = {}                    # var -> gap of its latest action so far
    order = 0
    for i in range(n):
        for phase, g in ((schedule.before[i], i), (schedule.after[i], i + 1)):
            for a in phase:
                if a.op in earlier:
                    to = points[bisect_right(points, g) - 1]
                elif a.op in later:
                    to = points[bisect_left(points, g)]
                else:   # discard, recompute: only the per-op path can rerun a chain
                    return None
                to = max(to, last.get(a.var, 0), first.get(a.var, 0))
                if a.op is Op.DISCARD and ready:   # after the template saw what it reads
                    chain = next((c for at, c in rebuilt.get(a.var, ()) if at >= g), ())
                    to = points[bisect_left(points, max([to, *(ready.get(w, 0) for w in chain)]))]
                if a.op is Op.RECOMPUTE:   # after what brought its inputs back
                    to = max([to, *(last.get(x, 0) for x in chain_inputs(schedule.sequence, a.chain))])
                last[a.var] = to
                moved.append((to, order, a))
                order += 1
    moved.sort(key=lambda m: (m[0], m[1]))
    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    for g, _, a in moved:
        (before[g] if g < n else after[n - 1]).append(a)
    return Schedule(schedule.sequence, schedule.budget, schedule.policy, schedule.window,
                    tuple(map(tuple, before)), tuple(map(tuple, after)), schedule.initial_resident, schedule.beside)


def estimated_anchors(seq: VariableSequence) -> tuple[set[int], dict[int, int]]:
    """Where a step's hooks would fire, for a sequence recorded without its hooks (a GPU
    profile; the engine has the real ones, ``HookTrace``): after each forward op that touches a
    managed activation (an op saves what it reads or makes), before each backward op that does
    (a node unpacks before it computes); and each activation's first such anchor. The backward
    starts at ``meta["backward_start"]`` (else nothing is backward)."""
    backward = int(seq.meta.get("backward_start", len(seq.functions)))
    acts = {v for v, x in seq.variables.items() if x.kind is Kind.ACTIVATION}
    gaps: set[int] = set()
    first: dict[int, int] = {}
    for f in seq.functions:
        touched = [u.var for u in f.uses if u.var in acts]
        if touched:
            g = f.index + 1 if f.index < backward else f.index
            gaps.add(g)
            for v in touched:
                first.setdefault(v, g)
    return gaps, first
