"""The engine's side of planning: it asks ``scheduler`` after each step, and does what it says.

After a step, ``Planner.after_step`` gives the scheduler's one planning entry point
(``scheduler.step_plans.after_step``) the step's facts (its form, its recording and measured
op times, where its hooks ran) and the plan's state (its prices so far, its hook-driven form),
and executes the ``Decision`` it gets back on the plan cache (``plan_cache.py``): keep a new or
re-priced plan, give it a plain or anchored form, time a side of its trial, or drop it. The
engine decides nothing about plans itself; the one choice made here is the chunk's, through
``scheduler.chunk_size`` (a new chunk means a new pool, and the next step records again).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import scheduler
from ooc.engine.hook_forms import HookPlan
from ooc.engine.chunk_choice import ChunkChoice
from ooc.engine.host_pricing import priced_hardware
from ooc.engine import step_budget
from ooc.engine.lifetime import close_pool
from ooc.engine.memory import EngineMemory, start_chunk
from ooc.engine.pin_policy import PinFn, pins_of
from ooc.engine.plan_cache import PlanCache
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.devices import make_pool
from ooc.runtime.hook_trace import HookTrace
from ooc.runtime.step_protocol import StepReport
from ooc.runtime.stepper import Stepper
from scheduler.chunk_size import UNMANAGED_SHARE
from scheduler.step_plans import (Decision, PlanState, Settings, StepFacts, after_step, plans_again,
                                  prices_open)
from scheduler.widening import sizes_vary
from vmm.units import format_size

log = logging.getLogger(__name__)

FIRST_SKIP = next(n for n in range(64) if not plans_again(n))   # the first step not planned from
UNKEPT_KEYS = 256   # plan keys whose steps in a row that kept no plan are counted (shapes never seen again go)


class Planner:
    """What the engine asks the scheduler, with its settings: ``window``, ``policy``,
    ``recompute`` ("auto", "never", "prefer") and ``pin``; and the chunk (``chunks``: with the
    default chunk, chosen at each budget's first recording, halved before a refusal). ``adopt_params``
    manages the parameters a smaller threshold reaches (the persistent store's)."""

    def __init__(self, mem: EngineMemory, cache: PlanCache, *, window: int | None, policy: str,
                 recompute: str, pin: PinFn | None, adaptive: bool,
                 adopt_params: Callable[[], None]) -> None:
        self._mem, self._cache = mem, cache
        # plan key -> the templates its last per-op step captured (a re-priced plan runs the same
        # ops): a function whose numbers changed since is not rerun at the hooks (``Templates.ready``)
        self._templates: dict[Any, Any] = {}
        self.window, self.policy, self.recompute, self.pin = window, policy, recompute, pin
        self.chunks = ChunkChoice(adaptive)
        self._adopt_params = adopt_params
        self._told_held = False   # said once: what the backward reads that no hook saw
        self._unkept: dict[Any, int] = {}   # plan key -> its steps in a row that kept no plan
        # plan key -> the plan a hook-driven step left (dropped: the next step records) and its
        # binding: that recording is planned widened against it (``scheduler.widening``)
        self._left: dict[Any, tuple] = {}
        # plans priced again on their first planned runs (step_plans.reprice); benchmarks turn
        # it off on a live engine to measure what it buys (bench_gpu's "priced-once" rows)
        self.reprice = True
        # Options(budget_covers="step"): the managed budget is fitted at the next recording step
        self.fit_pending = bool(mem.step_budget)

    def settings(self) -> Settings:
        """What the scheduler plans with, now (the budget and chunk change between steps)."""
        mem, pin = self._mem, self.pin
        tier = mem.tier
        return Settings(budget=mem.budget, chunk=mem.chunk, window=self.window, policy=self.policy,
                        recompute=self.recompute, device_budget=mem.step_budget and step_budget.device_budget(mem),
                        pins=None if pin is None else (lambda seq: pins_of(seq, pin)),
                        hardware=lambda seq: priced_hardware(seq, tier.stats()),   # this machine's swap file
                        reprice=self.reprice, hook_forms=self._cache.hook_forms, gpu=not mem.on_cpu)

    def times_ops(self, key: object, schedule: scheduler.Schedule | None) -> bool:
        """Whether a GPU's planned per-op step of ``schedule`` (plan key ``key``) times its ops
        with CUDA events: while the plan's prices are open (``scheduler.step_plans.prices_open``;
        the recording step's ops ran on a cold allocator). A CPU's steps time every op anyway."""
        if self._mem.on_cpu or schedule is None:
            return False
        return prices_open(schedule, self._cache.prices(key)[0], self.settings())

    def after_step(self, st: Stepper | AnchoredStep, report: StepReport, whole: Any = None) -> None:
        """Ask the scheduler what follows from a step that completed (``scheduler.step_plans.
        after_step``), and do it. Only the chunk is chosen here first: a recording step under
        the default chunk may choose another (``adapt_chunk``), and then the next step records
        again instead; and a budget for the whole step, the managed budget (``fit_step``, from
        the step's ``whole`` recording)."""
        if isinstance(st, Stepper):
            st.book_device_times()   # the ops' run times on a GPU, where the step timed them
            if st.schedule is None and not self._told_held:
                self._tell_held(st)
        if isinstance(st, Stepper) and (st.schedule is None or st.diverged_at is not None):
            if self.adapt_chunk(st):
                overflow = st.forgive_overflow()
                if overflow is not None:   # the next step records again, in the new chunks
                    log.warning("the recording step went over the pool once (%s); the next step "
                                "records again with %s chunks", overflow, format_size(self._mem.chunk))
                return
        recorded = None   # the step as planned from, made once: a budget for the whole step fits it first
        if self._mem.step_budget and whole is not None and isinstance(st, Stepper) and st.schedule is None:
            recorded = self._recorded(st)
            try:
                self.fit_step(st, recorded, whole)
            except scheduler.BudgetTooSmall as err:
                return self._refused(st, err)
        cache, key = self._cache, st.start_key
        family = self._cache.family(st) if isinstance(st, Stepper) else None   # (no call in a plain step)
        if family is not None and st.schedule is not None and st.diverged_at is None:   # ran its plan whole:
            cache.alias(key, family)   # one of that plan's runs, priced and given its forms as one (else
            st.start_key = key = family   # shapes that never recur, random lengths, never formed it)
            cache.used(key)
        state = None
        if st.schedule is not None and cache.plan_of(key) is st.schedule:
            runs, fastest = cache.prices(key)
            hooked = cache.hooked.get(key)
            mine = hooked is not None and hooked.plan is st.schedule
            held = hooked.held if mine and st.diverged_at is not None else 0   # (only a step that left reads it)
            state = PlanState(st.schedule, runs, fastest, "kept" if mine else None, held)
        unkept = self._unkept.pop(key, 0)   # re-inserted last: the oldest key goes first
        t0 = time.perf_counter()
        facts = dataclasses.replace(self._facts(st, report, unformed=state is not None and state.hook is None,
                                               family=family, recorded=recorded),
                                    unkept=unkept, may_trace=st.diverged_at is not None and cache.hooked.may_trace(key))
        try:
            decision = after_step(facts, state, self.settings())
        except scheduler.BudgetTooSmall as err:
            return self._refused(st, self.of_the_step(err) if self._mem.step_budget else err)
        if not report.kept_plan:
            self._unkept[key] = unkept + 1
            while len(self._unkept) > UNKEPT_KEYS:
                del self._unkept[next(iter(self._unkept))]
            if decision.plan is None and facts.form in ("recorded", "diverged") and unkept == FIRST_SKIP:
                log.info("%d steps in a row kept no plan (their ops change from step to step): plans are "
                         "made from them at doubling intervals now, until one holds", unkept + 1)
        self._do(st, decision, family, report.seconds, time.perf_counter() - t0)

    def _recorded(self, st: Stepper) -> scheduler.VariableSequence:
        """The managed variables ``st`` recorded, as the scheduler plans them."""
        mem = self._mem
        return st.rec.sequence({"policy": self.policy, "chunk": mem.chunk, "device": str(mem.device)})

    def fit_step(self, st: Stepper, seq: scheduler.VariableSequence, whole: scheduler.VariableSequence) -> None:
        """``Options(budget_covers="step")``: the managed budget that leaves room under the
        step's budget for what ``whole`` (the step, recorded whole) holds beside the managed
        tensors (``seq``, as ``_recorded``) (``step_budget.fit``). After the budget was set, the first recording sets it;
        a later one (another shape) only lowers it, and the plans made at the higher one go
        (a plan runs at the budget it was made for: their shapes record again)."""
        mem = self._mem
        before, held_before = (None, 0) if self.fit_pending else (mem.budget, mem.step_held)
        step_budget.fit(mem, seq, whole, st.recording.skipped)
        self.fit_pending = False
        mem.step_held = max(mem.step_held, held_before)
        if before is None or mem.budget == before:
            return
        if mem.budget > before:   # this shape holds less beside: the others still need the smaller share
            mem.budget = before
            return
        log.info("a step of another shape holds more beside the managed tensors: their budget %s -> %s; "
                 "the plans made at the higher one go", format_size(before), format_size(mem.budget))
        self._cache.clear()
        self._left.clear()

    def _tell_held(self, st: Stepper) -> None:
        """Once, after a recording step: the tensors its backward read that no saved-tensor
        hook saw (``Recording.held_by_nodes``), which no plan can move; a warning where they
        are more than an eighth of the budget."""
        held = st.rec.held_by_nodes()
        if not held:
            return
        self._told_held = True
        total = sum(n for _, n, _ in held)
        name, nbytes, node = max(held, key=lambda h: h[1])
        budget = self._mem.budget
        (log.warning if total > budget // UNMANAGED_SHARE else log.info)(
            "%d tensor(s), %s in all, that the backward reads are held outside autograd's saved tensors "
            "(the largest: %s, %s, read by %s): a custom autograd.Function keeping it on ctx instead of "
            "ctx.save_for_backward(), or a tensor hook's closure. No plan can move them: they stay in "
            "memory beside the %s budget", len(held), format_size(total), name, format_size(nbytes), node,
            format_size(budget))

    def _facts(self, st: Stepper | AnchoredStep, report: StepReport, unformed: bool = False,
               family: tuple | None = None, recorded: scheduler.VariableSequence | None = None) -> StepFacts:
        """What ``st`` showed, as the scheduler takes it: its recording (``recorded``, where
        already made) and op times, its hooks, and, for a plan with no hook-driven form yet
        (``unformed``), its chains' templates; the plan it left or guessed (``family``:
        ``PlanCache.family``'s key) for widening."""
        if isinstance(st, AnchoredStep):
            return StepFacts(report.form, report.kept_plan, report.seconds, updated=st.updated,
                             update=st.trace.update)
        seq = None
        if not report.kept_plan:
            seq = recorded if recorded is not None else self._recorded(st)
        trace = st.hook_trace if (st.planned or st.schedule is None) and st.diverged_at is None else None
        whole = st.schedule is not None and len(st.rec.names) == len(st.schedule.sequence.functions)
        templates = ready = None
        if trace is not None and unformed:   # its chains' templates, each number the same as last step's
            templates = st.templates()
            if templates is not None:
                before = self._templates.get(st.start_key)
                if before is not None:
                    ready = templates.ready(before)
                    templates.vary_from(before)
                self._templates[st.start_key] = templates
        if trace is not None:
            trace.update = st.rec.optimizer_start
        left = self._left.pop(st.start_key, None) if st.schedule is None else None   # a hook-driven step's
        if seq is not None and left is None and st.schedule is None and family is not None:
            left = (*self._cache.plans[family], True)   # a new shape's recording: maybe the guess's kind
        if seq is not None and st.diverged_at is not None:   # the plan it left, if still kept
            kept = self._cache.plans.get(family or st.start_key)   # (its family's: another shape's)
            left = (*kept, family is not None) if kept is not None and kept[0] is st.schedule else None
        return StepFacts(report.form, report.kept_plan, report.seconds, seconds=tuple(st.rec.seconds),
                         sequence=seq, ran_whole_plan=whole, signature=st.signature is not None,
                         gaps=None if trace is None else trace.gaps(),
                         first=None if trace is None else trace.first_saved(),
                         update=None if trace is None else trace.update,
                         device_timed=st.ctx.time_ops, ready=ready, left=left,
                         born_at=None if left is None else st.rec.born_at,
                         founds=seq is not None and left is None and self._cache.founds(st))

    def _do(self, st: Stepper | AnchoredStep, d: Decision, family: tuple | None, seconds: float,
            took: float) -> None:
        """Execute the scheduler's decision for ``st``'s plan key (a shape that ran its family's
        plan and left it for sizes the new plan widens for: the family's, and an alias)."""
        cache, key, mem = self._cache, st.start_key, self._mem
        if family is not None and d.plan is not None and sizes_vary(d.plan.sequence):
            cache.alias(key, family)
            key = family
        if d.drop:
            if isinstance(st, AnchoredStep) and st.sizes_differed and key in cache.plans:   # a save's bytes
                self._left[key] = (*cache.plans[key], True)
                while len(self._left) > UNKEPT_KEYS:
                    del self._left[next(iter(self._left))]
            cache.drop(key)
        if d.trial == "hook":
            cache.hooked.hook_ran(st, seconds)
        if d.hook_wins:
            cache.hooked.wins(key, st.schedule, st.diverged_at)
        if d.trace:
            cache.hooked.trace_next(key)
        if d.unhook:
            cache.hooked.unhook(key, st.schedule, st.why if isinstance(st, AnchoredStep) and st.diverged_at is not None
                                else "an anchored step ran an update its plan's step did not")
        if d.priced_runs is not None:
            cache.repriced[key] = (d.priced_runs, d.fastest)
        if d.plan is not None and d.repriced:
            old = st.schedule
            cache.replace(key, d.plan)
            log.info("re-priced on %d planned runs' op times (%.3f s -> %.3f s of ops) in %.3fs: %s in, "
                     "%s out, %s recomputed per step (was %s, %s, %s)", d.priced_runs,
                     _op_seconds(old.sequence), _op_seconds(d.fastest), took, format_size(d.plan.bytes_in),
                     format_size(d.plan.bytes_out), format_size(d.plan.bytes_recomputed),
                     format_size(old.bytes_in), format_size(old.bytes_out), format_size(old.bytes_recomputed))
        elif d.plan is not None:
            schedule = d.plan
            cache.keep(key, schedule, {where: var for var, where in st.rec.born_at.items()})
            mem.counters["plans"] += 1
            log.info("planned %d ops in %.3fs: %s in, %s out, %s recomputed per step",
                     len(schedule.sequence.functions), took, format_size(schedule.bytes_in),
                     format_size(schedule.bytes_out), format_size(schedule.bytes_recomputed))
        if d.plain:   # later steps compare their saves with what this one saved
            trace = HookTrace.from_signature(st.signature, bounded=sizes_vary(st.schedule.sequence))
            cache.hooked.add(key, HookPlan(st.schedule, st.schedule, trace, kept=True))
        if d.trial == "per_op":
            cache.hooked.per_op_ran(key, st.schedule, seconds)
        if d.anchored:   # on a GPU this step's time is its launches: its trial begins next step
            recomputes = d.moved is not None and d.moved.bytes_recomputed > 0
            cache.hooked.add(key, HookPlan(st.schedule or d.plan, d.moved, st.hook_trace,
                                           per_op=[seconds] if mem.on_cpu else [],
                                           templates=st.templates() if recomputes else None))

    def check_feasible(self, seq: scheduler.VariableSequence, st: Stepper | None = None,
                       update: Callable[[], step_budget.Update] = step_budget.Update) -> None:
        """Raise ``BudgetTooSmall`` if no plan of ``seq`` (a step so far) fits the budget, or,
        under a budget for the whole step, no share of it fits what the recording step ``st``
        holds beside ``seq`` so far, with what its update adds (``update()``, asked only then: a
        dry run, ``step_budget.update_so_far``): the refusal whose minimum is larger, the least."""
        refused = []
        try:
            if st is not None and self._mem.step_budget:
                self._fit_so_far(st, seq, update)
        except scheduler.BudgetTooSmall as err:
            refused.append(err)
        try:
            scheduler.plan(seq, budget=self._mem.budget, window=self.window, policy=self.policy)
        except scheduler.BudgetTooSmall as err:
            refused.append(self.of_the_step(err) if self._mem.step_budget else err)
        if refused:
            # The frame a raise keeps must not hold what it raises (a cycle, and through the
            # traceback every frame of the step, until a collection).
            worst = max(refused, key=lambda e: e.minimum)
            refused.clear()
            try:
                raise worst
            finally:
                del worst

    def _fit_so_far(self, st: Stepper, seq: scheduler.VariableSequence, adds: Callable[[], step_budget.Update]) -> None:
        """``step_budget.check_so_far`` at a recording step's update (refused only where half
        the chunk would not hold it either: ``ChunkChoice.at_update``), unless the chunk
        changes at its end (the next step then records again instead of fitting)."""
        mem = self._mem
        if not (self.chunks.pending and self.chunks.chosen(st.saved_sizes(), mem) != mem.chunk):
            update = adds()
            self.chunks.at_update(lambda chunk: step_budget.check_so_far(mem, st.recording, seq, update, chunk), mem)

    def of_the_step(self, err: scheduler.BudgetTooSmall) -> scheduler.BudgetTooSmall:
        """``err`` said of the step budget the user gave (``step_budget.of_the_step``)."""
        return step_budget.of_the_step(err, self._mem, held=not self.fit_pending)

    # -- the chunk -------------------------------------------------------------------------------

    def adapt_chunk(self, st: Stepper) -> bool:
        """With the default chunk, after the first recording step that completes at a budget:
        take the chunk it chose (``ChunkChoice.after_recording``). A smaller chunk gives a new
        pool, and the next step records again (this one's sequence leaves out the tensors now
        managed). Returns whether the chunk changed."""
        chunk = self.chunks.after_recording(st.saved_sizes(), self._mem)
        if chunk is None:
            return False
        self.set_chunk(chunk, chunk // 2)
        return True

    def _refused(self, st: Stepper | AnchoredStep, err: scheduler.BudgetTooSmall) -> None:
        """A recording step's plan refused with ``err``: under the default chunk, the next step
        records again in half the chunk instead (``ChunkChoice.instead_of``), or ``err`` (or the
        least refusal of the chunks tried) is raised, in the chunk that named it."""
        mem, refusal = self._mem, err
        if isinstance(st, Stepper) and st.schedule is None:
            chunk, refusal = self.chunks.instead_of(err, mem)
            if chunk != mem.chunk:
                if mem.step_budget:   # recorded whole and fitted again, as after set_budget
                    self._fit_again()
                self.set_chunk(chunk, chunk // 2)
        if refusal is not None:
            try:
                raise refusal
            finally:   # (the frame must not keep what it raises: a cycle through the step's frames)
                del refusal, err

    def refit(self, start: int) -> None:
        """What a step starts with grew to ``start`` bytes, more than the step recorded whole
        counted (state that grows between steps): the plans go, and the next step records whole
        within the budget less that (``step_budget.recording_room``) and is fitted again."""
        mem = self._mem
        mem.step_start, self.fit_pending = start, True
        mem.budget = step_budget.recording_room(mem)
        self._cache.clear()
        self._left.clear()

    def set_budget(self, budget: int) -> None:
        """A new budget: the next step records and plans under it; with the default chunk, it
        also chooses the chunk again (never a larger one). Between steps only. A budget for
        the whole step is fitted again at that recording (its managed tensors held meanwhile
        within ``step_budget.recording_room``)."""
        mem = self._mem
        adaptive = self.chunks.adaptive
        chunk = min(mem.chunk, start_chunk(budget)) if adaptive and mem.on_cpu else mem.chunk
        if budget < chunk:
            from ooc.errors import OOCError
            raise OOCError(f"budget {format_size(budget)} is smaller than one chunk ({format_size(chunk)})")
        mem.budget = budget
        if mem.step_budget:
            mem.step_budget = budget
            self._fit_again()
        self.chunks.again()
        self.set_chunk(chunk, chunk // 2 if adaptive else mem.min_bytes)

    def _fit_again(self) -> None:
        """Under a budget for the whole step: the next recording is fitted again, its managed
        tensors held meanwhile within ``step_budget.recording_room``."""
        mem = self._mem
        mem.step_held, self.fit_pending = 0, True
        mem.budget = step_budget.recording_room(mem)

    def set_chunk(self, chunk: int, min_bytes: int) -> None:
        """Manage tensors from ``min_bytes`` on, in a new pool of ``chunk``-sized chunks sized
        to the budget; the plans made before go. Between steps only: no activation holds a
        pool range then (parameters, grads and state are resized in place, never in it)."""
        mem = self._mem
        mem.chunk, mem.min_bytes = chunk, min_bytes
        mem.pool.trim()   # the old pool's idle chunks: nothing will reuse them
        old, mem.pool = mem.pool, make_pool(mem.device, max(mem.budget, mem.step_budget), chunk, mem.arena)
        mem.held.pool = mem.pool
        close_pool(old)
        self._cache.clear()
        self._left.clear()
        self._adopt_params()   # parameters now above the threshold are managed too


def _op_seconds(seq: scheduler.VariableSequence) -> float:
    return sum(f.cost.seconds or 0.0 for f in seq.functions)
