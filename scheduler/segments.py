"""Segment recompute: chains that share one replay, so each function reruns once per backward.

A chain that reads an input the plan discarded (``scheduler.replay``) has two ways to get it:

- *through* (``chain_through``): make the input again inside the chain, as a temporary freed
  when the chain ends. The input's own recompute, later, before its own next use, reruns the
  same functions again. In a ResNet bottleneck whose interior is discarded, the 3rd
  convolution's output is recomputed through the whole block, then the 2nd's through two
  thirds of it, and so on: on the H200 profile of ResNet-50 b256 at a quarter of the
  in-core peak, 12 ms of the 33 ms recomputed per step were functions run a second time.
- *shared* (this module): *move the input's own recompute earlier*, right before the chain
  that reads it, and keep its output resident from there to its own next use. Each function
  of the segment then runs once, in forward order, where the backward first needs any of
  its outputs: what ``torch.utils.checkpoint`` does with a block (it keeps the block's input
  and recomputes the interior once, holding the interior's outputs for the block's backward),
  but chosen per tensor, beside swapping, under the budget.

The plan stays what the runtime executes today (``ooc/runtime/recompute.py``): a
``recompute`` action per variable, each with its own ``chain_for`` chain on resident inputs,
the moved ones placed before the chains that read them, in the same action list. ``check``
proves it as any recompute (the chain ``chain_for`` finds for the variable's next use, its
inputs resident). What it costs is memory: the moved outputs are held from the earlier point
on; ``replay_floor`` must fit the budget there, else the planner falls back (through, or swap).
A plan bounded beside what the step holds (``scheduler.beside``) has more room at some
functions than at others; a replay must fit the least of them too, so that a step that
leaves its plan can still rerun it on demand, within the flat share the engine keeps for such
steps (a Llama whose update ran inside the backward left its plan there, and a replay of
three inputs took more than the share).
"""

from __future__ import annotations

from typing import Callable, Sequence

from scheduler.ir import VariableSequence
from scheduler.link_clock import LinkClock
from scheduler.replay import Chain
from scheduler.working_sets import INF, Prepared, replay_floor

__all__ = ["MAX_MOVES", "Replays", "moves_for"]

#: The most recomputes one chain moves (as ``MAX_CHAIN`` bounds a chain): in the Llama's
#: residual stream every discarded tensor reads the one before, and moving the whole history
#: before each new victim made planning quadratic (29,000 moves for 930 victims, a third of
#: the planning time); with 32 the profiles predict the same within 0.01x in-core.
MAX_MOVES = 32


def moves_for(seq: VariableSequence, chain: Chain, gone: Callable[[int], bool],
              pending: dict[int, Chain], room: int) -> list[Chain] | None:
    """The recomputes to move to ``chain.at`` (new chains, in the order they must run) so that
    every input of ``chain`` is resident there; None if some discarded input cannot be moved,
    or the moved variables alone would take more than ``room`` bytes, or more than
    ``MAX_MOVES`` would move.

    ``gone(x)``: x is discarded at the planning point; ``pending[x]``: x's recompute as
    planned now. An input whose recompute already runs at or before ``chain.at`` needs no move
    (it is resident by then: the planner pins a chain's inputs); one that runs later is moved,
    and first the discarded inputs of its own chain, in turn. A moved chain reruns the same
    functions on the same inputs: earlier, every input is still alive and unchanged (it was
    at the later point) as long as nothing wrote the variable in between.
    """
    at = chain.at
    moved: list[Chain] = []
    seen: set[int] = set()
    variables, writers = seq.variables, seq.writers
    left = [room]

    def move(x: int) -> bool:
        if x in seen:
            return True
        seen.add(x)
        c = pending.get(x)
        if c is None:
            return False          # discarded with no recompute planned: nothing brings it back
        if c.at <= at:
            return True           # recomputed by then, and pinned until this chain has run
        left[0] -= variables[x].nbytes
        if left[0] < 0 or writers[x][-1] >= at or len(seen) > MAX_MOVES:
            return False
        if not all(move(y) for y in c.inputs if gone(y)):
            return False
        moved.append(Chain(x, at, c.functions, c.inputs, c.temporaries_bytes))   # after its inputs
        return True

    return moved if all(move(x) for x in chain.inputs if gone(x)) else None


class Replays:
    """The window planner's recomputes as planned so far: the chains to rerun before each
    function (``regen``), each discarded variable's pending recompute, and for each variable
    the pending recomputes that read it (it is *pinned*: never discarded, except where
    replays are shared and its own recompute can run before the first of them)."""

    def __init__(self, prep: Prepared, cap: Sequence[int], rule: "Callable[..., Chain | None] | None") -> None:
        self.prep, self.seq, self.cap, self.rule = prep, prep.seq, cap, rule   # cap: the budget at each function
        self.floor = min(cap, default=0)   # what a replay must fit wherever it runs (the module docstring)
        self.regen: list[list[Chain]] = [[] for _ in prep.ids]
        self.pending: dict[int, Chain] = {}
        self.readers: dict[int, set[int]] = {}
        self.shared = bool(getattr(rule, "shared", False))
        hw = getattr(rule, "link", None)   # the rule prices swaps on the link's queue
        self.clock = LinkClock(self.seq, hw) if hw is not None else None

    def pinned(self, v: int) -> bool:
        """Whether a recompute still to run reads ``v``."""
        return bool(self.readers.get(v))

    def instead(self, v: int, nxt: float, gone: Callable[[int], bool], last: int = -1,
                i: int = -1) -> list[Chain] | None:
        """The chains to discard victim ``v`` with (evicted before f_``i``, last used by
        f_``last``): its own chain, to rerun before its next use ``nxt``, when the rule
        prefers it to a swap, after the recomputes of its discarded inputs moved there where
        replays are shared; else through them (the rule's ``through``); else None. Never one
        its use cannot hold beside it (``replay_floor``)."""
        rule = self.rule
        if rule is None or nxt == INF:
            return None
        at, pinned = int(nxt), self.pinned(v)
        if pinned:
            if not self.shared:
                return None
            at = min(at, min(self.pending[r].at for r in self.readers[v]))
        if self.clock is not None and i >= 0:   # what waiting for the swap-out would cost now
            priced, stall = rule, self.clock.stall_s(self.prep.nbytes[v], last, i)
            rule = lambda *a: priced(*a, stall_s=stall)   # noqa: E731
        chains = None
        if self.shared and (chain := rule(v, at)) is not None:
            moved = moves_for(self.seq, chain, gone, self.pending, self.cap[at] - self.prep.working_sets[at])
            chains = None if moved is None else moved + [chain]
            if chains is not None and pinned and not self._ahead(v, chains, at, gone):
                chains = None
        if chains is None and not pinned:
            through = (gone,) if getattr(self.rule, "through", False) else ()
            chain = rule(v, at, *through)
            if chain is None or any(gone(x) for x in chain.inputs):
                return None
            chains = [chain]
        if chains is None or replay_floor(self.prep, at, self.regen[at] + chains) > min(self.cap[at], self.floor):
            return None
        return chains

    def commit(self, chains: list[Chain]) -> None:
        """Plan ``chains`` (``instead``'s answer): the moved ones leave their old place, all go
        before the first chain there that reads one of them, their inputs pinned."""
        for chain in chains[:-1]:
            old = self.pending[chain.var]
            self.regen[old.at].remove(old)
            self._unpin(old)
        there = self.regen[chains[-1].at]
        made = {c.var for c in chains}
        pos = next((k for k, c in enumerate(there) if made.intersection(c.inputs)), len(there))
        there[pos:pos] = chains
        for chain in chains:
            self.pending[chain.var] = chain
            for x in chain.inputs:
                self.readers.setdefault(x, set()).add(chain.var)

    def ran(self, chain: Chain) -> None:
        """``chain`` ran: its variable is resident, its inputs free to go."""
        del self.pending[chain.var]
        self._unpin(chain)

    def _unpin(self, chain: Chain) -> None:
        for x in chain.inputs:
            self.readers[x].discard(chain.var)

    def _ahead(self, v: int, chains: list[Chain], at: int, gone: Callable[[int], bool]) -> bool:
        """Whether the recomputes ``chains`` read that already run before ``at`` come before the
        first chain there that reads ``v`` (where ``chains`` go)."""
        there = self.regen[at]
        pos = next((k for k, c in enumerate(there) if v in c.inputs), len(there))
        early = {c.var for c in there[:pos]}
        return all(x in early for c in chains for x in c.inputs
                   if gone(x) and x in self.pending and self.pending[x].at == at)
