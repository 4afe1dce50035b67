"""ooc: out-of-core training for PyTorch.

Record one training step, plan when each tensor leaves the device and comes back with a
byte-window scheduler, keep the device pool unfragmented with fixed-size chunks mapped on
virtual ranges, and run the plan with transfers overlapped with compute::

    import ooc
    engine = ooc.OutOfCore(model, optimizer, budget="512MiB")
    for x, y in loader:
        with engine.step():
            loss_fn(model(x), y).backward()
            engine.optimizer_step()

This package is the import surface: the planner (``scheduler``) and the allocator (``vmm``)
are reached through the names re-exported here.
"""

from __future__ import annotations

import importlib
from typing import Any

from ooc.errors import BudgetTooSmall, OOCError, OutOfBudget, StorageError
from vmm.units import format_size, parse_size

__version__ = "0.1.0"

_EXPORTS = {
    "OutOfCore": "ooc.engine",
    "Options": "ooc.engine",
    "FORMS": "ooc.engine",
    "trace": "ooc.trace",
    "models": "ooc.models",
    "plan": "scheduler.planner",
    "check": "scheduler.check",
    "simulate": "scheduler.simulate",
    "hardware": "scheduler.hardware",
    "VariableSequence": "scheduler.ir",
    "Schedule": "scheduler.schedule",
}

__all__ = sorted([*_EXPORTS, "OOCError", "BudgetTooSmall", "OutOfBudget", "StorageError",
                  "format_size", "parse_size"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if name == "models" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ooc' has no attribute {name!r}")
