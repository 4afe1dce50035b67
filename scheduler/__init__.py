"""Planning for out-of-core training: no torch, no CUDA, deterministic.

Read in this order: ``ir`` (what a step does to memory), ``schedule`` (what a plan says),
``window`` (the adaptive window planner of Hayakawa & Narihira), ``check`` (proof that a
plan is safe), ``simulate`` (what a plan costs on given hardware).
"""

from __future__ import annotations

from vmm.errors import OOCError
from vmm.units import format_size, parse_size

from scheduler.errors import BudgetTooSmall, ScheduleError, SequenceFormatError
from scheduler.ir import Access, Cost, Function, Kind, Use, Variable, VariableSequence, build_sequence
from scheduler.schedule import Action, Op, Schedule
from scheduler.check import CheckResult, check
from scheduler.planner import POLICIES, plan
from scheduler.hardware import PRESETS, Hardware, hardware
from scheduler.simulate import SimResult, simulate

__all__ = [
    "Access", "Action", "BudgetTooSmall", "CheckResult", "Cost", "Function", "Hardware", "Kind",
    "OOCError", "Op", "POLICIES", "PRESETS", "Schedule", "ScheduleError", "SequenceFormatError",
    "SimResult", "Use", "Variable", "VariableSequence", "build_sequence", "check", "format_size",
    "hardware", "parse_size", "plan", "simulate",
]
