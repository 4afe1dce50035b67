"""Plans for steps whose activations' sizes depend on the data: each activation planned at
the largest size its op has made.

Why: a detection model's region heads (torchvision's Faster R-CNN, Mask R-CNN), a
mixture-of-experts layer's tokens per expert, ``nonzero`` and ``masked_select`` make tensors
whose sizes change from step to step with the data and the weights, though every step runs
the same ops. A plan made from one step holds each activation's bytes as that step made them;
a step whose op makes more leaves the plan there and is planned from again. Planned from each
step's own sizes, Faster R-CNN left its plan on 14 of 16 steps (each finished on demand, at
1.7-2.3x in core's time on a 2-core CPU), a loss over the tokens a mask keeps on 22 of 24:
the next step was as likely larger somewhere as not. Planned from the largest size each op
made so far, a plan's sizes only grow, toward the bound the model has (the proposals it
samples per image), and steps stop leaving it (sizes that drift upward, a router sending
more and more tokens to one expert, get twice the headroom each time they outgrow it again:
the steps that leave the plan grow as the logarithm of the drift); a step that makes less
runs in the plan's larger room (the runtime binds an activation no larger than its
variable). Where the larger sizes do not fit the budget, the step's own sizes are planned
(marked all the same): a budget the engine accepted never fails later for room a step does
not need.

Such a plan (``sizes_vary``) takes the hook-driven forms with each save checked against the
most its place may hold, not the bytes one step saved (``HookTrace.bounded``): plain where it
moves nothing, anchored swapping only where it swaps (a chain's template holds one step's
shapes).

A step's activations are matched with the plan it left by where they were born (op and
output), and only where both ran the same ops and their first activations were the same size:
a step that took another branch, or whose batch was of another shape (a larger batch through
``model.forward``, which shows the engine no shape: ``docs/guide/steps.md``), is planned from
as it ran, and that plan stays exact (``Binding.bind``: a smaller batch leaves it too, and gets
its own, with its hook-driven form).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from scheduler.beside import HELD_BESIDE
from scheduler.ir import Kind, VariableSequence
from scheduler.schedule import Schedule

HEADROOM = 8   # an activation that outgrew its plan is planned an eighth larger than it grew to,
               # twice that each time it outgrows its room again (at most its size again)
SIZES_VARY = "sizes_vary"   # a sequence's meta: its activations' sizes changed between steps
GROWN = "grown"   # its meta: "op.output" -> how many times the activation born there outgrew its room


def widened(seq: VariableSequence, born_at: Mapping[int, tuple[int, int]], left: Schedule,
            binding: Mapping[tuple[int, int], int], differed: bool = False) -> VariableSequence:
    """``seq``, a step that left plan ``left`` (``born_at``: op and output where each of its
    variables was born; ``binding``: the same for ``left``'s), with each activation as large
    as the one born at the same place in ``left`` where that is larger, and marked
    ``SIZES_VARY`` if any differed, or if the step is known to differ from ``left`` in sizes
    its whole chunks may not show (``differed``: a hook-driven step left it for a saved
    tensor's bytes, which those forms compare exactly; a step of another shape, whose inputs
    differ, that guessed it and recorded, or left it where its forward began); ``seq`` itself
    where the two ran other ops or their first activations differ."""
    old = left.sequence
    if len(old.functions) != len(seq.functions) or any(
            a.name != b.name for a, b in zip(old.functions, seq.functions)):
        return seq
    chunk = seq.meta.get("chunk") or 1
    variables, vary, first = dict(seq.variables), sizes_vary(old) or differed, True
    grown = dict(old.meta.get(GROWN) or {})
    for var, where in sorted(born_at.items(), key=lambda item: item[1]):
        v, was = variables.get(var), binding.get(where)
        w = None if was is None else old.variables.get(was)
        if v is None or w is None or v.kind is not Kind.ACTIVATION or w.kind is not Kind.ACTIVATION:
            continue
        differs = -(-v.nbytes // chunk) * chunk != w.nbytes
        if first and differs:   # from its first activation on: another shape, not the data's doing
            return seq
        first, vary = False, vary or differs
        if w.nbytes >= v.nbytes:
            nbytes = w.nbytes
        else:   # outgrew its room: an eighth more, doubled each time it outgrows it again
            key = f"{where[0]}.{where[1]}"
            grown[key] = times = grown.get(key, 0) + 1
            nbytes = v.nbytes + v.nbytes * min(2 ** (times - 1), HEADROOM) // HEADROOM
        if nbytes != v.nbytes:
            variables[var] = dataclasses.replace(v, nbytes=nbytes)
    if not vary:
        return seq
    return marked(dataclasses.replace(seq, variables=variables, meta={**seq.meta, GROWN: grown}))


def marked(seq: VariableSequence) -> VariableSequence:
    """``seq`` marked ``SIZES_VARY``: planned widened where the budget allows, else at its
    own sizes (a plan must never fail where the step's own sizes fit: the budget was accepted).
    What one step held beside its managed tensors (``HELD_BESIDE``) goes: at other sizes the
    step holds other bytes, so such a plan takes the flat share of a step's budget."""
    meta = {k: v for k, v in seq.meta.items() if k != HELD_BESIDE}
    return dataclasses.replace(seq, meta={**meta, SIZES_VARY: True})


def sizes_vary(seq: VariableSequence) -> bool:
    """Whether ``seq`` was widened: its activations' sizes change from step to step."""
    return bool(seq.meta.get(SIZES_VARY))
