"""Timelines as data, and one writer for Chrome / Perfetto traces.

Both the simulator (predicted times) and the runtime (measured times) describe a step as a
list of :class:`Event`: a slice of time on a named *track* ("compute", "swap-in",
"swap-out", "wait", or anything else). ``write_chrome_trace`` turns any such list into the
Trace Event Format that ``chrome://tracing`` and https://ui.perfetto.dev open: one thread per
track, complete events (``ph: "X"``) in microseconds, and a "step" track holding one slice per
training step so that a step's transfers and stalls line up under it.

Nothing here knows about schedules or torch; the runtime can import it as is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

COMPUTE = "compute"
SWAP_IN = "swap-in"
SWAP_OUT = "swap-out"
WAIT = "wait"
STEP = "step"
RECOMPUTE = "recompute"
ALLREDUCE = "all-reduce"

# Tracks in display order; others follow in order of first appearance.
TRACKS = (STEP, COMPUTE, WAIT, SWAP_IN, SWAP_OUT, RECOMPUTE, ALLREDUCE)


@dataclass(frozen=True, slots=True)
class Event:
    """``name`` ran on ``track`` from ``start_s`` to ``end_s`` (seconds from the trace's zero)."""

    track: str
    name: str
    start_s: float
    end_s: float
    step: int = 0
    args: dict[str, Any] | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def to_chrome_trace(events: Iterable[Event], *, process_name: str = "ooc") -> dict[str, Any]:
    """The trace as a dict (``{"traceEvents": [...], ...}``), ready for ``json.dump``.

    Each distinct track becomes one thread (tid) of one process, named by a ``thread_name``
    metadata event and ordered by ``thread_sort_index``. Unless the events already carry a
    "step" track, one "step N" slice per step spans that step's events.
    """
    events = list(events)
    tids: dict[str, int] = {}
    present = {e.track for e in events}
    has_step_track = STEP in present
    steps: dict[int, list[float]] = {}
    if not has_step_track:
        for e in events:
            span = steps.get(e.step)
            if span is None:
                steps[e.step] = [e.start_s, e.end_s]
            else:
                if e.start_s < span[0]:
                    span[0] = e.start_s
                if e.end_s > span[1]:
                    span[1] = e.end_s
        if steps:
            present.add(STEP)
    for track in TRACKS:
        if track in present:
            tids[track] = len(tids) + 1
    for e in events:
        if e.track not in tids:
            tids[e.track] = len(tids) + 1

    pid = 1
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name}}]
    for track, tid in tids.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}})
    for step, (start, end) in sorted(steps.items()):
        out.append(_slice(pid, tids[STEP], f"step {step}", start, end, step, None))
    for e in events:
        out.append(_slice(pid, tids[e.track], e.name, e.start_s, e.end_s, e.step, e.args))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "ooc", "time_unit_of_ts": "us"}}


def write_chrome_trace(events: Iterable[Event], path: str | os.PathLike[str], *,
                       process_name: str = "ooc") -> None:
    """Write ``events`` as a Chrome/Perfetto trace JSON file at ``path`` (atomically)."""
    data = to_chrome_trace(events, process_name=process_name)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, separators=(",", ":"))
    os.replace(tmp, path)


def _slice(pid: int, tid: int, name: str, start_s: float, end_s: float, step: int,
           args: dict[str, Any] | None) -> dict[str, Any]:
    a = {"step": step}
    if args:
        a.update(args)
    # Microseconds, as the format wants; rounded to the nanosecond so files stay short.
    ts = round(start_s * 1e6, 3)
    dur = round(max(0.0, end_s - start_s) * 1e6, 3)
    return {"ph": "X", "name": name, "cat": "ooc", "pid": pid, "tid": tid, "ts": ts,
            "dur": dur, "args": a}
