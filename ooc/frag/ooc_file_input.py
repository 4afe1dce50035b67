"""Read an ooc trace (``ooc.sequence``) or plan (``ooc.schedule``) JSON file into a
:class:`~ooc.frag.trace_data.Trace`: a trace replays with eager PyTorch lifetimes, a plan with
its swap-ins, swap-outs and frees.

Apart from the other readers: these inputs come from ``scheduler``, imported only here and
only when such a file is read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vmm.replay import Event

from ooc.frag.trace_data import FragInputError, Trace, _short

__all__ = ["load_ooc_json", "sequence_events"]


def load_ooc_json(path: str | os.PathLike[str]) -> Trace:
    """Events of an ooc trace (eager lifetimes) or plan (``scheduler.memory_events``)."""
    from scheduler.errors import SequenceFormatError
    from scheduler.ir import SCHEMA as SEQ_SCHEMA
    from scheduler.ir import VariableSequence
    from scheduler.schedule import SCHEMA as PLAN_SCHEMA
    from scheduler.schedule import Schedule

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            head = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FragInputError(f"{path}: not a JSON file ({_short(exc)})") from None
    schema = head.get("schema") if isinstance(head, dict) else None
    del head
    name = os.path.basename(path)
    try:
        if schema == SEQ_SCHEMA:
            seq = VariableSequence.from_json(path)
            return Trace(name=name, kind="sequence", events=sequence_events(seq),
                         labels=_labels(seq), notes=("eager lifetimes: each variable is allocated at its first use "
                                "(live_in ones at the start) and freed after its last use",))
        if schema == PLAN_SCHEMA:
            plan = Schedule.from_json(path)
            return Trace(name=name, kind="schedule", events=_plan_events(plan, path),
                         device_memory=plan.budget, device_memory_source="the plan's budget",
                         labels=_labels(plan.sequence),
                         notes=("allocations follow the plan's swap-ins, swap-outs and frees",))
    except SequenceFormatError as exc:
        raise FragInputError(str(exc)) from None
    raise FragInputError(f"{path}: a JSON file that is neither an ooc trace ({SEQ_SCHEMA}) nor an "
                         f"ooc plan ({PLAN_SCHEMA}) (schema is {schema!r})")


def _labels(seq: Any) -> dict[Any, str]:
    return {v: f"{var.name or var.kind.value} (variable {v}, {var.kind.value})"
            for v, var in seq.variables.items()}


def sequence_events(seq: Any) -> list[Event]:
    """Eager-PyTorch allocation events of a ``scheduler.VariableSequence``.

    ``live_in`` variables are allocated before the first function; any other variable just
    before the function that first uses it; a variable is freed right after its last use
    unless it is ``live_out``. Zero-byte variables take no memory and make no events. The peak
    live bytes of these events is ``seq.in_core_peak_bytes``. Times are function indices.
    """
    n = len(seq.functions)
    born: list[list[int]] = [[] for _ in range(n)]
    dies: list[list[int]] = [[] for _ in range(n)]
    start: list[int] = []
    first, last = seq.first_use, seq.last_use
    for v, var in seq.variables.items():
        if var.nbytes <= 0 or v not in first:
            continue  # no bytes, or never used: eager PyTorch never holds it during the step
        if var.live_in:
            start.append(v)
        else:
            born[first[v]].append(v)
        if not var.live_out:
            dies[last[v]].append(v)
    nb = {v: var.nbytes for v, var in seq.variables.items()}
    events = [Event("alloc", v, nb[v], 0.0) for v in start]
    for i in range(n):
        t = float(i)
        events.extend(Event("alloc", v, nb[v], t) for v in born[i])
        events.extend(Event("free", v, nb[v], t) for v in dies[i])
    return events


def _plan_events(plan: Any, path: str) -> list[Event]:
    try:
        from scheduler.memory_events import allocation_events
    except ModuleNotFoundError as exc:
        if exc.name != "scheduler.memory_events":
            raise
        raise FragInputError(
            f"{path}: an ooc plan; replaying plans needs scheduler.memory_events, which this ooc "
            f"does not have; run `ooc frag` on the trace the plan was made from") from None
    from scheduler.errors import ScheduleError

    try:
        events = allocation_events(plan)
    except ScheduleError as exc:
        raise FragInputError(f"{path}: {exc} (scheduler.check diagnoses the plan)") from None
    # Zero-byte variables take no device memory: no request reaches an allocator.
    return [e for e in events if e.nbytes > 0]

