"""What every window planner needs first: the working sets, the budget's floor, the window.

A function's *working set* is the bytes of its distinct variables: they must all be resident
while it runs, so no plan fits a budget below the largest one.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

from scheduler.errors import BudgetTooSmall
from scheduler.ir import Access, VariableSequence

if TYPE_CHECKING:
    from scheduler.replay import Chain

__all__ = ["INF", "Infeasible", "Prepared", "default_window", "replay_floor", "require_working_sets_fit",
           "working_sets"]

INF = float("inf")


def default_window(budget: int) -> int:
    """nnabla's default prefetch window: 1.5 x the budget ("according to ResNet50 experiment")."""
    return int(budget * 1.5)


def working_sets(seq: VariableSequence) -> list[int]:
    """Bytes each function needs resident at once (its distinct variables)."""
    nb = {v: var.nbytes for v, var in seq.variables.items()}
    return [sum(nb[v] for v in f.var_ids) for f in seq.functions]


def require_working_sets_fit(seq: VariableSequence, budget: int, sizes: list[int] | None = None) -> int:
    """Return the largest working set; raise ``BudgetTooSmall`` at the first function above ``budget``.

    No schedule can run a function whose own variables do not fit at once, so the largest
    working set is a lower bound on every policy's minimum budget (and the exact minimum of
    both window planners).
    """
    if sizes is None:
        sizes = working_sets(seq)
    largest = max(sizes, default=0)
    if largest > budget:
        i = next(k for k, b in enumerate(sizes) if b > budget)
        raise BudgetTooSmall(function=i, name=seq.functions[i].name, working_set=sizes[i],
                             budget=budget, minimum=largest)
    return largest


class Infeasible(Exception):
    """A planner could not place function ``index`` under the budget (internal signal)."""

    def __init__(self, index: int, needed: int) -> None:
        super().__init__(f"function {index} needs {needed} B")
        self.index = index
        self.needed = needed


class Prepared:
    """Per-sequence facts both passes of policy "window" share (computed once): each
    function's variables, writes and working set, and each use's next use (INF: none).
    ``Prepared.of(seq)`` keeps them on the sequence, as its own derived facts are kept: the
    default planner makes a dozen plans of one sequence, and preparing a 6,000-function step
    took ~30 ms each time. They go with it: a cache beside it kept the last 17 sequences,
    and their facts, alive after their engine had closed. (A 2-layer GPT-2's engine holds 6
    of them: 1.35 MiB with each function's writes as a set, 0.48 MiB as a tuple.)"""

    @classmethod
    def of(cls, seq: VariableSequence) -> "Prepared":
        prepared = seq.__dict__.get("_prepared")
        if prepared is None or prepared._seq() is not seq:   # (a copy of a sequence copies its dict)
            prepared = seq.__dict__["_prepared"] = cls(seq)
        return prepared

    @property
    def seq(self) -> VariableSequence:
        """The sequence prepared (held weakly: it holds this)."""
        seq = self._seq()
        assert seq is not None, "a Prepared outlived its sequence"
        return seq

    def __init__(self, seq: VariableSequence) -> None:
        self._seq = weakref.ref(seq)
        variables = seq.variables
        self.nbytes = {v: var.nbytes for v, var in variables.items()}
        self.live_in = {v for v, var in variables.items() if var.live_in}
        self.live_out = {v for v, var in variables.items() if var.live_out}
        self.ids = [f.var_ids for f in seq.functions]
        self.writes = [tuple({u.var for u in f.uses if u.access is Access.WRITE}) for f in seq.functions]
        nb = self.nbytes
        self.working_sets = [sum(nb[v] for v in ids) for ids in self.ids]
        # next_after[i][k]: the next function after i that uses ids[i][k] (INF if none).
        upcoming: dict[int, float] = {}
        next_after: list[tuple[float, ...]] = [()] * len(self.ids)
        for i in range(len(self.ids) - 1, -1, -1):
            ids = self.ids[i]
            next_after[i] = tuple(upcoming.get(v, INF) for v in ids)
            for v in ids:
                upcoming[v] = i
        self.next_after = next_after
        self.first_use = upcoming


def replay_floor(prep: Prepared, at: int, chains: "Sequence[Chain]") -> int:
    """Bytes that must be resident right before function ``at`` when ``chains``
    (``scheduler.replay.Chain``) are replayed there: ``at``'s own variables, each chain's
    variable and inputs, and the largest chain's temporaries. Nothing of it can be evicted
    then, so a chain that takes this above the budget can never run: the planner must swap
    that victim instead of committing, in the forward, to a replay the backward cannot hold
    (ResNet-50 at batch 1440: BatchNorm's backward holds 12.9 GiB of its 14.9, and a chain
    through two discarded 1 GiB tensors does not fit beside it)."""
    need = set(prep.ids[at])
    transient = 0
    for chain in chains:
        need.add(chain.var)
        need.update(chain.inputs)
        transient = max(transient, chain.temporaries_bytes)
    nbytes = prep.nbytes
    return sum(nbytes[x] for x in need) + transient
