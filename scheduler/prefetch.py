"""Step (a) of the window scheduler: swap-in through the window.

The budget planner (``scheduler.window``, policy "window") first decides which swap-ins each
function cannot run without; this moves each of them as early as the prefetch window and the
device bytes already planned allow, so the copy overlaps the functions in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler.ir import VariableSequence

__all__ = ["prefetch_through_window"]


def prefetch_through_window(seq: VariableSequence, cap: Sequence[int], window: int, working_sets: list[int],
                            during: list[int], demand: list[list], demand_ready: list[list[int]],
                            nbytes: dict[int, int]) -> list[list[int]]:
    """(a) swap-in through the window: issue each demanded swap-in as early as allowed.

    A swap-in needed by f_u may move to before f_k (k < u) when the variable is in the
    slower tier by then (``ready``), the uses of f_k .. f_u fit in ``window`` bytes, and
    the device bytes recorded for f_k .. f_{u-1} plus the variable stay within the
    budget at each (``cap``, per function). Earlier needs are placed first. Rewrites
    ``demand[u]`` to (var, hoisted).
    """
    n = len(seq.functions)
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(working_sets, out=prefix[1:])
    level = np.asarray(during, dtype=np.int64)
    flat = min(cap, default=0) == max(cap, default=0)
    room = None if flat else np.asarray(cap, dtype=np.int64)   # per function, else one budget
    prefetch: list[list[int]] = [[] for _ in range(n)]
    lo_window = 0
    for u in range(n + 1):
        if not demand[u]:
            continue
        # The earliest function from which f_u's uses are within the window.
        top = int(prefix[min(u + 1, n)])
        lo_window = int(np.searchsorted(prefix, top - window, side="left"))
        out = []
        for v, ready in zip(demand[u], demand_ready[u]):
            nb = nbytes[v]
            start = _earliest_fit(level, max(lo_window, ready), u, nb, cap[0] if flat else room)
            if start < u:
                prefetch[start].append(v)
                level[start:u] += nb
                out.append((v, True))
            else:
                out.append((v, False))
        demand[u] = out
    return prefetch


def _earliest_fit(level: "np.ndarray", lo: int, hi: int, nb: int, cap: "int | np.ndarray") -> int:
    """Smallest k in [lo, hi] with ``level[k:hi] + nb <= cap`` everywhere (``cap``: one bound,
    or one per function).

    Searches backwards from ``hi`` in growing blocks, so the cost is proportional to the
    distance found, not to the window.
    """
    k_hi = hi
    step = 256
    while k_hi > lo:
        k_lo = max(lo, k_hi - step)
        over = np.flatnonzero(level[k_lo:k_hi] > (cap - nb if isinstance(cap, int) else cap[k_lo:k_hi] - nb))
        if over.size:
            return k_lo + int(over[-1]) + 1
        k_hi = k_lo
        step *= 8
    return lo
