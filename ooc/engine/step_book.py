"""What the engine keeps of the steps it ran: counts per form, the last step, the timeline.

Every step, whatever its form, ends in one ``StepReport`` (``ooc/runtime/step_protocol.py``)
that ``book`` counts: ``steps`` and ``steps.<form>`` (their sum is ``steps``), the last step's
numbers and form, and its events for ``OutOfCore.timeline``.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import Counter, deque
from typing import NamedTuple

from ooc.errors import OOCError
from ooc.runtime.step_protocol import FORMS, StepReport

# The timeline keeps the events of this many recent steps (and at most about 200,000 events),
# so that a long run's memory does not grow with its number of steps.
TIMELINE_STEPS = 32
MAX_EVENTS = 200_000


class _KeptStep(NamedTuple):
    """One step's events as the timeline keeps them: 24 bytes an event (a pointer to its
    (track, name) pair, shared from step to step, and two doubles), where a tuple of its own
    with two floats and its step's name strings took 210. A budget for the whole step covers
    the process: a 2-layer GPT-2's steps (1,100 events each) ran 4.6 MiB over it by the 32nd."""

    step: int
    labels: list[tuple[str, str]]
    times: array   # start, end of each event, in turn


class StepBook:
    """The steps booked so far: ``forms`` (form -> count), ``last`` (the last report) and
    ``events`` ((track, name, start, end, step) of the last ``TIMELINE_STEPS`` steps)."""

    def __init__(self) -> None:
        self.forms: Counter[str] = Counter()
        self.steps = 0
        self.last: StepReport | None = None
        self._recent: deque[_KeptStep] = deque(maxlen=TIMELINE_STEPS)
        self._kept = 0   # events in _recent
        # (track, name) -> itself: the names of a step's ops and transfers repeat every step,
        # and each step's events point to the one pair (cleared when it holds MAX_EVENTS).
        self._labels: dict[tuple[str, str], tuple[str, str]] = {}

    def book(self, report: StepReport) -> None:
        """Count the step, keep its timeline events and what ``stats()`` says of it."""
        self.steps += 1
        self.forms[report.form] += 1
        if len(self._recent) == TIMELINE_STEPS:   # the oldest step's events go
            self._kept -= len(self._recent[0].labels)
        self._recent.append(self._kept_step(report.events))
        self._kept += len(report.events)
        while self._kept > MAX_EVENTS and len(self._recent) > 1:
            self._kept -= len(self._recent.popleft().labels)
        self.last = dataclasses.replace(report, events=())   # (they are kept above)

    def _kept_step(self, events: tuple[tuple[str, str, float, float], ...]) -> _KeptStep:
        if len(self._labels) > MAX_EVENTS:
            self._labels.clear()
        shared, labels, times = self._labels, [], array("d")
        for track, name, t0, t1 in events:
            label = (track, name)
            labels.append(shared.setdefault(label, label))
            times.append(t0)
            times.append(t1)
        return _KeptStep(self.steps, labels, times)

    @property
    def events(self) -> list[tuple[str, str, float, float, int]]:
        """(track, name, start, end, step) of the steps kept, oldest first."""
        return [(track, name, kept.times[2 * k], kept.times[2 * k + 1], kept.step)
                for kept in self._recent for k, (track, name) in enumerate(kept.labels)]

    def stats(self) -> dict[str, int | float]:
        """``steps``, ``steps.<form>``, ``last_form`` (the index of the last step's form in
        ``FORMS``, -1 before the first) and the last step's numbers."""
        last = self.last
        out: dict[str, int | float] = {"steps": self.steps}
        for form in FORMS:
            out[f"steps.{form}"] = self.forms[form]
        out.update({
            "last_form": -1 if last is None else FORMS.index(last.form),
            "last_step_s": last.seconds if last else 0.0,
            "last_stall_s": last.stall_s if last else 0.0,
            "last_planned": int(last is not None and last.kept_plan),
            "last_diverged_at": -1 if last is None or last.diverged_at is None else last.diverged_at,
            "resident_peak_bytes": last.peak if last else 0,
        })
        return out

    def timeline(self, path: str) -> None:
        """Write the last steps as a Chrome/Perfetto trace (compute, swap, wait tracks)."""
        from scheduler.timeline import Event, write_chrome_trace
        events = self.events
        if not events:
            raise OOCError("no step has run yet: nothing to put on a timeline")
        t0 = events[0][2]
        write_chrome_trace([Event(track=tr, name=n, start_s=a - t0, end_s=b - t0, step=s)
                            for tr, n, a, b, s in events], path)
