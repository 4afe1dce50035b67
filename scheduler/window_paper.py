"""The adaptive window scheduler as published (policy ``"window-paper"``; Hayakawa & Narihira,
nnabla's ``SwapInOutScheduler``). Steps (a)-(d) are described in ``scheduler.window``.

The planner keeps its own picture of each variable while it walks the step (it cancels a
swap-out it placed earlier when the variable is needed again within the window, which a
replay cannot undo); what it emits is replayed through ``scheduler.actions``' transition
table by ``check`` before ``plan`` returns it.
"""

from __future__ import annotations

from collections import deque

from scheduler.ir import VariableSequence
from scheduler.schedule import Action, Op, Schedule
from scheduler.working_sets import Infeasible, default_window, require_working_sets_fit

__all__ = ["plan_window_paper"]

# Residency while planning: the table's absent, resident, host and in-flight-out, plus
# "reserved" (memory taken ahead for a variable the window's functions will create).
_ABSENT, _RESIDENT, _HOST, _OUT, _RESERVED = range(5)


def plan_window_paper(seq: VariableSequence, budget: int, window: int | None = None) -> Schedule:
    """The adaptive window scheduler as published (policy ``"window-paper"``).

    Follows nnabla's ``SwapInOutScheduler::schedule``: a queue over the flattened use list
    ``v`` runs from the current function to ``head`` (the paper's l, the first use not yet
    prefetched); ``count[x]`` is how many uses of x sit in the queue. At f_i:

    (a) advance ``head`` while the distinct variables in the queue stay within ``window``
        bytes and the device within ``budget``: swap in each variable that is in the slower
        tier, reserve memory for each one f_i.. will create (no transfer needed), and cancel
        the pending swap-out of one that is on its way out;
    (b) before each swap-in, wait for the oldest pending swap-outs until it fits;
    (c) after f_i, swap out each of its variables whose use at f_i is its last in the queue;
    (d) unless it is never used again (free it, or swap it out if it is ``live_out``), or the
        queue holds a later use of it (it is scheduled back in within the window: keep it).

    Deviations from nnabla, all conservative: the uses of f_i itself are always admitted
    (nnabla fails when the window is smaller than a function); memory for a creation is
    reserved when it enters the window instead of backtracking later; no dtype casts. Every
    variable starts and ends the step in the slower tier (nnabla waits for all swap-outs at
    the end of an iteration), so ``initial_resident`` is empty.
    """
    if window is None:
        window = default_window(budget)
    require_working_sets_fit(seq, budget)
    functions = seq.functions
    variables = seq.variables
    n = len(functions)
    nbytes = {v: var.nbytes for v, var in variables.items()}
    last_use = seq.last_use

    # The flattened use list v[...] and where each function's uses end in it.
    order: list[tuple[int, int]] = []
    func_end: list[int] = []
    var_ids: list[tuple[int, ...]] = []
    for f in functions:
        ids = f.var_ids
        var_ids.append(ids)
        order.extend((f.index, v) for v in ids)
        func_end.append(len(order))

    state = {v: (_HOST if var.live_in else _ABSENT) for v, var in variables.items()}
    count = dict.fromkeys(variables, 0)
    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    in_flight_in: set[int] = set()
    pending_out: deque[list] = deque()      # [var, function index of its swap_out, cancelled?]
    pending_entry: dict[int, list] = {}
    swap_in_bytes = 0    # device bytes of resident, incoming and reserved variables
    swap_out_bytes = 0   # device bytes still held by pending swap-outs
    prefetch_bytes = 0   # distinct bytes in the queue: what the window limits
    head = 0

    def wait_for_swap_outs(i: int, nb: int) -> bool:
        """(b) wait for the oldest pending swap-outs until ``nb`` more bytes fit."""
        nonlocal swap_out_bytes
        while swap_in_bytes + swap_out_bytes + nb > budget and pending_out:
            v, _, cancelled = pending_out.popleft()
            if cancelled:
                continue
            del pending_entry[v]
            before[i].append(Action(Op.WAIT_OUT, v))
            state[v] = _HOST
            swap_out_bytes -= nbytes[v]
        return swap_in_bytes + swap_out_bytes + nb <= budget

    for i in range(n):
        # (a) swap-in: fill the window v[head:r] ahead of f_i.
        while head < len(order):
            f, v = order[head]
            if count[v] == 0:
                nb = nbytes[v]
                own = f == i  # f_i's own uses must come in, whatever the window says
                if not own and (prefetch_bytes + nb > window or swap_in_bytes + nb > budget):
                    break
                st = state[v]
                if st == _OUT:
                    # (d) skip redundant transfers: it is on its way out and needed again
                    # within the window; cancel the swap-out (its memory was never given back).
                    entry = pending_entry.pop(v)
                    entry[2] = True
                    after[entry[1]].remove(Action(Op.SWAP_OUT, v))
                    swap_out_bytes -= nb
                    swap_in_bytes += nb
                    state[v] = _RESIDENT
                elif st == _ABSENT:
                    # Created by a write at its first use: memory, but no transfer.
                    if not wait_for_swap_outs(i, nb):
                        if own:
                            raise Infeasible(i, swap_in_bytes + swap_out_bytes + nb)
                        break
                    swap_in_bytes += nb
                    state[v] = _RESERVED
                elif st == _HOST:
                    if not wait_for_swap_outs(i, nb):
                        if own:
                            raise Infeasible(i, swap_in_bytes + swap_out_bytes + nb)
                        break
                    before[i].append(Action(Op.SWAP_IN, v))
                    in_flight_in.add(v)
                    swap_in_bytes += nb
                    state[v] = _RESIDENT
                prefetch_bytes += nb
            count[v] += 1
            head += 1
        if head < func_end[i]:  # pragma: no cover - own uses are always admitted above
            raise Infeasible(i, seq.working_set_bytes(i))

        # f_i runs once its swap-ins have landed: wait_in right before the function.
        for v in var_ids[i]:
            if v in in_flight_in:
                in_flight_in.discard(v)
                before[i].append(Action(Op.WAIT_IN, v))
            state[v] = _RESIDENT

        # (c) schedule swap-out of f_i's variables whose last queued use this is ...
        for v in var_ids[i]:
            if count[v] == 1:
                nb = nbytes[v]
                if last_use[v] == i and not variables[v].live_out:
                    # (d) ... skipping variables never used again: free, no transfer.
                    after[i].append(Action(Op.FREE, v))
                    state[v] = _ABSENT
                else:
                    after[i].append(Action(Op.SWAP_OUT, v))
                    entry = [v, i, False]
                    pending_out.append(entry)
                    pending_entry[v] = entry
                    state[v] = _OUT
                    swap_out_bytes += nb
                swap_in_bytes -= nb
                prefetch_bytes -= nb
            # else (d): a later use is already in the window; it stays resident.
            count[v] -= 1

    # The end of the iteration: wait for every pending swap-out (nnabla's "wait for all").
    if n:
        for v, _, cancelled in pending_out:
            if not cancelled:
                after[n - 1].append(Action(Op.WAIT_OUT, v))
    return Schedule(
        sequence=seq, budget=budget, policy="window-paper", window=window,
        before=tuple(map(tuple, before)), after=tuple(map(tuple, after)),
        initial_resident=frozenset())
