"""Planning for out-of-core training: no torch, no CUDA, deterministic.

Read in this order: ``ir`` (what a step does to memory), ``schedule`` (what a plan says),
``window`` (the adaptive window planner of Hayakawa & Narihira), ``check`` (proof that a
plan is safe), ``simulate`` (what a plan costs on given hardware).

Public names are loaded on first use, so ``import scheduler`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # IR
    "Variable": "ir", "Function": "ir", "Use": "ir", "Cost": "ir", "Kind": "ir", "Access": "ir",
    "VariableSequence": "ir", "build_sequence": "ir",
    # plans
    "Action": "schedule", "Op": "schedule", "Schedule": "schedule",
    "plan": "planner", "POLICIES": "planner",
    "check": "check", "CheckResult": "check",
    "simulate": "simulate", "SimResult": "simulate",
    "hardware": "hardware", "Hardware": "hardware", "PRESETS": "hardware",
    # errors and units
    "BudgetTooSmall": "errors", "ScheduleError": "errors", "SequenceFormatError": "errors",
}

__all__ = sorted([*_EXPORTS, "OOCError", "parse_size", "format_size"])


def __getattr__(name: str) -> Any:
    if name in ("OOCError",):
        from vmm.errors import OOCError

        return OOCError
    if name in ("parse_size", "format_size"):
        from vmm import units

        return getattr(units, name)
    if name in _EXPORTS:
        module = importlib.import_module(f"scheduler.{_EXPORTS[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
