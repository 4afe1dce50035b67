"""``OutOfCore.stats()``: counters and gauges with stable keys, the same on every device.

Like ``torch.cuda.memory_stats()``: a flat dict of numbers, every key there from the engine's
creation (0 before the first step, -1 for ``last_diverged_at`` and ``last_form``), the same
keys on a CPU and on a GPU (a tier's counter the other tier has not is 0: ``tier.host_syncs``
on the CPU, ``tier.file_bytes`` on the GPU; ``cpu_allocator.*`` is 0 on a GPU). Settings are
not stats (the tier's threads, its directory, whether it verifies): only ``budget`` and
``chunk``, which the engine itself changes. The keys: docs/guide/budgets.md.
"""

from __future__ import annotations

from typing import Any

from ooc.engine.memory import EngineMemory
from ooc.engine.plan_cache import PlanCache
from ooc.engine.step_book import StepBook
from ooc.host import cpu_allocator

# The numbers of ``Schedule.summary()`` that ``stats()`` gives as ``plan.<key>``.
PLAN_STAT_KEYS = ("budget", "window", "functions", "variables", "in_core_peak_bytes",
                  "peak_resident_bytes", "bounded_peak_bytes", "bytes_in", "bytes_out", "bytes_recomputed")
# The slower tier's counters that ``stats()`` gives as ``tier.<key>``, from either tier (the CPU
# swap file, the GPU's pinned memory), 0 where one has no such thing.
TIER_STAT_KEYS = ("bytes_written", "bytes_read", "writes", "reads", "failed", "write_s", "read_s",
                  "wait_s", "host_syncs", "live_bytes", "peak_live_bytes", "keys", "in_flight",
                  "file_bytes", "peak_file_bytes", "direct_transfers", "buffered_transfers",
                  "pinned_bytes", "peak_pinned_bytes", "slabs")


def engine_stats(book: StepBook, mem: EngineMemory, plans: PlanCache, reads: Any) -> dict[str, int | float]:
    """The engine's stats from its parts: the steps (``book``), the bytes moved and the
    budget (``mem``), the plan in use (``plans``) and reads between steps (``reads``)."""
    counters = mem.counters
    ran = plans.ran or plans.schedule   # a hook-driven step ran its own plan
    plan = ran.summary() if ran is not None else {}
    out: dict[str, int | float] = book.stats()
    out.update({
        "plans": counters["plans"],
        "plans_kept": len(plans.plans),
        "bytes_in": counters["bytes_in"],
        "bytes_out": counters["bytes_out"],
        "bytes_recomputed": counters["bytes_recomputed"],
        "recompute_s": float(counters["recompute_s"]),
        "budget": mem.budget,
        "step_budget": mem.step_budget,
        "step_held_bytes": mem.step_held,
        "step_records_bytes": mem.step_records,
        "chunk": mem.chunk,
        "pool_peak_mapped_bytes": mem.pool.stats().get("peak_mapped_bytes") or 0,
    })
    for key in PLAN_STAT_KEYS:
        out[f"plan.{key}"] = plan.get(key) or 0
    out.update(reads.stats())   # between_steps.*: reads between steps
    tier = mem.tier.stats()
    for key in TIER_STAT_KEYS:
        value = tier.get(key) or 0
        out[f"tier.{key}"] = int(value) if isinstance(value, bool) else value
    allocator = cpu_allocator.stats() if mem.on_cpu else None
    for key in cpu_allocator.STAT_KEYS:
        out[f"cpu_allocator.{key}"] = (allocator or {}).get(key, 0)
    return out
