"""The plans an engine keeps, and the step that runs one: the only place a step's form is chosen.

A plan holds for the state a step starts in (``PersistentStore.start_key``: managed persistent
tensors, which parameters have a gradient, the caller's kind) and the shape it has
(``step_forms.shape_of``: the shapes and dtypes the model's forward is called with, its
training mode and autograd's, the ops the step ran before it). Gradient accumulation
alternates two such states, and dynamic padding varies the shape: plans are kept per (start,
shape), at most ``max_plans`` (under a budget for the whole step, no more functions than it
keeps records of: ``step_budget.plans_over_records``), the least recently used evicted first,
with what was made of each (its prices, ``repriced``; its hook-driven form, ``hook_forms.py``).

The shape shows only when the forward starts, after the step began: it begins with the plan of
the shape its start's last step had (the guess), and the model's forward pre-hook
(``forward_starts``) switches it to the plan of the shape it has, if nothing of it touched
managed memory yet (``step_forms.py``); a shape without a plan is recorded by that step. A
guess that cannot be switched diverges where its plan differs, and the step is re-planned
under the shape it had: no other shape's plan is lost (a batch made in the step in one of a
few ways, timm's mixup or cutmix, keeps a plan for each: a hook-driven step, which sees no op,
is taken to have run its guess's). Shapes that differ only in what the data
makes inside the step (a detection model's targets), or in sizes that keep their ops (dynamic
padding), share one plan of their size (``alias``, ``kin``).

The form (``ooc/runtime/step_protocol.py``) follows from the plan and what the scheduler made
of it (``step_for``): none, per op on demand (recorded); a hook-driven form whose turn it is,
that (plain or anchored); else per op, planned.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable

from ooc.engine.hook_forms import HookForms
from ooc.engine.memory import EngineMemory
from ooc.engine.persistent import PersistentStore
from ooc.engine.step_budget import plans_over_records
from ooc.engine.step_forms import UNSEEN, StepForm, same_kind, same_size, shape_elements, shape_of, size_class
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.binding import begins_with
from ooc.runtime.stepper import Stepper
from scheduler.schedule import Schedule, quiet_functions
from scheduler.step_plans import hook_forms_allowed, moves_nothing, plain_candidate
from scheduler.widening import sizes_vary

log = logging.getLogger(__name__)

# Shapes that run another shape's plan (``PlanCache.aliases``), least recently used out.
MAX_ALIASES = 4096
# Plans kept (start x shape), least recently used out. A plan holds its step's sequence: GPT
# 6x256 at 256 tokens, 1,858 ops, ~1.3 MiB of Python objects with its anchored form and prices
# (benchmarks/results/shapes.md).
MAX_PLANS = 16
# Steps of a size (``step_forms.size_class``) that run a larger plan whose sizes vary before the
# size takes a plan of its own (``PlanCache.kin``).
SPLIT_AFTER = 2

Plan = tuple[Schedule, dict[tuple[int, int], int]]   # a plan and its binding ((op, out) -> var)


class PlanCache:
    """Plans by key, the running step's plan (``schedule``, ``binding``) and form (``form``),
    and the step objects that run them. ``new_stepper(key, schedule, binding, plain_candidate,
    plan_runs, quiet_ops)`` makes a per-op step (the engine's, which knows its context)."""

    def __init__(self, mem: EngineMemory, store: PersistentStore, model: Any, *, activations_only: bool,
                 activations: bool, hook_steps: bool, max_plans: int,
                 new_stepper: Callable[..., Stepper]) -> None:
        self._mem, self._store, self._model, self._new_stepper = mem, store, model, new_stepper
        self._activations_only, self._activations = activations_only, activations
        self.plans: OrderedDict[tuple[Hashable, Any], Plan] = OrderedDict()
        self.max_plans = max_plans
        self.hooked = HookForms(hook_steps)
        # start key -> (planned runs priced, the sequence at the fastest times so far): ``scheduler.step_plans.reprice``
        self.repriced: dict[object, tuple[int, Any]] = {}
        self._shapes: OrderedDict[Hashable, Any] = OrderedDict()   # start -> its last step's shape
        # (start, shape) -> the key of the plan its steps run: shapes of a start whose sizes vary
        # with the data run one plan (``alias``)
        self.aliases: OrderedDict[tuple, tuple] = OrderedDict()
        self._sizes: OrderedDict[tuple, int] = OrderedDict()   # (start, size class) -> steps seen (``kin``)
        self._befores: dict[tuple[str, ...], tuple[str, ...]] = {}   # the ops before a forward, as keys hold them
        self.sibling: tuple | None = None   # the running step records a new shape: a plan of its size (``kin``)
        self._plan_runs: dict[int, int] = {}   # id of a plan -> how often it ran before
        self._quiet: tuple[Schedule, frozenset[int]] | None = None   # the last plan's quiet ops
        self.schedule: Schedule | None = None   # the running (or last) step's plan and binding
        self.binding: dict[tuple[int, int], int] = {}
        self.ran: Schedule | None = None   # the hook-driven plan the last step ran (stats' plan.*)
        self.form: StepForm | None = None   # the running step's form (step_forms.py)

    # -- which plan, which form ----------------------------------------------------------------

    def begin(self, start: Hashable) -> StepForm:
        """The plan and form of a step that starts in ``start``: the plan of the shape its
        start's last step had, until the forward shows the step's own (``forward_starts``).
        With plans for several shapes of this start, the step runs per op until then: a
        hook-driven form is taken up at the forward, where the mode can come off."""
        if self._mem.raised:   # (EngineMemory.raised)
            self._mem.raised = False
            gc.collect()
        key = self.guess(start)
        self.sibling = None
        provisional = len([s for s, _ in self.plans if s == start]) > 1
        self.schedule, self.binding = self._use_plan(key)
        self._store.reconcile(self.schedule)
        st = self.step_for(key, per_op=provisional)
        if provisional and isinstance(st, Stepper) and st.planned:   # its ops bound at the forward
            st.wait_for_shape()
        self.form = StepForm(start, st, activations=self._activations, provisional=provisional)
        return self.form

    def guess(self, start: Hashable) -> tuple[Hashable, Any]:
        """The plan key a step that starts in ``start`` begins with: the shape of its start's
        last step (None where no forward was seen: a model not called through its forward)."""
        return start, self._shapes.get(start)

    def step_for(self, key: tuple, *, per_op: bool = False) -> Stepper | AnchoredStep:
        """The step that runs ``self.schedule`` for ``key``: its hook-driven form if the
        scheduler made one and it is its turn (not ``per_op``), else per op."""
        st = None if per_op else self._hook_step(key)
        self.ran = getattr(st, "anchored", None)
        if st is None:
            runs = self._plan_runs.get(id(self.schedule), 0) if self.schedule is not None else 0
            st = self._new_stepper(key, self.schedule, self.binding, self.plain_candidate(), runs,
                                   self.quiet_ops())
        return st

    def quiet_ops(self) -> frozenset[int]:
        """The ops of the running plan that its per-op steps only run and record
        (``scheduler.schedule.quiet_functions``), once per plan; none unless activations
        alone are managed (a managed parameter, gradient or state is brought back and
        released by the per-op path's look at each use)."""
        schedule = self.schedule
        if schedule is None or not self._activations_only:
            return frozenset()
        if self._quiet is None or self._quiet[0] is not schedule:
            self._quiet = schedule, quiet_functions(schedule, {op for op, _ in self.binding})
        return self._quiet[1]

    @property
    def hook_forms(self) -> bool:
        """Whether this engine's plans may take a hook-driven form now
        (``scheduler.step_plans.hook_forms_allowed``). Read at each use: ``hooked.enabled`` is
        the switch, which benchmarks and tests turn off on a live engine to force the per-op
        path."""
        return hook_forms_allowed(activations_only=self._activations_only, enabled=self.hooked.enabled)

    def plain_candidate(self) -> bool:
        """Whether the running step notes what it saves (``scheduler.step_plans.plain_candidate``)."""
        return plain_candidate(self.schedule, hook_forms=self.hook_forms)

    def _hook_step(self, key: tuple) -> AnchoredStep | None:
        mem = self._mem
        if not self.hook_forms:
            return None

        def make(plan: Schedule, moved: Schedule, trace: Any, templates: Any) -> AnchoredStep:
            if moved is plan:   # it moves nothing: no action, and the pool's idle chunks go back
                mem.pool.trim()
                moved = None
            return AnchoredStep(plan, moved, trace, budget=mem.budget, min_bytes=mem.min_bytes, tier=mem.tier,
                                pool=mem.pool, model=self._model, start_key=key, templates=templates)
        return self.hooked.step(key, self.schedule, make)

    def _use_plan(self, key: tuple) -> tuple[Schedule | None, dict]:
        """``key``'s plan and binding, counted as a run."""
        schedule, binding = self.plans.get(key, (None, {}))
        if schedule is not None:   # how often this plan ran before (see Stepper._diverge)
            self._plan_runs[id(schedule)] = self._plan_runs.get(id(schedule), -1) + 1
        return schedule, binding

    def forward_starts(self, args: tuple, kwargs: dict) -> Stepper | AnchoredStep | None:
        """The model's forward began: the step's shape is known. A step that guessed another
        shape's plan, or waits per op for its shape, runs the plan of the shape it has (on
        demand, recorded, if there is none), provided nothing of it touched managed memory yet
        (``StepForm.quiet``) and that plan begins with the ops it ran. Returns the new step
        object, if the step switched."""
        form = self.form
        if form is None or form.shape is not UNSEEN:   # between steps, or not its first forward
            return None
        st = form.st
        ran = tuple(st.rec.names) if isinstance(st, Stepper) else ()   # ops before the forward (x[:, :-1])
        its_guess = st.start_key[1]   # a hook-driven step sees none: taken to have run its guess's
        before = ran if isinstance(st, Stepper) or its_guess is None else its_guess[3]
        if len(self._befores) > MAX_ALIASES:
            self._befores.clear()
        before = self._befores.setdefault(before, before)   # one tuple for every key that has it
        form.shape = shape = shape_of(self._model, args, kwargs, before)
        key = self.aliases.get((form.start, shape), (form.start, shape))
        if key not in self.plans:   # a plan whose sizes vary, for shapes of its size
            key = self.kin(form.start, shape) or key
        self._shapes[form.start] = key[1]
        self._shapes.move_to_end(form.start)
        while len(self._shapes) > self.max_plans:
            self._shapes.popitem(last=False)
        if st.start_key == key and not form.provisional:   # the guess was right
            return None
        guessed, st.start_key = st.start_key, key   # booked under its shape, whatever plan it runs
        schedule, binding = self.plans.get(key, (None, {}))
        if schedule is None:   # recorded, then maybe planned widened against a plan of its size (``alias``)
            self.sibling = self.kin(form.start, shape, varying=False)
        if schedule is None and isinstance(st, Stepper) and (not st.planned or ran):
            if st.planned:   # the guess, after ops of its own: left here, the rest recorded on demand
                st.leave_plan(f"the step's shape {shape[:3]} after {len(before)} op(s) has no plan")
            return None
        if not (form.quiet() and form.innermost() and (schedule is None or begins_with(schedule, ran))):
            log.info("the step's shape has %s plan, but the step touched managed memory before its "
                     "forward: it runs the plan it began with", "no" if schedule is None else "another")
            _end_wait(st)
            return None
        kept = self.schedule, self.binding, self.ran
        self.schedule, self.binding = schedule, binding
        hooks_only, per_op = form.can_drop_mode(), key != guessed and form.can_run_per_op()
        new = None
        try:
            with form.paused():   # making the next step object runs ops that are not the step's
                new = self._hook_step(key) if hooks_only else None
                if new is None and per_op:
                    self._store.reconcile(schedule)
                    new = self.step_for(key, per_op=True)
        finally:
            if new is None:   # it keeps its form and plan (or a transfer failed: the step fails)
                self.schedule, self.binding, self.ran = kept
        if new is None:
            _end_wait(st)
            return None
        if key != guessed:
            if kept[0] is not None:
                self._plan_runs[id(kept[0])] -= 1   # the guess did not run
            self._use_plan(key)
        form.switch(new)
        self.ran = getattr(new, "anchored", None)
        return new

    # -- keeping plans -------------------------------------------------------------------------

    def plan_of(self, key: Hashable) -> Schedule | None:
        return self.plans.get(key, (None,))[0]

    def key_of(self, schedule: Schedule | None) -> tuple | None:
        """The key whose plan ``schedule`` is, if it is kept."""
        return next((key for key, (plan, _) in self.plans.items() if plan is schedule), None)

    def alias(self, key: tuple, to: tuple) -> None:
        """Steps of ``key`` run ``to``'s plan from now on. Where a start's plan holds sizes that
        vary with the data (``scheduler/widening.py``), a step of a shape it has no plan for runs
        that plan, and one that ran it (kept to it, or left it only for sizes the plan then
        widened for) makes its shape an alias; so does the first step of a new shape, recorded
        or left at its forward, whose ops and first activation are those of the plan it guessed
        (``sibling``). Why: a detection model's forward takes the targets, whose box counts per
        image make a new shape at nearly every step, each recorded once when every shape kept
        its own plan."""
        if key != to:
            self.aliases[key] = to
            self.aliases.move_to_end(key)
            self._shapes[key[0]] = to[1]   # its start's next step begins with the family's plan
            while len(self.aliases) > MAX_ALIASES:
                self.aliases.popitem(last=False)

    def family(self, st: Stepper) -> tuple | None:
        """The key whose plan a per-op step of a shape without one ran, or guessed before it
        recorded (``alias``, ``sibling``), for widening against it. A step that ran its guess past
        the forward's start (ops of its own before it: a mask, a copy to the device) and left
        it there is that guess's kin as much as one that recorded from the forward on: else
        every new shape of a loop that makes its attention mask inside the step was planned
        on its own, none sharing a widened plan."""
        if self.plan_of(st.start_key) is st.schedule is not None:
            return None
        sibling = self.sibling if self.sibling in self.plans and self.sibling != st.start_key else None
        if st.schedule is None:
            return sibling
        if sizes_vary(st.schedule.sequence):   # ran another shape's plan (it began so): of its size?
            key = self.key_of(st.schedule)
            return key if key is not None and (same_size(key[1], st.start_key[1]) or not self.room()) else None
        return sibling if sibling is not None and self.plan_of(sibling) is st.schedule else None

    def kin(self, start: Hashable, shape: Any, *, varying: bool = True) -> tuple | None:
        """The key of the most recently used plan of ``start`` whose shape is of ``shape``'s size
        (``step_forms.same_size``) and whose sizes vary (a new shape runs it), or any such plan
        (``varying`` False: one a new shape's recording is widened against). Not the last
        step's plan whatever its size: on lengths drawn from a wide range, one plan held every
        activation at the longest's size, and short steps moved what would have fit. Where no
        plan is of its size and none more would be kept without evicting one (``room``), the
        least of those of larger shapes, else the largest: a plan per size under a step budget,
        whose plans hold four steps' records, evicted each other. A size first seen runs the
        least larger plan too (``SPLIT_AFTER``): its own plan costs a step on demand or two,
        which a size that does not come back never repays."""
        kin = self._of_kind(start, shape, varying=varying)
        alike = next((key for key in kin if same_size(key[1], shape)), None)
        if alike is not None or not kin:
            return alike
        larger = [key for key in kin if shape_elements(key[1]) >= shape_elements(shape)]
        nearest = min(larger or kin, key=lambda key: shape_elements(key[1]) * (1 if larger else -1))
        if larger and moves_nothing(self.plans[nearest][0]):   # it fits at a larger size: so does this one
            return nearest
        if larger and varying and self._sighted(start, shape) < SPLIT_AFTER:   # a size seen once runs it
            return nearest
        return None if self.room() else nearest

    def _sighted(self, start: Hashable, shape: Any) -> int:
        """Steps of ``start`` with no plan of their size so far whose shape was of ``shape``'s
        size class, this one included (``kin``: a size seen once takes no plan of its own)."""
        size = (start, size_class(shape))
        self._sizes[size] = self._sizes.pop(size, 0) + 1
        while len(self._sizes) > MAX_ALIASES:
            self._sizes.popitem(last=False)
        return self._sizes[size]

    def _of_kind(self, start: Hashable, shape: Any, *, varying: bool) -> list[tuple]:
        """Keys of the plans of ``start`` whose shapes are ``shape``'s but for their sizes
        (``step_forms.same_kind``), whose sizes vary unless not ``varying``, the most recently
        used first."""
        return [key for key in reversed(self.plans) if key[0] == start and same_kind(key[1], shape)
                and (not varying or sizes_vary(self.plans[key][0].sequence))]

    def founds(self, st: Stepper | AnchoredStep) -> bool:
        """Whether ``st``, with no plan for its shape, is of a kind whose plans' sizes vary
        here (``kin``): the first of its size, whose plan is marked so (``StepFacts.founds``)."""
        key = st.start_key
        return isinstance(key, tuple) and key not in self.plans and bool(self._of_kind(*key, varying=True))

    def room(self) -> bool:
        """Whether one more plan, as long as the longest, would be kept beside these without
        evicting one (``keep``)."""
        functions = self._functions()
        return not self._over([*functions, max(functions, default=0)])

    def _functions(self) -> list[int]:
        """The functions of each plan kept, least recently used first."""
        return [len(plan.sequence.functions) for plan, _ in self.plans.values()]

    def _over(self, functions: list[int]) -> bool:
        """Whether plans of ``functions`` functions each are more than are kept: more than
        ``max_plans``, or (under a budget for the whole step) more functions than it keeps
        records of (``step_budget.plans_over_records``)."""
        return len(functions) > self.max_plans or plans_over_records(functions, self._mem)

    def used(self, key: Hashable) -> None:
        """``key``'s plan ran: the most recently used (least recently used out)."""
        if key in self.plans:
            self.plans.move_to_end(key)

    def keep(self, key: Hashable, schedule: Schedule, binding: dict) -> None:
        """``schedule`` is ``key``'s plan from now on; what was made of the one before goes."""
        self.drop(key)
        self.plans[key] = (schedule, binding)
        self.schedule, self.binding = schedule, binding
        while len(self.plans) > 1 and self._over(self._functions()):
            self.drop(next(iter(self.plans)))   # the least recently used go

    def prices(self, key: Hashable) -> tuple[int, Any]:
        """``key``'s planned runs priced so far and the sequence at their fastest op times
        (``(0, None)``: priced on its recording alone)."""
        return self.repriced.get(key, (0, None))

    def replace(self, key: Hashable, schedule: Schedule) -> None:
        """``key``'s plan re-priced: ``schedule`` instead, same binding, same prices so far."""
        self.plans[key] = (schedule, self.plans[key][1])

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s plan and what was made of it (prices, hook-driven form)."""
        entry = self.plans.pop(key, None)
        if entry is not None:
            self._plan_runs.pop(id(entry[0]), None)
        self.repriced.pop(key, None)
        self.hooked.drop(key)

    def clear(self) -> None:
        """Every plan goes (a new chunk: the next step records again)."""
        self.plans.clear()
        self.aliases.clear()
        self._plan_runs.clear()
        self.repriced.clear()
        self.hooked.clear()
        self.schedule, self.binding = None, {}


def _end_wait(st: Stepper | AnchoredStep) -> None:
    """The step runs the plan it has: one that waited for its shape binds what its ops made."""
    if isinstance(st, Stepper):
        st.end_wait()
