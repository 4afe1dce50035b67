"""Recomputation: which functions to rerun, in order, to re-create a variable before a use.

A variable the budget forces off the device can be swapped (its bytes go to the slower tier
and come back) or *discarded* and recomputed: before the function that needs it again, the
functions that wrote it run a second time, on inputs that are resident at that point. This
module finds that *chain* from the variable sequence alone; the transition table
(``scheduler.actions``, ``recompute``) checks it, ``simulate`` prices it, the planners choose
it and the runtime executes exactly ``Chain.functions``.

The chain of variable ``v`` needed again by function ``at`` is every function that wrote
``v`` before ``at``, in order: the one that created it, then each in-place update
(``relu_`` after a BatchNorm, ``add_`` of a residual), and before any of them the functions
it ``needs``: the producers of results the sequence has no variable for because nothing
saves them (the scores a softmax reads, the downsampled identity a residual ``add_`` reads),
so a replay must make them again (at most ``MAX_CHAIN`` functions). It is valid when

- ``v`` is created during the step and does not outlive it (not ``live_in``, not
  ``live_out``): its bytes come from the step's own functions;
- every function of the chain is ``replayable`` (the recorder's verdict: no side effects; a
  random op only with its generator state captured, ``rng``; BatchNorm in training mode is
  replayed without updating its running statistics, ``updates_stats``);
- a chain function writes nothing but ``v`` and the variables it creates itself (an
  in-place update of any other input would be applied twice);
- every *input* of the chain (a variable a chain function reads that is neither ``v`` nor
  created inside the chain) still holds the bytes it held when the function first ran (no
  write between that function and ``at``) and is still alive at ``at`` (used at or after
  ``at``, or ``live_out``): the replay then reads exactly what the first run read.

The other variables the chain's functions create (BatchNorm's saved mean and inverse std,
say) are *temporaries* of the replay: allocated while it runs, freed as soon as the chain no
longer reads them. ``Chain.temporaries_bytes`` is their peak, what ``check`` adds to the
device bytes while the chain runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from scheduler.ir import Access, Function, Kind, VariableSequence

__all__ = ["MAX_CHAIN", "Chain", "chain_for", "chain_inputs", "chain_through", "mark_replayable",
           "recompute_candidates", "temporaries_bytes"]

#: The most functions one chain reruns (``Function.needs`` can reach back several ops).
MAX_CHAIN = 32


@dataclass(frozen=True, slots=True)
class Chain:
    """How to re-create ``var`` right before function ``at``: rerun ``functions`` in order,
    with every variable of ``inputs`` resident; ``temporaries_bytes`` more device bytes at the
    replay's peak (besides ``var`` itself)."""

    var: int
    at: int
    functions: tuple[int, ...]
    inputs: tuple[int, ...]
    temporaries_bytes: int


def chain_for(seq: VariableSequence, v: int, at: int) -> Chain | None:
    """The chain that re-creates ``v`` before function ``at``, or None if there is none
    (the rules are the module's docstring). Cached per sequence: planners ask often."""
    cache = _cache(seq)
    key = (v, at)
    if key not in cache:
        cache[key] = _chain(seq, v, at)
    return cache[key]


def chain_inputs(seq: VariableSequence, functions: tuple[int, ...]) -> tuple[int, ...]:
    """The variables ``functions`` (a chain, in order) read before any of them writes them:
    what must be there when the chain reruns, in first-read order (a ``Chain`` of
    ``chain_for`` has them as ``inputs``; this is for chains a plan names by their functions)."""
    made: set[int] = set()
    inputs: dict[int, None] = {}
    for w in functions:
        uses = seq.functions[w].uses
        inputs.update((u.var, None) for u in uses if u.access is Access.READ and u.var not in made)
        made.update(u.var for u in uses if u.access is Access.WRITE)
    return tuple(inputs)


def recompute_candidates(seq: VariableSequence) -> bool:
    """Whether any function of ``seq`` may be replayed at all (else plans only keep or swap)."""
    return any(f.replayable for f in seq.functions)


def mark_replayable(seq: VariableSequence, rule: Callable[[Function], dict[str, bool] | None]) -> VariableSequence:
    """A copy of ``seq`` with each function's replay flags set by ``rule(f)``: a dict of
    ``replayable``/``rng``/``updates_stats`` (missing keys False), or None to leave ``f``
    as it is. For tests and for recorders that classify ops by name."""
    import dataclasses

    fs = []
    for f in seq.functions:
        flags = rule(f)
        fs.append(f if flags is None else dataclasses.replace(
            f, replayable=bool(flags.get("replayable", False)), rng=bool(flags.get("rng", False)),
            updates_stats=bool(flags.get("updates_stats", False))))
    return VariableSequence(tuple(fs), dict(seq.variables), dict(seq.meta))


# -- finding a chain --------------------------------------------------------------------------

def _cache(seq: VariableSequence) -> dict:
    """The chains found in ``seq`` so far, kept on it as its other derived facts are
    (``working_sets.Prepared``): they go with it. A module-level cache keyed by its id kept the
    last 65 sequences alive, with their facts, after the engine that planned them had closed
    (a 2-layer GPT-2's engine left three of its six there that nothing else held). A chain holds
    no reference to its sequence, and a copy of the sequence (which copies its dict) has the
    same chains."""
    return seq.__dict__.setdefault("_chains", {})


def _chain(seq: VariableSequence, v: int, at: int) -> Chain | None:
    var = seq.variables[v]
    # Only an activation: what else a step makes and uses later, a gradient, the program holds
    # itself (``p.grad``), so discarding it frees nothing, and the replay makes a second copy
    if var.live_in or var.live_out or var.kind is not Kind.ACTIVATION:
        return None
    writes = tuple(w for w in seq.writers[v] if w < at)
    if not writes or seq.producer.get(v) != writes[0]:
        return None
    functions = _with_needs(seq, writes)
    if functions is None:
        return None
    made: set[int] = set()          # created inside the chain (besides v): temporaries
    inputs: dict[int, int] = {}     # input -> the first chain function that reads it
    producer = seq.producer
    for w in functions:
        f = seq.functions[w]
        if not f.replayable:
            return None
        for u in f.uses:
            x = u.var
            if x == v or x in made:
                continue
            if producer.get(x) == w:          # a fresh output of w: a temporary of the replay
                made.add(x)
            elif u.access is Access.WRITE:    # w updates another input in place
                return None
            else:
                inputs.setdefault(x, w)
    writers, last_use, variables = seq.writers, seq.last_use, seq.variables
    for x, w in inputs.items():
        if any(w < k < at for k in writers[x]):
            return None                        # x changed since the chain first read it
        if not variables[x].live_out and last_use.get(x, -1) < at:
            return None                        # x is gone by then
    return Chain(var=v, at=at, functions=functions, inputs=tuple(inputs),
                 temporaries_bytes=_temporaries_peak(seq, v, functions, made))


def chain_through(seq: VariableSequence, chain: Chain, absent: Callable[[int], bool]) -> Chain | None:
    """``chain`` with each of its inputs that is ``absent`` at ``chain.at`` (discarded by the
    plan, to be recomputed later for its own use) made again inside it: that input's own chain
    (``chain_for`` at the same function) runs first, the input is one more temporary of the
    replay, and so on through the inputs that chain needs in turn. None if such an input has
    no chain there, or past ``MAX_CHAIN`` functions. ResNet's ReLU outputs come back through
    the 1x1 convolution and BatchNorm that made them when the convolution's output was
    discarded too; a bottleneck's last output through its whole block."""
    gone = [x for x in chain.inputs if absent(x)]
    if not gone:
        return chain
    functions, inputs = set(chain.functions), [x for x in chain.inputs if x not in gone]
    todo, seen = list(gone), set(gone)
    while todo:
        inner = chain_for(seq, todo.pop(), chain.at)
        if inner is None:
            return None
        functions.update(inner.functions)
        if len(functions) > MAX_CHAIN:
            return None
        for y in inner.inputs:
            if absent(y):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
            elif y not in inputs:
                inputs.append(y)
    ordered = tuple(sorted(functions))
    made = _made(seq, chain.var, ordered)
    return Chain(var=chain.var, at=chain.at, functions=ordered, inputs=tuple(x for x in inputs if x not in made),
                 temporaries_bytes=_temporaries_peak(seq, chain.var, ordered, made))


def temporaries_bytes(seq: VariableSequence, v: int, functions: tuple[int, ...]) -> int:
    """The peak bytes of the temporaries of a replay of ``functions`` that makes ``v`` again
    (``Chain.temporaries_bytes``): what the runtime may hold beside ``v`` while it runs."""
    return _temporaries_peak(seq, v, functions, _made(seq, v, functions))


def _made(seq: VariableSequence, v: int, functions: tuple[int, ...]) -> set[int]:
    """The variables ``functions`` create besides ``v``: the replay's temporaries."""
    return {x for w in functions for x in seq.functions[w].var_ids if seq.producer.get(x) == w and x != v}


def _with_needs(seq: VariableSequence, writes: tuple[int, ...]) -> tuple[int, ...] | None:
    """``writes`` and, before each, the functions it ``needs`` (results the sequence has no
    variable for), theirs in turn, in step order; None past ``MAX_CHAIN`` functions (a
    replay that long costs more than any transfer it saves)."""
    chain: set[int] = set()
    todo = list(writes)
    functions = seq.functions
    while todo:
        w = todo.pop()
        if w in chain:
            continue
        chain.add(w)
        if len(chain) > MAX_CHAIN:
            return None
        todo.extend(k for k in functions[w].needs if k < w)
    return tuple(sorted(chain))


def _temporaries_peak(seq: VariableSequence, v: int, functions: tuple[int, ...], made: set[int]) -> int:
    """Peak bytes of the chain's temporaries: each lives from the chain function that creates
    it to the last chain function that reads it."""
    last_read: dict[int, int] = {}
    for pos, w in enumerate(functions):
        for x in seq.functions[w].var_ids:
            if x in made:
                last_read[x] = pos
    nbytes = seq.variables
    live = peak = 0
    born: set[int] = set()
    for pos, w in enumerate(functions):
        for x in seq.functions[w].var_ids:
            if x in made and x not in born:
                born.add(x)
                live += nbytes[x].nbytes
        peak = max(peak, live)
        for x in [x for x in born if last_read[x] == pos]:
            live -= nbytes[x].nbytes
            born.discard(x)
            last_read[x] = -1
    return peak
