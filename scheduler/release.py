"""Step (b) placed by time: where a victim's memory comes back to the budget.

The window planner (``scheduler.window``) swaps a victim out right after its last use and,
by default, waits for that copy at the overflow point that chose it: the latest place, so the
copy has the most compute to hide behind. But until that wait the planner counts the victim's
bytes as held, and step (a) cannot issue a swap-in into them. On VGG16 at 3/8 of its peak, with
every kind managed, the first layers' activations left in the first 40 ms of the forward, their
writes were done by 41 ms, and the deep layers' weights (9 MiB each), which needed that room,
were read only at their own use at 125-170 ms: three stalls of 5-9 ms, and three more at the
end of the backward for the same reason (wait 0.063 s of a 0.59 s step).

A release rule gives the wait an earlier place: the first function that starts once the copy,
issued after the victim's last use, has had its transfer time on the hardware (op seconds as
measured, else the roofline). The copy is then done (no stall) and its bytes can take a
prefetch. The rule only moves waits earlier, between the victim's last use and the overflow
point, so every plan stays within the budget and moves the same bytes; whether it is faster
depends on the link's queue, which the rule ignores, so ``scheduler.recompute`` keeps it only
where ``scheduler.simulate`` predicts a faster step.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Callable

from scheduler.hardware import Hardware
from scheduler.ir import VariableSequence

__all__ = ["Release", "timed_release"]

#: ``release(v, last, at)``: the function in ``last + 1 .. at`` before which victim ``v``'s
#: swap-out (issued after its last use ``last``; chosen at the overflow point ``at``) is
#: waited for and its bytes come back (``scheduler.window.plan_window``'s option).
Release = Callable[[int, int, int], int]


def timed_release(seq: VariableSequence, hw: Hardware) -> Release:
    """The rule ``release(v, last, at)``: the first function after ``last`` (the victim's last
    use, after which its swap-out is issued) that starts at least one transfer of ``v`` later
    (``Hardware.transfer_s``), and never later than ``at`` (the overflow point)."""
    starts = list(itertools.accumulate((hw.function_s(f.cost) for f in seq.functions), initial=0.0))
    nbytes = {v: var.nbytes for v, var in seq.variables.items()}

    def release(v: int, last: int, at: int) -> int:
        done = starts[last + 1] + hw.transfer_s(nbytes[v], to_device=False)
        return min(bisect.bisect_left(starts, done, last + 1, at + 1), at)

    return release
