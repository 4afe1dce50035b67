"""Plans: which one a step runs, re-planning from a recorded step, and the adaptive chunk.

A step that did not follow a plan (the recording step, a diverged step) is planned from its
own recording (``_replan``: ``scheduler.plan`` then ``scheduler.check``), and the plan is kept
for the state the step started in and the shape it had. With the default chunk, the first
recording step also chooses the pool's chunk from the sizes it saved (``_adapt_chunk``,
``scheduler.chunk_size``); a new chunk means a new pool and a new recording.

Plans per shape. A plan is a sequence of ops with the sizes one step had: a step of another
shape (dynamic padding: another sequence length) leaves it at its first differing op. Plans
are keyed by the step's start (``_start_key``: managed persistent tensors, which parameters
have a gradient, the caller's kind) and its shape (``step_forms.shape_of``: the shapes and
dtypes of the tensors the model's forward is called with), at most ``max_plans`` of them,
the least recently used evicted first. The shape shows only when the forward starts, after
the step began: it begins with the plan of the shape its start's last step had (the guess),
and the model's forward pre-hook (``_forward_starts``) switches it to the plan of the shape
it has, if nothing of it touched managed memory yet (``step_forms.py``); a shape without a
plan is recorded by that step. A guess that cannot be switched diverges where its plan differs, as before, and
the step is re-planned under the shape it had: no other shape's plan is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from collections import OrderedDict
from typing import Any, Hashable, Sequence

import scheduler
from ooc.engine.host_pricing import priced_hardware
from ooc.engine.lifetime import close_pool
from ooc.engine.pin_policy import pins_of
from ooc.engine.step_forms import UNSEEN, StepForm, shape_of
from ooc.runtime.devices import make_pool
from ooc.runtime.plain_step import moves_nothing
from ooc.runtime.stepper import Stepper
from scheduler.chunk_size import UNMANAGED_SHARE, choose_chunk, unmanaged_bytes
from scheduler.ir import Kind
from scheduler.replay import mark_replayable
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 2 << 20   # the chunk a default engine starts with (the GPU's VMM granularity)
REPRICED_RUNS = 2   # a CPU plan is re-priced on the fastest op times of this many planned runs
# Plans kept (start x shape), least recently used out. A plan holds its step's sequence: GPT
# 6x256 at 256 tokens, 1,858 ops, ~1.3 MiB of Python objects with its anchored form and prices
# (benchmarks/results/shapes.md).
MAX_PLANS = 16


class Planning:
    """``OutOfCore``'s plans and chunk (a mixin; ``chunk``, ``min_bytes`` and whether the
    chunk adapts are the constructor's, from its arguments). Its state (``_init_plans``):
    ``plans``, ``schedule``, ``binding``, ``plan_runs``."""

    def _init_plans(self) -> None:
        # A plan holds for the state a step starts in: which parameters, grads and optimizer
        # state exist. Gradient accumulation alternates two such states, so plans are kept
        # per starting state (``_start_key``; and per the step's kind) instead of one, and per
        # shape: key (start, shape), most recently used last, at most ``max_plans``.
        self.plans: OrderedDict[tuple[Hashable, Any], tuple[Schedule, dict[tuple[int, int], int]]] = OrderedDict()
        self.max_plans = MAX_PLANS
        self._shapes: OrderedDict[Hashable, Any] = OrderedDict()   # start -> its last step's shape
        self._form: StepForm | None = None   # the running step's form (step_forms.py)
        self.plan_runs: dict[int, int] = {}   # id of a plan -> how often it ran before
        self.schedule: Schedule | None = None   # the current step's plan and its binding
        self.binding: dict[tuple[int, int], int] = {}
        # start key -> (planned runs priced, the sequence at the fastest times so far): ``_reprice``
        self.repriced: dict[object, tuple[int, scheduler.VariableSequence]] = {}

    # -- which plan a step runs ----------------------------------------------------------------

    def _begin(self, start: Hashable) -> StepForm:
        """The plan and form of a step that starts in ``start``: the plan of the shape its
        start's last step had, until the forward shows the step's own (``_forward_starts``).
        With plans for several shapes of this start, the step runs per op until then: a
        plain or anchored form is taken up at the forward, where the mode can come off."""
        key = self._guess(start)
        provisional = sum(1 for s, _ in self.plans if s == start) > 1
        self.schedule, self.binding = self._use_plan(key)
        self._reconcile()
        return StepForm(start, self._step_for(key, per_op=provisional),
                        activations="activations" in self.manage, provisional=provisional)

    def _guess(self, start: Hashable) -> tuple[Hashable, Any]:
        """The plan key a step that starts in ``start`` begins with: the shape of its start's
        last step (None where no forward was seen: a model not called through its forward)."""
        return start, self._shapes.get(start)

    def _use_plan(self, key: tuple) -> tuple[Schedule | None, dict]:
        """``key``'s plan and binding, counted as a run (``plan_runs``)."""
        schedule, binding = self.plans.get(key, (None, {}))
        if schedule is not None:   # how often this plan ran before (see Stepper._diverge)
            self.plan_runs[id(schedule)] = self.plan_runs.get(id(schedule), -1) + 1
        return schedule, binding

    def _step_for(self, key: tuple, *, per_op: bool = False) -> Any:
        """The step object that runs ``self.schedule`` for ``key``: plain, anchored or per op."""
        st = None if per_op else (self._plain_step(key) or self._anchored_step(key))
        self._ran = getattr(st, "anchored", None)   # stats' plan.* are the plan that ran
        if st is None:
            st = Stepper(self._step_context(key), self.schedule, self.binding, observe_small=self._adapt_pending)
        return st

    def _forward_starts(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: the step's shape is known. A step that guessed
        another shape's plan, or waits per op for its shape, runs the plan of the shape it
        has (on demand, recorded, if there is none), provided nothing of it touched managed
        memory yet (``StepForm.quiet``) and that plan begins with the ops it ran."""
        form = self._form
        if form is None or form.shape is not UNSEEN:   # between steps, or not its first forward
            return None
        form.shape = shape = shape_of(args, kwargs)
        self._shapes[form.start] = shape
        self._shapes.move_to_end(form.start)
        while len(self._shapes) > self.max_plans:
            self._shapes.popitem(last=False)
        key, st = (form.start, shape), form.st
        if st.start_key == key and not form.provisional:   # the guess was right
            return None
        guessed, st.start_key = st.start_key, key   # booked under its shape, whatever plan it runs
        schedule, binding = self.plans.get(key, (None, {}))
        ran = st.rec.names if isinstance(st, Stepper) else []   # ops before the forward (x[:, :-1])
        if schedule is None and isinstance(st, Stepper) and (not st.planned or ran):
            if st.planned:   # the guess, after ops of its own: left here, the rest recorded on demand
                st.leave_plan(f"the step's shape {shape} has no plan")
            return None
        if not (form.quiet() and form.innermost() and (schedule is None or _begins_with(schedule, ran))):
            log.info("the step's shape has %s plan, but the step touched managed memory before its "
                     "forward: it runs the plan it began with", "no" if schedule is None else "another")
            return None
        kept = self.schedule, self.binding, self._ran
        self.schedule, self.binding = schedule, binding
        hooks_only, per_op = form.can_drop_mode(), key != guessed and form.can_run_per_op()
        new = None
        try:
            with form.paused():   # making the next step object runs ops that are not the step's
                new = (self._plain_step(key) or self._anchored_step(key)) if hooks_only else None
                if new is None and per_op:
                    self._reconcile()
                    new = Stepper(self._step_context(key), schedule, binding, observe_small=self._adapt_pending)
        finally:
            if new is None:   # it keeps its form and plan (or a transfer failed: the step fails)
                self.schedule, self.binding, self._ran = kept
        if new is None:
            return None
        if key != guessed:
            if kept[0] is not None:
                self.plan_runs[id(kept[0])] -= 1   # the guess did not run
            self._use_plan(key)
        form.switch(new)
        self._stepper = new
        self._ran = getattr(new, "anchored", None)
        return None

    def _drop_plan(self, key: tuple) -> None:
        """Forget ``key``'s plan and what was made of it (prices, plain and anchored forms)."""
        entry = self.plans.pop(key, None)
        if entry is not None:
            self.plan_runs.pop(id(entry[0]), None)
        self.repriced.pop(key, None)
        self._plain.pop(key, None)
        self._anchored.pop(key, None)

    def _adapt_chunk(self, st: Stepper) -> bool:
        """With the default chunk, after the first recording step that completes: choose the
        chunk (and threshold, half a chunk) from the sizes it saved and the budget
        (``scheduler.chunk_size.choose_chunk``). A smaller chunk gives a new pool, and the
        next step records again (this one's sequence leaves out the tensors now managed).
        Returns whether the chunk changed. Decided once; ``set_budget`` asks again."""
        saved = st.saved_sizes()
        if not self._adapt_pending or saved is None:
            return False
        self._adapt_pending = False
        floor = self.pool.granularity   # the page; on a GPU, the VMM granularity
        chunk = choose_chunk(saved, self.budget, self.chunk, floor)
        left = unmanaged_bytes(saved, chunk // 2)
        if sum(saved) > self.budget and left > self.budget // UNMANAGED_SHARE:
            log.warning("saved activations in tensors under %s take %s, more than an eighth of the "
                        "%s budget, and stay outside it: the chunk cannot go below %s, the %s "
                        "granularity. Pass min_bytes= to manage smaller tensors (each takes a whole "
                        "chunk of the budget)", format_size(chunk // 2), format_size(left),
                        format_size(self.budget), format_size(floor), self.device.type)
        if chunk == self.chunk:
            return False
        log.info("chunk %s -> %s (tensors from %s managed): saved activations under %s took %s of "
                 "the %s budget; the next step records again", format_size(self.chunk),
                 format_size(chunk), format_size(chunk // 2), format_size(self.min_bytes),
                 format_size(unmanaged_bytes(saved, self.min_bytes)), format_size(self.budget))
        self._set_chunk(chunk, chunk // 2)
        return True

    def _set_chunk(self, chunk: int, min_bytes: int) -> None:
        """Manage tensors from ``min_bytes`` on, in a new pool of ``chunk``-sized chunks sized
        to the budget; the plans made before go. Between steps only: no activation holds a
        pool range then (parameters, grads and state are resized in place, never in it)."""
        self.chunk, self.min_bytes = chunk, min_bytes
        self.pool.trim()   # the old pool's idle chunks: nothing will reuse them
        old, self.pool = self.pool, make_pool(self.device, self.budget, chunk)
        self._held.pool = self.pool
        close_pool(old)
        self.plans.clear()
        self.plan_runs.clear()
        self.repriced.clear()
        self._plain.clear()
        self._anchored.clear()
        self.schedule = None
        self.binding = {}
        if "params" in self.manage:   # parameters now above the threshold are managed too
            for name, p in self.model.named_parameters():
                self._adopt(p, Kind.PARAM, name)

    def _replan(self, st: Stepper) -> None:
        seq = st.rec.sequence({"policy": self.policy, "chunk": self.chunk, "device": str(self.device)})
        if not self.recompute:   # swap only: no function may be replayed
            seq = mark_replayable(seq, lambda f: {})
        seq = _round_activations(seq, self.chunk)
        t0 = time.perf_counter()
        schedule = self._plan(seq)
        self.schedule = schedule
        self.binding = {where: var for var, where in st.rec.born_at.items()}
        self._drop_plan(st.start_key)
        self.plans[st.start_key] = (self.schedule, self.binding)
        while len(self.plans) > max(1, self.max_plans):   # the least recently used go
            self._drop_plan(next(iter(self.plans)))
        self.counters["plans"] += 1
        log.info("planned %d ops in %.3fs: %s in, %s out, %s recomputed per step", len(seq.functions),
                 time.perf_counter() - t0, format_size(schedule.bytes_in), format_size(schedule.bytes_out),
                 format_size(schedule.bytes_recomputed))

    def _reprice(self, st: Stepper) -> None:
        """After each of a CPU plan's first ``REPRICED_RUNS`` planned steps that kept to it:
        plan once more, with each op priced at the fastest of its recorded and its planned runs
        so far (``priced_seconds``, folded run by run into ``repriced``).

        Why: the recording step runs on cold memory (every output in pages the kernel zeroes,
        transfers on demand beside the ops), and its op times are too high to price recompute
        on: ResNet-50 batch 8 at 1/4, its convolutions took 1.8x and its whole step 1.3-1.7x
        what they take once the plan runs (sum of op times 1.46-1.91 s against 1.11-1.20 s).
        Priced on those, every replay chain looked dear, and the plan swapped all 1,152 MiB the
        budget forces out. Re-priced, ``simulate`` predicts the step within ~10% of its measured
        time (it was 1.3-1.5x over) and the plan moves 580 MiB and recomputes 286 MiB, at the
        swap-only plan's step time within this machine's noise (bench_cpu, cpu-rerun.md).
        Several runs, not one: a single planned run is as noisy as the host, and priced on one
        the plan differed from process to process (ResNet-50 1/4: 580-716 MiB moved); an op's
        time only grows by what ran beside it, so the fastest of two is the steadier price.
        A re-pricing that moves and recomputes the same bytes keeps the plan that runs (the
        fastest times are kept beside it); the last plan is kept until a step diverges from it.
        Not for swap only (prices change no swap-only plan), nor on a GPU, whose recording step
        times ops on the device (CUDA events) and whose planned steps do not."""
        key, schedule = st.start_key, st.schedule
        if (self.device.type != "cpu" or schedule is None or not st.planned or st.diverged_at is not None
                or self.policy not in ("window", "milp") or not self.recompute
                or self.plans.get(key, (None,))[0] is not schedule):
            return
        runs, fastest = self.repriced.get(key, (0, schedule.sequence))
        if runs >= REPRICED_RUNS or moves_nothing(schedule):   # no price changes the latter
            return
        seq = priced_seconds(fastest, st.rec.seconds)
        if seq is None:   # the runs do not line up, or the recording was not timed
            self.repriced[key] = (REPRICED_RUNS, fastest)
            return
        self.repriced[key] = (runs + 1, seq)
        t0 = time.perf_counter()
        try:
            new = self._plan(seq)
        except scheduler.BudgetTooSmall:   # costs do not change what fits; keep the plan that ran
            return
        if _bytes(new) == _bytes(schedule):   # the same decisions: keep running the plan that runs
            return
        self.plans[key] = (new, self.plans[key][1])
        log.info("re-priced on %d planned runs' op times (%.3f s -> %.3f s of ops) in %.3fs: %s in, "
                 "%s out, %s recomputed per step (was %s, %s, %s)", runs + 1,
                 _op_seconds(schedule.sequence), _op_seconds(seq), time.perf_counter() - t0,
                 format_size(new.bytes_in), format_size(new.bytes_out), format_size(new.bytes_recomputed),
                 format_size(schedule.bytes_in), format_size(schedule.bytes_out),
                 format_size(schedule.bytes_recomputed))

    def _plan(self, seq: scheduler.VariableSequence) -> Schedule:
        """``scheduler.plan`` with this engine's budget, policy, pins and pricing, checked."""
        options: dict = {"recompute": "prefer"} if self.recompute == "prefer" and self.policy == "window" else {}
        if self.policy in ("window", "milp"):   # priced with this machine's swap file (host_pricing.py)
            options["hardware"] = priced_hardware(seq, self.tier.stats())
        if self._pin is not None:   # the user's pins (ooc/engine/pin_policy.py)
            options["pins"] = pins_of(seq, self._pin)
        try:
            schedule = scheduler.plan(seq, budget=self.budget, window=self.window, policy=self.policy, **options)
        except scheduler.BudgetTooSmall as err:
            kept = [v for v, p in options.get("pins", {}).items() if p == "keep"]
            if kept:
                err.add_note(f"ooc: pin keeps {len(kept)} activations "
                             f"({format_size(sum(seq.variables[v].nbytes for v in kept))}) on the device")
            raise
        scheduler.check(schedule)
        return schedule


def _begins_with(schedule: Schedule, names: Sequence[str]) -> bool:
    """Whether ``schedule``'s first ops are ``names``, with no action before or after any."""
    functions = schedule.sequence.functions
    return len(functions) >= len(names) and all(
        functions[j].name == name and not schedule.before[j] and not schedule.after[j]
        for j, name in enumerate(names))


def priced_seconds(seq: scheduler.VariableSequence,
                   seconds: Sequence[float]) -> scheduler.VariableSequence | None:
    """``seq`` with each function's measured seconds the smaller of its own and ``seconds[i]``
    (a later run of the same ops); None when the runs do not line up (another op count) or
    ``seq`` was not timed. The smaller: an op's time only ever grows by what ran beside it
    (cold pages, I/O threads, the host), and the planner charges those separately."""
    if len(seconds) != len(seq.functions) or any(f.cost.seconds is None for f in seq.functions):
        return None
    functions = tuple(
        dataclasses.replace(f, cost=dataclasses.replace(f.cost, seconds=min(f.cost.seconds, t)))
        for f, t in zip(seq.functions, seconds))
    return scheduler.VariableSequence(functions, seq.variables, seq.meta)


def _bytes(schedule: Schedule) -> tuple[int, int, int]:
    return schedule.bytes_in, schedule.bytes_out, schedule.bytes_recomputed


def _op_seconds(seq: scheduler.VariableSequence) -> float:
    return sum(f.cost.seconds or 0.0 for f in seq.functions)


def _start_chunk(budget: int) -> int:
    """The adaptive chunk a CPU engine starts with: 2 MiB, or for a smaller budget the largest
    power of two within it (at least a page: a smaller budget is refused as below a chunk)."""
    if budget >= DEFAULT_CHUNK:
        return DEFAULT_CHUNK
    return max(mmap.PAGESIZE, 1 << (max(budget, 1).bit_length() - 1))


def _round_activations(seq: scheduler.VariableSequence, chunk: int) -> scheduler.VariableSequence:
    """Activations come back into pool ranges of whole chunks: plan with those sizes."""
    from scheduler.ir import Variable, VariableSequence

    variables = {
        v: (Variable(x.id, -(-x.nbytes // chunk) * chunk, x.kind, x.name, x.live_in, x.live_out)
            if x.kind is Kind.ACTIVATION else x)
        for v, x in seq.variables.items()}
    return VariableSequence(seq.functions, variables, seq.meta)
