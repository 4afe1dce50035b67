"""The hardware a CPU engine's plan is priced on: the preset, with this machine's swap file.

Why: the planner swaps or recomputes each activation the budget forces out, whichever its
simulator prices cheaper on a ``scheduler.hardware`` preset. On a CPU that preset is an edge
board swapping to flash at 1 GB/s each way; the machine the engine really runs on may be
faster or slower. On this project's 2-core VM the swap file moved 1.6 GB/s per I/O thread
(ResNet-50 batch 8 at 1/4), and priced at 1 GB/s the planner recomputed 250-310 MiB a step
that swapping would have moved for less: 1.25-1.30 s a step against 1.20 s for the same budget
swap-only, which it chose once priced at what the file measured (2026-11-25, with the pool's
pages shared with the CPU allocator). The recording step swaps on demand through the same
tier, so by the time the first plan is made the tier has timed real transfers.
"""

from __future__ import annotations

from typing import Any, Mapping

from scheduler.hardware import Hardware, hardware
from scheduler.ir import VariableSequence
from scheduler.recompute import default_hardware

__all__ = ["MIN_TIMED_BYTES", "priced_hardware"]

#: Below this many bytes timed in a direction, the preset's bandwidth stands (a few small
#: transfers are all latency and page faults, not the device's rate).
MIN_TIMED_BYTES = 64 << 20


def priced_hardware(seq: VariableSequence, tier_stats: Mapping[str, Any]) -> Hardware:
    """``default_hardware(seq)`` with the storage bandwidth of each direction the tier has
    timed enough of (``bytes_read`` / ``read_s``, ``bytes_written`` / ``write_s``: one I/O
    thread's rate, the conservative side where several run at once). A preset that swaps to
    host memory (a GPU's) or a tier without those counters is left as it is."""
    base = default_hardware(seq)
    if base.tier != "storage":
        return base
    changes = {}
    for field, nbytes, seconds in (("h2d_bandwidth", "bytes_read", "read_s"),
                                   ("d2h_bandwidth", "bytes_written", "write_s")):
        n, s = tier_stats.get(nbytes), tier_stats.get(seconds)
        if isinstance(n, int) and isinstance(s, float) and n >= MIN_TIMED_BYTES and s > 0:
            changes[field] = n / s
    return hardware(base, **changes) if changes else base
