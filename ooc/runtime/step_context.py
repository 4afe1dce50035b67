"""What one step needs from the engine that runs it, given explicitly.

The engine makes a ``StepContext`` at the start of each step and hands it to the ``Stepper``;
the stepper never sees the engine. Everything here holds for the whole step: the pool, the
chunk and the threshold change only between steps (``OutOfCore.set_budget``, the adaptive
chunk), and a new step gets a new context.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ooc.runtime.pool import DevicePool
from ooc.runtime.slots import Slot
from ooc.storage.tier import SlowerTier


@dataclass(frozen=True, slots=True)
class StepContext:
    """The engine's settings and resources for one step.

    ``counters`` is the engine's (its ``bytes_in``/``bytes_out`` grow as the step moves
    bytes, so that ``stats()`` counts every transfer wherever it happened); ``new_var``
    hands out variable ids from the engine's one sequence, so that ids stay unique across
    steps. Everything else is read only.
    """

    budget: int                     # bytes of managed device memory
    chunk: int                      # the pool's chunk: activations are planned in whole chunks
    min_bytes: int                  # storages below this stay with PyTorch
    manage: frozenset[str]          # which kinds of tensors may leave the device
    device: torch.device
    tier: SlowerTier                # where swapped-out bytes live
    pool: DevicePool                # the budget's device memory
    new_var: Callable[[], int]      # the next unused variable id
    counters: Counter               # the engine's counters (bytes_in, bytes_out)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    persistent: Iterable[Slot]      # the managed parameters, grads and state, as the step starts
    plan_runs: int = 0              # how often the step's plan ran before (0: its first run)
    start_key: Any = None           # the state the step starts in (the engine's plan key)
    plain_candidate: bool = False   # the plan moves nothing: note what the step saves (plain_step.py)
    trace_recording: bool = False   # a recording notes its hook trace: its plan gets its anchored form at once
    unformed: bool = True           # the plan has no hook-driven form yet: its templates watch the model's numbers
    quiet_ops: frozenset[int] = frozenset()   # ops the plan gives no role: run them as they come (stepper.py)
    time_ops: bool = False          # a GPU's planned step times its ops (CUDA events): its plan's prices are open
    # Options(budget_covers="step") with one arena: the step's budget for every tensor (less
    # the allocator's cache) and what the device holds for them now, which a step on demand
    # keeps within as well as its managed share (step_budget.on_demand_bound; 0, None: none)
    device_budget: int = 0
    device_live: Callable[[], int] | None = None
