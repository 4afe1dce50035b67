"""Policy "milp": the reference the default planner is measured against (not the default).

A mixed-integer program in the spirit of POET (Patil et al., ICML'22: paging and
rematerialization decided jointly), solved by ``scipy.optimize.milp`` (HiGHS). POET has a
binary per (time step, tensor) for compute, keep, page-in and page-out; here time is the
function index and the decisions are made per *gap*: the functions between two consecutive
uses ``a < b`` of a variable, where it is live but unused. For every gap g of ``nbytes``:

- ``s_g`` (swap): its bytes are off the device for the gap's interior except the first and
  the last function (the copy out runs during the first, the copy back during the last;
  a swap-in holds its destination, a swap-out its source);
- ``r_g`` (recompute, only where ``scheduler.replay.chain_for(v, b)`` has a chain): its
  bytes are off for the whole interior and the chain's temporaries are on at ``b``;
- neither: kept resident. ``s_g + r_g <= 1``.

Memory, at every function t: the in-core live bytes, minus what the gaps spanning t take
off, plus the temporaries of the chains run before t, at most the budget (plus a slack that
costs far more than any plan, so the program is always feasible).

Time, in seconds (the objective): every recompute costs its chain's seconds; every swap
costs the compute time its bytes take on a CPU device (``2 x nbytes x moved_byte_s``) and
the stall it causes: at least what its two copies take beyond the compute seconds of its
gap (``e_g``), and all swaps together at least what the link needs beyond the step's
compute seconds (``stall``, per direction, or both directions on a half-duplex tier).

The solution becomes a schedule the way the default planner's does: ``scheduler.window``
replays the step with Belady eviction, and a victim is recomputed exactly when the MILP
recomputes that gap. ``plan()`` then checks it like every other plan. Graphs of a few
hundred functions solve in seconds; ``time_limit`` bounds the solver (the best solution
found so far is used).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from scheduler.hardware import Hardware, hardware
from scheduler.ir import VariableSequence
from scheduler.recompute import chain_seconds, default_hardware
from scheduler.replay import Chain, chain_for
from scheduler.schedule import Schedule
from scheduler.window import plan_window
from scheduler.working_sets import require_working_sets_fit

__all__ = ["plan_milp"]

log = logging.getLogger(__name__)

SLACK_S_PER_BYTE = 1.0   # a byte over the budget costs a second: never chosen if avoidable


@dataclass(frozen=True, slots=True)
class _Gap:
    var: int
    a: int            # last use before the gap
    b: int            # next use after it
    nbytes: int
    swap_s: float     # copy out + copy back
    cpu_s: float      # compute time the moved bytes take (CPU devices)
    compute_s: float  # compute seconds of the functions inside the gap
    chain: Chain | None


def plan_milp(seq: VariableSequence, budget: int, window: int | None = None,
              hardware: Hardware | str | None = None, time_limit: float = 60.0) -> Schedule:
    """Solve the program (module docstring) for ``seq`` and ``budget``; emit its schedule."""
    from scipy.optimize import Bounds, LinearConstraint, milp   # the dev extra; lazily
    from scipy.sparse import coo_matrix

    require_working_sets_fit(seq, budget)
    hw = default_hardware(seq) if hardware is None else _hw(hardware)
    gaps, seconds = _gaps(seq, hw)
    n, m = len(seq.functions), len(gaps)
    # Columns: s_g (m), r_g (m), e_g (m), stall (2), slack_t (n).
    S, R, E, ST, SL = 0, m, 2 * m, 3 * m, 3 * m + 2
    cols = 3 * m + 2 + n
    cost = np.zeros(cols)
    lo, hi = np.zeros(cols), np.ones(cols)
    integrality = np.zeros(cols)
    integrality[:2 * m] = 1
    hi[E:] = np.inf
    for k, g in enumerate(gaps):
        cost[S + k] = g.cpu_s
        if g.chain is None:
            hi[R + k] = 0
        else:
            cost[R + k] = chain_seconds(seq, g.chain, hw)
        cost[E + k] = 1.0
    cost[ST:ST + 2] = 1.0
    cost[SL:] = SLACK_S_PER_BYTE

    rows, cols_i, vals, row_hi, row_lo = [], [], [], [], []

    def row(entries, upper, lower=-np.inf):
        r = len(row_hi)
        for c, v in entries:
            rows.append(r)
            cols_i.append(c)
            vals.append(v)
        row_hi.append(upper)
        row_lo.append(lower)

    # memory at every function
    live = seq.live_bytes
    at: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for k, g in enumerate(gaps):
        for t in range(g.a + 1, g.b):
            at[t].append((R + k, -g.nbytes))
            if g.a + 1 < t < g.b - 1:
                at[t].append((S + k, -g.nbytes))
        if g.chain is not None and g.chain.temporaries_bytes:
            at[g.b].append((R + k, g.chain.temporaries_bytes))
    for t in range(n):
        if live[t] > budget or at[t]:
            row(at[t] + [(SL + t, -1.0)], budget - live[t])
    for k, g in enumerate(gaps):
        row([(S + k, 1), (R + k, 1)], 1)                           # one way out at most
        row([(S + k, g.swap_s), (E + k, -1)], g.compute_s)         # its copies beyond its gap
    # the link, over the whole step
    total = sum(seconds)
    half_in = [(S + k, g.swap_s / 2) for k, g in enumerate(gaps)]
    if hw.full_duplex:
        row(half_in + [(ST, -1)], total)
        row(half_in + [(ST + 1, -1)], total)
    else:
        row([(c, 2 * v) for c, v in half_in] + [(ST, -1)], total)

    a = coo_matrix((vals, (rows, cols_i)), shape=(len(row_hi), cols)).tocsr()
    res = milp(cost, integrality=integrality, bounds=Bounds(lo, hi),
               constraints=LinearConstraint(a, np.array(row_lo), np.array(row_hi)),
               options={"time_limit": float(time_limit), "disp": False})
    if res.x is None:
        log.warning("milp: no solution (%s); planning swap-only", res.message)
        chosen: dict[tuple[int, int], Chain] = {}
    else:
        x = res.x
        chosen = {(g.var, g.b): g.chain for k, g in enumerate(gaps) if g.chain is not None and x[R + k] > 0.5}
        log.info("milp: %s, objective %.6f s, %d gaps, %d recomputed, %d swapped", res.message,
                 res.fun, m, len(chosen), int(sum(x[S:S + m] > 0.5)))
    schedule = plan_window(seq, budget, window, lambda v, b: chosen.get((v, b)))
    return Schedule(sequence=seq, budget=schedule.budget, policy="milp", window=schedule.window,
                    before=schedule.before, after=schedule.after,
                    initial_resident=schedule.initial_resident)


def _hw(h: Hardware | str) -> Hardware:
    return hardware(h)


def _gaps(seq: VariableSequence, hw: Hardware) -> tuple[list[_Gap], list[float]]:
    """Every gap of at least one function between two uses of a variable."""
    seconds = [hw.function_s(f.cost) for f in seq.functions]
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])
    gaps = []
    for v, uses in seq.uses_of.items():
        nb = seq.variables[v].nbytes
        if not nb:
            continue
        swap_s = hw.transfer_s(nb, to_device=False) + hw.transfer_s(nb, to_device=True)
        for a, b in zip(uses, uses[1:]):
            if b - a < 2:
                continue
            gaps.append(_Gap(var=v, a=a, b=b, nbytes=nb, swap_s=swap_s,
                             cpu_s=2 * nb * hw.moved_byte_s,
                             compute_s=float(prefix[b] - prefix[a + 1]),
                             chain=chain_for(seq, v, b)))
    return gaps, seconds
