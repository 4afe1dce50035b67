"""The swap-out link while the window planner decides: when would this copy end?

A price per byte (``scheduler.recompute``: transfer time times an *exposure*) cannot see that
the link is a queue. On a GPU the forward produces activations faster than the host link
takes them: ResNet-50 b256 on the H200 runs its forward in 43 ms, in which 55 GB/s carry
2.2 GiB, and a plan at a quarter of the in-core peak that swapped 3.45 GiB there stalled the
forward 35 ms waiting for its copies (benchmarks/results/profiles.md, issue 38). Swapping a
tensor is nearly free while the link is idle and its copy ends before its bytes are needed;
it costs the whole wait when the queue is long.

``LinkClock`` keeps the device-to-host channel as the simulator runs it (``scheduler.simulate``:
one copy after another, first issued first served), on the step's in-core clock (each function
at the sum of the measured times before it, no recompute) shifted by the waits of the copies
booked so far (a wait delays every function after it, so the link catches up: without the
shift, on a link that cannot keep up, every later copy would seem to wait for the whole
backlog), and answers how long the compute stream would wait for a swap-out issued after
function ``last`` whose bytes are needed back before function ``at``. The planner adds that
wait to the swap's price, and books the copy when it swaps.
"""

from __future__ import annotations

from itertools import accumulate

from scheduler.hardware import Hardware
from scheduler.ir import VariableSequence

__all__ = ["LinkClock"]


class LinkClock:
    """The swap-out channel's queue on the in-core clock of ``seq`` on ``hw``."""

    def __init__(self, seq: VariableSequence, hw: Hardware) -> None:
        self.start = [0.0, *accumulate(hw.function_s(f.cost) for f in seq.functions)]
        self.latency = hw.link_latency_s
        self.inv_bw = 1.0 / hw.d2h_bandwidth
        self.free = 0.0    # when the channel is next idle
        self.delay = 0.0   # the waits booked so far

    def _end(self, nbytes: int, last: int) -> float:
        issued = self.start[last + 1] + self.delay   # the stream is in order: after f_last made it
        return max(self.free, issued) + self.latency + nbytes * self.inv_bw

    def stall_s(self, nbytes: int, last: int, at: int) -> float:
        """Seconds the compute stream would wait before f_``at`` for this copy (0: none)."""
        return max(0.0, self._end(nbytes, last) - self.start[at] - self.delay)

    def book(self, nbytes: int, last: int, at: int) -> None:
        """The copy is planned, its bytes needed back before f_``at``: the channel is busy
        until it ends, and what the compute stream waits for it delays what follows."""
        end = self._end(nbytes, last)
        self.delay += max(0.0, end - self.start[at] - self.delay)
        self.free = end
