"""The one protocol every form of a step implements, and the forms a step can take.

A step runs in one of these forms (``FORMS``; ``stats()`` counts the steps of each as
``steps.<form>``, their sum is ``steps``, and ``last_form`` is the index of the last one's):

- ``recorded``: per op, on demand: no plan for the state and shape it starts in (the first
  step, a step after the budget changed), or a step whose plan's start was a guess; it
  records itself and the engine plans the next steps from it (``ooc/runtime/stepper.py``);
- ``planned``: per op, a plan kept to the end (``Stepper``);
- ``diverged``: per op, left its plan (data-dependent control flow): the rest ran on demand
  and the engine plans again from it;
- ``plain``: no op intercepted, the plan moves nothing (``AnchoredStep`` with no action);
- ``anchored``: no op intercepted, the plan's swaps run at autograd's saved-tensor hooks
  (``ooc/runtime/anchored_step.py``). A hook-driven step that leaves its plan stays counted
  in its form; ``last_diverged_at`` says it left.

Which form a step takes is decided once, by the engine's plan cache from what the scheduler
decided for the plan (``ooc/engine/plan_cache.py``). Every form is driven through ``Step``,
and ends through one routine (``ooc/engine/step_end.py``) that books one ``StepReport``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, TypeVar, runtime_checkable

import torch

from ooc.runtime.labels import label
from scheduler.schedule import Schedule

R = TypeVar("R")

FORMS = ("recorded", "planned", "diverged", "plain", "anchored")


class Timeline(Protocol):
    """What every step form keeps of its time: ``stall_s`` (blocked on transfers) and
    ``events`` (the timeline's (track, name, start, end))."""

    stall_s: float
    events: list[tuple[str, str, float, float]]


def waited(on: Timeline, name: str, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, a wait the step's thread sits through: its time is ``on``'s stall, a
    ``wait`` event on its timeline and a profiler's ``ooc.<name>`` range. Every form's waits
    come through here, so a stall means the same whichever form the step took."""
    t0 = time.perf_counter()
    with label("ooc.", name):
        out = fn(*args)
    t1 = time.perf_counter()
    on.stall_s += t1 - t0
    on.events.append(("wait", name, t0, t1))
    return out


@runtime_checkable
class Step(Timeline, Protocol):
    """What the engine drives and reads, whatever form the step takes.

    Attributes: ``start_key`` (the plan key it is booked under), ``schedule`` (the plan it
    follows, None on demand), ``planned`` (still following it), ``diverged_at`` (the op where
    it left it, None if it did not), ``updating`` (inside ``optimizer.step()``), ``rollback``
    (``ooc/runtime/rollback.py``), ``peak`` (managed bytes held at most), ``stall_s`` and
    ``events`` (time blocked on transfers; the timeline's (track, name, start, end))."""

    start_key: Hashable
    schedule: Schedule | None
    diverged_at: int | None
    updating: bool
    rollback: Any
    peak: int

    @property
    def planned(self) -> bool: ...

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks that see every saved activation of the step (pushed by the engine)."""

    def quiet(self) -> bool:
        """Nothing of the step touched managed memory yet (its form may still change)."""

    def close_node(self) -> None:
        """The backward's last node returned: what it unpacked is no longer held."""

    def wait_for_transfers(self, drain: bool = True) -> None:
        """The commit point's wait: every transfer in flight completes (or only failed ones)."""

    def update_starts(self) -> None:
        """``optimizer.step()`` begins: the step is no longer rolled back."""

    def update_done(self) -> None:
        """``optimizer.step()`` returned."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one finished step did, as the engine books it (``stats()``, the timeline)."""

    form: str                     # one of FORMS
    seconds: float                # the whole step, wall time
    stall_s: float                # blocked on transfers
    peak: int                     # managed bytes held at most
    diverged_at: int | None       # the op where it left its plan
    events: tuple[tuple[str, str, float, float], ...]
    kept_plan: bool = False       # it ran a plan to its end (not recorded, not diverged)


def form_of(st: Step) -> str:
    """The form ``st`` took (``FORMS``)."""
    form = getattr(st, "form", None)   # a hook-driven step's own ("plain", "anchored")
    if form is not None:
        return form
    if st.schedule is None:
        return "recorded"
    return "planned" if st.diverged_at is None else "diverged"
