"""Baseline policies to compare the window scheduler against: "none", "vdnn", "lms", "on-demand".

Each baseline applies a fixed rule that does not look at the budget. The budget is then
honoured the only honest way: the schedule is replayed, and if the rule's own peak exceeds
the budget, :class:`~scheduler.errors.BudgetTooSmall` names the first function where it
does and reports the rule's peak as the minimum budget (a baseline never silently goes over).

- ``"none"``: in-core training. Every ``live_in`` variable the step needs starts resident,
  every other variable lives from its creating write to its last use, nothing moves. With
  ``budget=None`` the budget becomes the in-core peak; with a budget below the in-core peak
  it raises ``BudgetTooSmall(minimum=in_core_peak_bytes)``.
- ``"vdnn"`` (Rhu et al., "vDNN: Virtualized Deep Neural Networks", MICRO 2016): every
  forward activation is swapped out after its last forward use (the copy overlaps the next
  function, whose end waits for it) and prefetched one function before its first backward
  use. Everything else stays resident. The forward/backward boundary is
  ``seq.meta["backward_start"]`` when the recorder set it, else the first function that
  creates a gradient (kind ``grad``), else the function where the number of live variables
  of the in-core step peaks: the forward piles up saved activations until the backward
  starts consuming them. An activation whose backward use follows its last forward use
  within two functions stays resident (there is no room to overlap anything).
- ``"lms"`` (Le et al., "TFLMS: Large Model Support in TensorFlow by Graph Rewriting", 2019):
  a fixed graph distance. After a use, a variable whose next use is more than
  ``swapout_threshold`` functions away is swapped out (dropped, when its host copy is
  current: TFLMS reuses the host copy for every later consumer), and swapped back in
  ``swapin_ahead`` functions before that next use. As in TFLMS, which rewrites tensors and
  never touches variables, ``live_out`` variables (parameters, optimizer state) stay put.
- ``"on-demand"`` (NNTrainer's on-demand swap, Moon et al., "A New Frontier of AI: On-Device
  AI Training and Personalization", ICSE-SEIP 2024; ``MemorySwap`` without lookahead):
  nothing is kept that the next function does not use, and nothing is fetched ahead.
  After each use of a variable that is used again later, but not by the very next function,
  the variable leaves the device: ``swap_out`` + ``wait_out`` at once (a synchronous write,
  as NNTrainer's cache flush is), or ``drop`` when its host copy is current (read only since
  it came in). Right before its next use, ``swap_in`` + ``wait_in``: the function waits for
  the whole read. ``live_in`` variables start in the slower tier and ``live_out`` ones are
  put back there after their last use, since the next step uses them again (NNTrainer keeps
  weights in its swap file between iterations too). A variable used by two consecutive
  functions stays resident between them (NNTrainer flushes everything except what the
  current execution order uses). Every transfer is a stall; the rule's peak is close to
  the largest working set of two neighbouring functions, its cost is the I/O time.
"""

from __future__ import annotations

import dataclasses
import logging

from scheduler.errors import BudgetTooSmall, ScheduleError
from scheduler.ir import Access, Kind, VariableSequence
from scheduler.schedule import Action, Op, Schedule

__all__ = ["plan_none", "plan_vdnn", "plan_lms", "plan_on_demand", "backward_start"]

log = logging.getLogger(__name__)

#: TFLMS defaults: swap out what is not needed for more than ``swapout_threshold``
#: operations, and trigger the swap-in ``swapin_ahead`` operation(s) before the consumer
#: (the paper's lower bound ``lb = 1``).
LMS_SWAPOUT_THRESHOLD = 10
LMS_SWAPIN_AHEAD = 1


def plan_none(seq: VariableSequence, budget: int | None) -> Schedule:
    """Everything resident, no transfers (policy ``"none"``)."""
    before, after = _empty(seq)
    _free_after_last_use(seq, after)
    return _fit(seq, budget, "none", before, after, _needed_live_in(seq))


def plan_vdnn(seq: VariableSequence, budget: int, *, backward_start: int | None = None) -> Schedule:
    """vDNN: offload forward activations, prefetch one function ahead of the backward use."""
    bs = _backward_start(seq) if backward_start is None else backward_start
    before, after = _empty(seq)
    swap_ins: list[list[Action]] = [[] for _ in seq.functions]
    for v, var in seq.variables.items():
        if var.kind is not Kind.ACTIVATION or var.live_in or var.live_out:
            continue
        uses = seq.uses_of[v]
        fwd = [i for i in uses if i < bs]
        bwd = [i for i in uses if i >= bs]
        if not fwd or not bwd:
            continue
        p, u = fwd[-1], bwd[0]
        if u < p + 3:
            continue  # no function between the swap-out's wait and the prefetch
        after[p].append(Action(Op.SWAP_OUT, v))
        after[p + 1].append(Action(Op.WAIT_OUT, v))
        swap_ins[u - 1].append(Action(Op.SWAP_IN, v))
        before[u].append(Action(Op.WAIT_IN, v))
    _free_after_last_use(seq, after)
    before = [ins + acts for ins, acts in zip(swap_ins, before)]
    return _fit(seq, budget, "vdnn", before, after, _needed_live_in(seq))


def plan_lms(seq: VariableSequence, budget: int, *, swapout_threshold: int = LMS_SWAPOUT_THRESHOLD,
             swapin_ahead: int = LMS_SWAPIN_AHEAD) -> Schedule:
    """TFLMS: swap out across every gap longer than ``swapout_threshold`` functions."""
    before, after = _empty(seq)
    swap_ins: list[list[Action]] = [[] for _ in seq.functions]
    writes = [{u.var for u in f.uses if u.access is Access.WRITE} for f in seq.functions]
    for v, var in seq.variables.items():
        if var.live_out:
            continue
        uses = seq.uses_of[v]
        clean = False  # the host copy is current (TFLMS swaps a tensor out once)
        for j, nxt in zip(uses, uses[1:]):
            if v in writes[j]:
                clean = False
            if nxt - j <= swapout_threshold:
                continue
            if clean:
                after[j].append(Action(Op.DROP, v))
            else:
                after[j].append(Action(Op.SWAP_OUT, v))
                after[j + 1].append(Action(Op.WAIT_OUT, v))
            swap_ins[max(nxt - swapin_ahead, j + 2)].append(Action(Op.SWAP_IN, v))
            before[nxt].append(Action(Op.WAIT_IN, v))
            clean = True
    _free_after_last_use(seq, after)
    before = [ins + acts for ins, acts in zip(swap_ins, before)]
    return _fit(seq, budget, "lms", before, after, _needed_live_in(seq))


def plan_on_demand(seq: VariableSequence, budget: int) -> Schedule:
    """NNTrainer's on-demand swap: out after every use, back in synchronously at the next."""
    before, after = _empty(seq)
    writes = [{u.var for u in f.uses if u.access is Access.WRITE} for f in seq.functions]
    for v, var in seq.variables.items():
        uses = seq.uses_of[v]
        if not uses:
            continue  # never used: a live_in one stays in the slower tier, where it started
        # The host copy is current for a live_in variable (it starts in the slower tier);
        # a variable created in the step has none until its first swap-out.
        clean = var.live_in
        if var.live_in:
            # (a) swap-in, synchronous: fetched right before its first use, no prefetch.
            before[uses[0]] += [Action(Op.SWAP_IN, v), Action(Op.WAIT_IN, v)]
        nexts = list(uses[1:]) + ([None] if var.live_out else [])
        for j, nxt in zip(uses, nexts):
            if v in writes[j]:
                clean = False
            if nxt is not None and nxt == j + 1:
                continue  # the next function uses it too: it stays
            # (c) swap-out right after the use, waited for at once; (d) skip the write
            # when the slower tier already holds these bytes.
            if clean:
                after[j].append(Action(Op.DROP, v))
            else:
                after[j] += [Action(Op.SWAP_OUT, v), Action(Op.WAIT_OUT, v)]
                clean = True
            if nxt is not None:
                before[nxt] += [Action(Op.SWAP_IN, v), Action(Op.WAIT_IN, v)]
    _free_after_last_use(seq, after)
    return _fit(seq, budget, "on-demand", before, after, frozenset())


def backward_start(seq: VariableSequence) -> int:
    """The first backward function: ``meta["backward_start"]`` or the heuristic above."""
    return _backward_start(seq)


# -- helpers -----------------------------------------------------------------------------------


def _backward_start(seq: VariableSequence) -> int:
    bs = seq.meta.get("backward_start")
    if isinstance(bs, int) and not isinstance(bs, bool) and 0 <= bs <= len(seq.functions):
        return bs
    # Parameter gradients are created only by the backward.
    variables = seq.variables
    created_grads = [i for v, i in seq.first_use.items()
                     if variables[v].kind is Kind.GRAD and not variables[v].live_in]
    if created_grads:
        return min(created_grads)
    # Otherwise: the forward piles up saved activations until the backward starts consuming
    # them, so the number of live variables peaks there (counting variables, not bytes,
    # keeps one large temporary from moving the boundary).
    n = len(seq.functions)
    if not n:
        return 0
    delta = [0] * (n + 1)
    for v, var in variables.items():
        ix = seq.uses_of[v]
        if not ix and not var.live_in:
            continue
        start = 0 if var.live_in else ix[0]
        end = n if var.live_out else (ix[-1] + 1 if ix else start)
        delta[start] += 1
        delta[end] -= 1
    best = cur = 0
    best_at = 0
    for i in range(n):
        cur += delta[i]
        if cur > best:
            best, best_at = cur, i
    return best_at


def _empty(seq: VariableSequence) -> tuple[list[list[Action]], list[list[Action]]]:
    n = len(seq.functions)
    return [[] for _ in range(n)], [[] for _ in range(n)]


def _needed_live_in(seq: VariableSequence) -> frozenset[int]:
    """live_in variables that the step uses or must keep: they start (and stay) resident."""
    return frozenset(v for v, var in seq.variables.items()
                     if var.live_in and (seq.uses_of[v] or var.live_out))


def _free_after_last_use(seq: VariableSequence, after: list[list[Action]]) -> None:
    for v, last in sorted(seq.last_use.items(), key=lambda kv: (kv[1], kv[0])):
        if not seq.variables[v].live_out:
            after[last].append(Action(Op.FREE, v))


def _fit(seq: VariableSequence, budget: int | None, policy: str, before: list[list[Action]],
         after: list[list[Action]], initial: frozenset[int]) -> Schedule:
    """Replay the fixed rule without a budget, then hold it to ``budget`` or say why not."""
    from scheduler.check import check

    unlimited = max(1, sum(var.nbytes for var in seq.variables.values()))
    free = Schedule(sequence=seq, budget=unlimited, policy=policy, window=0,
                    before=tuple(map(tuple, before)), after=tuple(map(tuple, after)),
                    initial_resident=initial)
    result = check(free)
    if budget is None:
        budget = max(1, result.peak_bytes)
    schedule = dataclasses.replace(free, budget=budget)
    if result.peak_bytes > budget:
        # Name the first point where the rule goes over: check stops exactly there.
        try:
            check(schedule)
        except ScheduleError as err:
            i = err.function if err.function is not None else 0
        else:  # pragma: no cover - the peak exceeds the budget, so check must object
            raise AssertionError("check accepted a schedule above its budget")
        if not seq.functions:
            raise BudgetTooSmall(function=0, name="<no functions>", working_set=result.peak_bytes,
                                 budget=budget, minimum=result.peak_bytes)
        held = result.resident_bytes[i]
        if held <= budget:  # it went over between functions (a swap-in): report the rule's peak
            held = result.peak_bytes
        raise BudgetTooSmall(function=i, name=seq.functions[i].name, working_set=held,
                             budget=budget, minimum=result.peak_bytes)
    log.debug("%s: peak %d B within budget %d B", policy, result.peak_bytes, budget)
    return schedule

