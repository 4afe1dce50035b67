"""The step as the engine plans it: only the variables it manages.

A trace (``ooc.trace``, a GPU profile) records every storage of a step: parameters, grads,
optimizer state, inputs, temporaries, activations of any size. The engine manages fewer: the
kinds the user named (activations by default), from ``min_bytes`` up (smaller tensors stay
with PyTorch, outside the budget), and activations take whole chunks of its pool. Planning a
trace as the engine would (to predict a GPU step from a profile on a machine without one, or
to size a budget as a fraction of the managed peak) needs that view. Pure data: no torch.

Replays follow the engine's rules (``ooc.record.managed``): a function that reads a storage
born in the step, big enough to be managed but never managed (a temporary nobody saved, such
as the scores a softmax reads), can be replayed only after the functions that wrote it, which
become its ``needs``; if one of those cannot be replayed, neither can it. Smaller storages
and the ones that live across steps are held by the replay as they are. Nothing from the
optimizer on is replayed.
"""

from __future__ import annotations

from scheduler.ir import Access, Function, Kind, Variable, VariableSequence

__all__ = ["MANAGE", "kinds_of", "managed_view"]

#: ``OutOfCore(manage=...)``'s words for the kinds of variable it may move.
MANAGE = {"activations": Kind.ACTIVATION, "params": Kind.PARAM, "grads": Kind.GRAD,
          "optimizer_state": Kind.OPTIMIZER_STATE}


def kinds_of(manage: "tuple[str, ...] | list[str]") -> frozenset[Kind]:
    """The kinds ``manage`` names (its words are ``MANAGE``'s keys)."""
    return frozenset(MANAGE[m] for m in manage)

#: BatchNorm's running statistics are buffers the engine never moves.
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def managed_view(seq: VariableSequence, kinds: frozenset[Kind] | set[Kind] = frozenset({Kind.ACTIVATION}),
                 *, min_bytes: int = 1 << 20, chunk: int = 2 << 20) -> VariableSequence:
    """``seq`` with only the variables of ``kinds`` of at least ``min_bytes`` (buffers never),
    each activation rounded up to whole ``chunk`` bytes; every function is kept (with its
    cost), using only the variables kept. Its ``in_core_peak_bytes`` is the managed peak."""
    keep = {}
    for v, var in seq.variables.items():
        if var.kind in kinds and var.nbytes >= min_bytes and not var.name.endswith(_BUFFERS):
            nbytes = -(-var.nbytes // chunk) * chunk if var.kind is Kind.ACTIVATION else var.nbytes
            keep[v] = Variable(v, nbytes, var.kind, var.name, var.live_in, var.live_out)
    update = int(seq.meta.get("optimizer_start", len(seq.functions)))
    replayable = [f.replayable and f.index < update for f in seq.functions]
    needs: list[list[int]] = [list(f.needs) for f in seq.functions]
    writers: dict[int, list[int]] = {}   # an anonymous birth -> the functions that wrote it so far
    for f in seq.functions:
        for u in f.uses:
            var = seq.variables[u.var]
            if u.var in keep or var.live_in or var.nbytes < min_bytes:
                continue
            made = writers.get(u.var)
            if made and f.index not in made:   # a read of a temporary made earlier in the step
                if all(replayable[k] for k in made):
                    needs[f.index] += made
                else:
                    replayable[f.index] = False
            if u.access is Access.WRITE:
                writers.setdefault(u.var, []).append(f.index)
    functions = tuple(
        Function(f.index, f.name, tuple(u for u in f.uses if u.var in keep), f.cost,
                 replayable=replayable[f.index], rng=f.rng and replayable[f.index],
                 updates_stats=f.updates_stats and replayable[f.index],
                 needs=tuple(dict.fromkeys(needs[f.index])) if replayable[f.index] else ())
        for f in seq.functions)
    return VariableSequence(functions, keep, dict(seq.meta))
