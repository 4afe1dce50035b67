"""Adaptive window-based scheduling (Hayakawa & Narihira, "Out-of-core training with
adaptive window-based scheduling"; nnabla's ``SwapInOutScheduler``), and our refinement.

Both planners walk the functions f_0 .. f_{n-1} of one training step and decide, around each
function, which variables move between the device (the budgeted pool) and the slower tier.
The paper's loop, per function f_i, has four steps, and the code below is written in them:

(a) **swap-in**: prefetch every swapped-out variable whose use lies within the next
    ``window`` bytes of the flattened use list v[...] (the uses of all functions in order);
(b) **wait for swap-outs**: when a prefetch would exceed the physical budget, first wait for
    the oldest pending swap-outs (FIFO), which gives their memory back;
(c) **schedule swap-out**: after f_i, swap out the variables it used;
(d) **skip redundant transfers**: no swap-out for a variable that is never used again (free
    it) or that is already scheduled back in within the window (keep it resident).

``"window"`` (:func:`plan_window`, the default policy) moves only what the budget forces
out. It replays the step keeping every variable resident, and only when the next function
would overflow the budget does it choose victims, Belady-style: the resident variables whose
next use is farthest away (in training, the activations saved first in the forward, which
the backward needs last). A victim's swap-out is placed right after its last use, where (c)
would have put it, so it overlaps the functions in between; its memory comes back at the
overflow point, step (b), or sooner where a release rule says the copy is done
(``scheduler.release``). Victims with a current host copy are dropped, with no transfer, and
variables that start resident and are evicted before their first use simply start in the
slower tier, step (d). Then step (a) prefetches each swap-in as early as both the window and
the budget allow. With a budget of at least ``in_core_peak_bytes`` it moves nothing.
The paper's algorithm as nnabla implements it (policy ``"window-paper"``) is
``scheduler.window_paper``, their helpers ``scheduler.working_sets``; both raise
``BudgetTooSmall`` when one function's working set alone exceeds the budget, and
``scheduler.planner.plan`` validates arguments and proves every schedule with ``check``.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import Callable, Sequence

from scheduler.assembly import assemble_window
from scheduler.beside import limits, require_fit
from scheduler.ir import VariableSequence
from scheduler.pins import Pins
from scheduler.release import Release
from scheduler.replay import Chain
from scheduler.prefetch import prefetch_through_window
from scheduler.schedule import Action, Op, Schedule
from scheduler.segments import Replays
from scheduler.window_paper import plan_window_paper
from scheduler.working_sets import (INF, Infeasible, Prepared, default_window,
                                    require_working_sets_fit, working_sets)

__all__ = ["plan_window", "plan_window_paper", "default_window", "require_working_sets_fit", "working_sets"]

log = logging.getLogger(__name__)


# Residency while planning: phase 1 keeps its own states (``plan`` replays the emitted
# schedule through ``scheduler.actions`` in ``check`` before returning it).
_ABSENT, _RESIDENT, _HOST, _GONE = range(4)   # _GONE: discarded, to be recomputed
Recompute = Callable[..., "Chain | None"]   # rule(v, at[, absent]): the chain, or None to swap


# =============================================================================================
# "window": move only what the budget forces out
# =============================================================================================


def plan_window(seq: VariableSequence, budget: int, window: int | None = None,
                recompute: "Recompute | None" = None, pins: Pins = Pins(),
                release: "Release | None" = None, beside: Sequence[int] = ()) -> Schedule:
    """The default policy: the window scheduler moving only what the budget forces out.

    Starts with every ``live_in`` variable that the step needs resident, replays the step,
    and at a function that would overflow the budget evicts the resident variables whose
    next use is farthest (Belady), placing each swap-out right after its last use. The start
    state is refined once: a variable that the first plan had to swap back in at the end to
    restore it is tried starting in the slower tier instead, and the plan moving fewer bytes
    wins (ties go to the first). See the module docstring for steps (a)-(d).

    ``recompute(v, at)``: for a victim that would be swapped out, the chain to recompute it
    with before its next use ``at`` instead (``scheduler.replay.Chain``), or None to swap it
    (``scheduler.recompute`` prices the two); one with ``through`` set gets ``absent(x)`` too,
    whether input x is discarded then (``scheduler.replay.chain_through``). Without it, or when it always says None, the
    plan is the swap-only plan. ``pins`` (``scheduler.pins``): ``keep`` is never evicted,
    ``must`` is discarded after each use not followed at once by the next (``recompute``
    must give its chain, as ``pinned_rule`` does). ``release(v, last, at)``: where in
    ``last + 1 .. at`` a victim's wait_out goes (``scheduler.release``); without it, ``at``.
    ``beside``: per function, bytes the device holds outside the plan (``scheduler.beside``):
    the plan holds at most ``budget - beside[i]`` around function ``i``.
    """
    if window is None:
        window = default_window(budget)
    prep = Prepared.of(seq)
    require_working_sets_fit(seq, budget, prep.working_sets)
    require_fit(seq, budget, beside, prep.working_sets)
    variables = seq.variables
    uses_of = seq.uses_of
    start = [v for v, var in variables.items() if var.live_in and (uses_of[v] or var.live_out)]
    if not seq.functions:
        # Nothing runs, so nothing can move: start (and end) resident if it all fits.
        fits = sum(variables[v].nbytes for v in start) <= budget
        return Schedule(sequence=seq, budget=budget, policy="window", window=window,
                        before=(), after=(), initial_resident=frozenset(start if fits else ()))

    best: _BudgetWindow | None = None
    tried: set[frozenset[int]] = set()
    resident_at_start = frozenset(start)
    for _ in range(2):
        if resident_at_start in tried:
            break
        tried.add(resident_at_start)
        planner = _BudgetWindow(prep, budget, window, resident_at_start, recompute, pins, release, tuple(beside))
        try:
            planner.decide()
        except Infeasible:   # bounded beside: the end may hold less than the start, and must hold the start set
            if not beside or not resident_at_start:
                raise
            planner = _BudgetWindow(prep, budget, window, frozenset(), recompute, pins, release, tuple(beside))
            planner.decide()   # nothing starts on the device: nothing to bring back at the end
        log.debug("window: start with %d resident -> %d B moved", len(resident_at_start), planner.moved)
        if best is None or planner.moved < best.moved:
            best = planner
        # Variables restored at the end of the step cost a swap-in there: try starting them
        # in the slower tier instead.
        resident_at_start = frozenset(planner.start_set - planner.restored)
    assert best is not None
    return best.schedule()


class _BudgetWindow:
    """One pass of policy "window" for a given set of variables resident at the start.

    Phase 1 (steps (b), (c), (d)) replays the step with Belady eviction and records, per
    function, the device bytes while it runs (``during``); phase 2 (step (a)) moves each
    swap-in as early as the window and the recorded bytes allow.
    """

    def __init__(self, prep: Prepared, budget: int, window: int, resident: frozenset[int],
                 recompute: "Recompute | None" = None, pins: Pins = Pins(),
                 release: "Release | None" = None, beside: tuple[int, ...] = ()) -> None:
        self.recompute = recompute
        self.release = release
        self.pins = pins
        self.prep = prep
        self.seq = prep.seq
        self.working_sets = prep.working_sets
        self.budget, self.beside = budget, beside
        self.cap = limits(budget, beside, len(prep.seq.functions))   # the most held around each function
        self.window = window
        self.resident_at_start = resident
        self.restored: set[int] = set()
        self.moved = 0  # bytes swapped in + swapped out

    def decide(self) -> None:
        """Phase 1: which variables leave the device, where their transfers go, bytes moved."""
        prep, seq, cap = self.prep, self.seq, self.cap
        variables = seq.variables
        n = len(seq.functions)
        nbytes, live_in, live_out = prep.nbytes, prep.live_in, prep.live_out

        state = {v: _HOST if v in live_in else _ABSENT for v in variables}
        clean: dict[int, bool] = {}       # resident and the host copy is current
        untouched: set[int] = set()       # resident since the start, not used yet
        in_start_set: set[int] = set()    # still in initial_resident
        anchor: dict[int, int] = {}       # the function that last used it
        ready: dict[int, int] = dict.fromkeys(live_in, 0)  # earliest before[k] where it is in host
        stamp = dict.fromkeys(variables, 0)                # invalidates older heap entries
        # Belady's order: the farthest next use pops first; among equals, what can leave
        # for free (a current host copy, or never touched) before what needs a transfer;
        # then the larger first.
        heap: list[tuple[float, int, int, int, int]] = []
        mem = 0

        for v in sorted(self.resident_at_start):
            state[v] = _RESIDENT
            clean[v] = False
            untouched.add(v)
            in_start_set.add(v)
            mem += nbytes[v]
            heap.append((-prep.first_use.get(v, INF), 0, nbytes[v], v, 0))
        heapq.heapify(heap)

        waits: list[list[int]] = [[] for _ in range(n + 1)]     # (b) wait_out before f_i
        demand: list[list[int]] = [[] for _ in range(n + 1)]    # swap-ins f_i cannot run without
        demand_ready: list[list[int]] = [[] for _ in range(n + 1)]
        after: list[list[Action]] = [[] for _ in range(n)]
        during = [0] * n
        replays = Replays(prep, cap, self.recompute)   # the recomputes planned so far
        regen = self.regen = replays.regen   # the chains recomputed before f_i
        gone = lambda x: state[x] == _GONE   # noqa: E731
        protect: set[int] = set()     # the inputs of the chains about to run: not evicted now
        keep, must = self.pins.keep, self.pins.must

        def discard(v: int, last: int, chains: list[Chain]) -> None:
            """Recompute ``v`` instead of a swap: discarded right after its last use ``last``,
            its chain (the last of ``chains``) rerun right before its next use, after the
            recomputes it reads moved there (``scheduler.segments``)."""
            nonlocal mem
            after[last].append(Action(Op.DISCARD, v))
            replays.commit(chains)
            state[v] = _GONE
            mem -= nbytes[v]

        def evict(excess: int, i: int) -> None:
            """(c) schedule swap-out of Belady's victims, with (d) and (b), freeing ``excess`` bytes."""
            nonlocal mem
            spared = []
            while excess > 0:
                if not heap:
                    raise Infeasible(i, mem + excess)
                key = heapq.heappop(heap)
                v = key[3]
                if state[v] != _RESIDENT or key[4] != stamp[v]:
                    continue  # stale entry
                if v in protect or v in keep:
                    spared.append(key)
                    continue
                if -key[0] <= i:
                    # Everything left is needed by f_i itself: the working-set check makes
                    # this unreachable, but never return an unsafe plan.
                    raise Infeasible(i, mem + excess)
                nb = nbytes[v]
                if v in untouched:
                    # (d) skip the transfer: never used so far, so it can simply start the
                    # step in the slower tier.
                    untouched.discard(v)
                    in_start_set.discard(v)
                    ready[v] = 0
                elif clean.get(v):
                    # (d) skip the transfer: the host copy is current; drop it right after
                    # its last use.
                    after[anchor[v]].append(Action(Op.DROP, v))
                    ready[v] = anchor[v] + 1
                elif (chains := replays.instead(v, -key[0], gone, anchor[v], i)) is not None:
                    discard(v, anchor[v], chains)   # no transfer
                    excess -= nb
                    continue
                else:
                    # (c) out right after its last use, overlapping the functions between;
                    # (b) its bytes come back at wait_out: here, or sooner by the release rule.
                    after[anchor[v]].append(Action(Op.SWAP_OUT, v))
                    if replays.clock is not None:
                        replays.clock.book(nb, anchor[v], i)
                    back = i if self.release is None else self.release(v, anchor[v], i)
                    waits[back].append(v)
                    ready[v] = back
                    during[back:i] = [d - nb for d in during[back:i]]
                    self.moved += nb
                state[v] = _HOST
                mem -= nb
                excess -= nb
            for key in spared:
                heapq.heappush(heap, key)

        ids_of, writes_of, next_of = prep.ids, prep.writes, prep.next_after
        heappush = heapq.heappush
        for i in range(n):
            ids = ids_of[i]
            incoming = []
            created = []
            extra = transient = 0
            fetched = []   # chain inputs in the slower tier: swapped in for the recompute
            if regen[i]:
                protect.clear()
                for chain in regen[i]:
                    extra += nbytes[chain.var]
                    transient = max(transient, chain.temporaries_bytes)
                    for x in chain.inputs:
                        protect.add(x)
                        if state[x] == _HOST and x not in ids and x not in fetched:
                            fetched.append(x)
                            extra += nbytes[x]
            for v in ids:
                st = state[v]
                if st == _HOST:
                    incoming.append(v)
                    extra += nbytes[v]
                elif st == _ABSENT:
                    created.append(v)
                    extra += nbytes[v]
            if mem + extra + transient > cap[i]:
                evict(mem + extra + transient - cap[i], i)
            if regen[i]:
                self._bring_chain_inputs(i, regen[i], fetched, state, clean, untouched, anchor, stamp, heap)
                protect.clear()
                for chain in regen[i]:
                    state[chain.var] = _RESIDENT
                    clean[chain.var] = False
                    replays.ran(chain)
                    if chain.var not in ids:   # moved here: resident until its use
                        self._hold(chain.var, i, untouched, anchor, stamp, heap)
            for v in fetched + incoming:
                demand[i].append(v)
                demand_ready[i].append(ready[v])
                state[v] = _RESIDENT
                clean[v] = True
            for v in created:
                state[v] = _RESIDENT
                clean[v] = False
            mem += extra
            during[i] = mem + transient
            written = writes_of[i]
            for v, nxt in zip(ids, next_of[i]):
                if untouched:
                    untouched.discard(v)
                anchor[v] = i
                if v in written:
                    clean[v] = False
                if nxt == INF and v not in live_out:
                    # (d) never used again: free it, no transfer.
                    after[i].append(Action(Op.FREE, v))
                    state[v] = _ABSENT
                    mem -= nbytes[v]
                elif v in must and nxt > i + 1 and (chains := replays.instead(v, nxt, gone)):
                    discard(v, i, chains)   # pinned "must_recompute": never kept across a gap
                else:
                    stamp[v] += 1
                    heappush(heap, (-nxt, 0 if clean[v] else 1, nbytes[v], v, stamp[v]))

        # The end of the step must match its start: what started resident is resident again,
        # what started in the slower tier is back there.
        start_set = set(in_start_set)
        for v in sorted(v for v in live_in & live_out if state[v] == _RESIDENT and v not in start_set):
            self._leave(v, n, clean, anchor, after, waits)
            state[v] = _HOST
            mem -= nbytes[v]
        missing = [v for v in sorted(start_set) if v in live_out and state[v] != _RESIDENT]
        need = sum(nbytes[v] for v in missing)
        budget = min(cap[-1], cap[0])   # the next step starts where this one ends
        if mem + need > budget:
            # Variables created this step and kept (live_out) may end in either tier: move the
            # largest out until the restored start set fits.
            extra_out = sorted((v for v in live_out - live_in if state[v] == _RESIDENT),
                               key=lambda v: (-nbytes[v], v))
            for v in extra_out:
                if mem + need <= budget:
                    break
                self._leave(v, n, clean, anchor, after, waits)
                state[v] = _HOST
                mem -= nbytes[v]
        if mem + need > budget:  # pragma: no cover - the start set fitted at the start
            raise Infeasible(n - 1, mem + need)
        for v in missing:
            demand[n].append(v)
            demand_ready[n].append(ready[v])
        self.restored = set(missing)
        self.moved += sum(nbytes[v] for d in demand for v in d)
        self.start_set = frozenset(start_set)
        self.waits, self.demand, self.demand_ready, self.after, self.during = waits, demand, demand_ready, after, during

    def schedule(self) -> Schedule:
        """Phase 2: step (a), prefetch through the window, then the action lists."""
        prefetch = prefetch_through_window(self.seq, self.cap, self.window, self.working_sets,
                                           self.during, self.demand, self.demand_ready, self.prep.nbytes)
        return assemble_window(self.seq, self.budget, self.window, self.waits, self.demand, prefetch,
                               self.regen, self.after, self.start_set, self.beside)

    def _hold(self, v: int, i: int, untouched: set[int], anchor: dict[int, int], stamp: dict[int, int],
              heap: list) -> None:
        """``v`` recomputed before f_i for a chain there, not used by f_i: resident from here,
        evictable, next needed at its next use."""
        uses = self.seq.uses_of[v]
        k = bisect.bisect_right(uses, i)
        untouched.discard(v)
        anchor[v] = i
        stamp[v] += 1
        heapq.heappush(heap, (-(uses[k] if k < len(uses) else INF), 1, self.prep.nbytes[v], v, stamp[v]))

    def _bring_chain_inputs(self, i: int, chains: list[Chain], fetched: list[int], state, clean,
                            untouched, anchor, stamp, heap) -> None:
        """Before the recomputes of f_i, the chains' inputs are resident; those swapped in
        for it (``fetched``) are clean and next needed at their next use."""
        uses_of = self.seq.uses_of
        for chain in chains:
            for x in chain.inputs:
                untouched.discard(x)
                anchor[x] = max(anchor.get(x, i), i)   # a later eviction goes after f_i
        for x in fetched:
            state[x] = _RESIDENT
            clean[x] = True
            uses = uses_of[x]
            k = bisect.bisect_right(uses, i)
            stamp[x] += 1
            heapq.heappush(heap, (-(uses[k] if k < len(uses) else INF), 0, self.prep.nbytes[x], x, stamp[x]))

    def _leave(self, v: int, n: int, clean: dict[int, bool], anchor: dict[int, int],
               after: list[list[Action]], waits: list[list[int]]) -> None:
        """Send ``v`` to the slower tier by the end of the step (drop if its host copy is current)."""
        # Only variables that were used get here: one resident since the start is in the
        # start set, and anything else became resident by a use.
        assert v in anchor, v
        if clean.get(v):
            after[anchor[v]].append(Action(Op.DROP, v))
        else:
            after[anchor[v]].append(Action(Op.SWAP_OUT, v))
            waits[n].append(v)
            self.moved += self.prep.nbytes[v]
