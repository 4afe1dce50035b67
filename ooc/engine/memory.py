"""The budget and where managed bytes live: what the engine's parts share, and nothing else.

The engine (``out_of_core.py``) is composed of parts that each own their state: the persistent
store (``persistent.py``), the plan cache (``plan_cache.py``), the planner's adapter
(``planning.py``), the update guard (``update_hooks.py``), the step's end (``step_end.py``)
and its book (``step_book.py``). What they all read is here, made once by the engine and
handed to each at construction: the budget and chunk change only between steps
(``OutOfCore.set_budget``, the adaptive chunk, both through ``planning.Planner``), and a new
chunk brings a new pool, which every part then finds here.
"""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass, field

import torch

from ooc.engine.lifetime import Held
from ooc.runtime.pool import DevicePool
from ooc.storage.tier import SlowerTier

DEFAULT_CHUNK = 2 << 20   # the chunk a default engine starts with (the GPU's VMM granularity)


@dataclass(eq=False)
class EngineMemory:
    """The device, the budget and its pool, the slower tier, and the byte counters that
    every transfer adds to (``bytes_in``, ``bytes_out``, ``bytes_recomputed``,
    ``recompute_s``: the steps' ``StepContext`` shares them)."""

    device: torch.device
    budget: int                  # bytes of managed device memory
    chunk: int                   # the pool's chunk
    min_bytes: int               # storages below this stay with PyTorch
    tier: SlowerTier             # where swapped-out bytes live
    pool: DevicePool             # the budget's device memory
    held: Held                   # what a collected engine lets go of (follows the pool)
    arena: str = "pool"          # where swap-ins live on a GPU (ooc.Options.arena), for each new pool
    manage: frozenset[str] = frozenset({"activations"})   # the kinds that may leave (ooc.OutOfCore's manage)
    # Options(budget_covers="step"), ooc/engine/step_budget.py: the budget given for the whole
    # step (0: the budget covers the managed tensors only), what a step starts with, the most
    # its recording held beside the managed tensors, and what the engine's own records of its
    # steps take on the CPU (``step_budget.records_bytes``)
    step_budget: int = 0
    step_start: int = 0
    step_held: int = 0
    step_records: int = 0
    # the last step raised: the frames that hold its exception hold its tensors, in cycles the
    # collector may not reach for many steps, where the user's code makes one (ooc's own raises
    # make none since 2026-11-29: they held 96 MiB of a Llama's retried step); the next step
    # collects first (plan_cache.begin)
    raised: bool = False
    counters: Counter = field(default_factory=Counter)
    on_cpu: bool = field(init=False)   # the device is the CPU (an attribute: read several times a step)

    def __post_init__(self) -> None:
        self.on_cpu = self.device.type == "cpu"


def start_chunk(budget: int) -> int:
    """The adaptive chunk a CPU engine starts with: 2 MiB, or for a smaller budget the largest
    power of two within it (at least a page: a smaller budget is refused as below a chunk)."""
    if budget >= DEFAULT_CHUNK:
        return DEFAULT_CHUNK
    return max(mmap.PAGESIZE, 1 << (max(budget, 1).bit_length() - 1))
