"""The engine's side of planning: what it asks ``scheduler`` after each step, and the chunk.

After a step, ``after_step`` decides what follows from it, in one place:

- a step that did not follow a plan (recorded, diverged) is planned from its own recording
  (``replan``: ``scheduler.plan`` then ``scheduler.check``), and the plan is kept for the state
  and shape the step had (``plan_cache.py``); with the default chunk, the first recording step
  first chooses the pool's chunk from the sizes it saved (``adapt_chunk``,
  ``scheduler.chunk_size``): a new chunk means a new pool and a new recording;
- a per-op step that kept to its plan re-prices it on its measured op times (``reprice``), and
  gives its plan a hook-driven form (``note_hook_form``: plain, or anchored by
  ``scheduler.anchoring``), or is timed against it on trial;
- a hook-driven step is timed on trial, or, if it left its plan, the plan goes.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from typing import Callable, Sequence


import scheduler
from ooc.engine.hook_forms import HookPlan
from ooc.engine.host_pricing import priced_hardware
from ooc.engine.lifetime import close_pool
from ooc.engine.memory import EngineMemory
from ooc.engine.pin_policy import PinFn, pins_of
from ooc.engine.plan_cache import PlanCache, _moves_nothing
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.devices import make_pool
from ooc.runtime.hook_trace import HookTrace
from ooc.runtime.step_protocol import StepReport
from ooc.runtime.stepper import Stepper
from scheduler.anchoring import anchor_within_budget
from scheduler.chunk_size import UNMANAGED_SHARE, choose_chunk, unmanaged_bytes
from scheduler.ir import Kind
from scheduler.replay import mark_replayable
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 2 << 20   # the chunk a default engine starts with (the GPU's VMM granularity)
REPRICED_RUNS = 2   # a CPU plan is re-priced on the fastest op times of this many planned runs


class Planner:
    """What the engine asks the scheduler, with its settings: ``window``, ``policy``,
    ``recompute`` ("auto", "never", "prefer") and ``pin``; and the chunk, which adapts while
    ``adapt_pending`` (``adaptive``: it adapts again after ``set_budget``). ``adopt_params``
    manages the parameters a smaller threshold reaches (the persistent store's)."""

    def __init__(self, mem: EngineMemory, cache: PlanCache, *, window: int | None, policy: str,
                 recompute: str, pin: PinFn | None, adaptive: bool,
                 adopt_params: Callable[[], None]) -> None:
        self._mem, self._cache = mem, cache
        self.window, self.policy, self.recompute, self.pin = window, policy, recompute, pin
        self.adaptive = self.adapt_pending = adaptive
        self._adopt_params = adopt_params

    def after_step(self, st: Stepper | AnchoredStep, report: StepReport) -> None:
        """What the scheduler makes of a step that completed (the module docstring)."""
        if isinstance(st, AnchoredStep):
            if report.diverged_at is None:
                self._cache.hooked.hook_ran(st, report.seconds)
            elif self._cache.plan_of(st.start_key) is st.schedule:   # not a guess of another shape's
                self._cache.drop(st.start_key)
            return
        if st.schedule is None or st.diverged_at is not None:
            st.book_device_times()
            if self.adapt_chunk(st):
                overflow = st.forgive_overflow()
                if overflow is not None:   # the next step records again, in the new chunks
                    log.warning("the recording step went over the pool once (%s); the next step "
                                "records again with %s chunks", overflow, format_size(self._mem.chunk))
            else:
                self.replan(st)
            return
        self._note_plain(st)
        self.reprice(st)   # a plan's first planned runs time its ops on warm memory
        self._note_anchored(st, report.seconds)

    # -- plans -----------------------------------------------------------------------------------

    def replan(self, st: Stepper) -> None:
        """Plan from ``st``'s recording; the plan is its start key's from now on."""
        mem = self._mem
        seq = st.rec.sequence({"policy": self.policy, "chunk": mem.chunk, "device": str(mem.device)})
        if self.recompute == "never":   # swap only: no function may be replayed
            seq = mark_replayable(seq, lambda f: {})
        seq = _round_activations(seq, mem.chunk)
        t0 = time.perf_counter()
        schedule = self.plan(seq)
        self._cache.keep(st.start_key, schedule, {where: var for var, where in st.rec.born_at.items()})
        mem.counters["plans"] += 1
        log.info("planned %d ops in %.3fs: %s in, %s out, %s recomputed per step", len(seq.functions),
                 time.perf_counter() - t0, format_size(schedule.bytes_in), format_size(schedule.bytes_out),
                 format_size(schedule.bytes_recomputed))

    def reprice(self, st: Stepper) -> None:
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
        cache = self._cache
        if (not self._mem.on_cpu or schedule is None or not st.planned or st.diverged_at is not None
                or self.policy not in ("window", "milp") or self.recompute == "never"
                or cache.plan_of(key) is not schedule):
            return
        runs, fastest = cache.repriced.get(key, (0, schedule.sequence))
        if runs >= REPRICED_RUNS or _moves_nothing(schedule):   # no price changes the latter
            return
        seq = priced_seconds(fastest, st.rec.seconds)
        if seq is None:   # the runs do not line up, or the recording was not timed
            cache.repriced[key] = (REPRICED_RUNS, fastest)
            return
        cache.repriced[key] = (runs + 1, seq)
        t0 = time.perf_counter()
        try:
            new = self.plan(seq)
        except scheduler.BudgetTooSmall:   # costs do not change what fits; keep the plan that ran
            return
        if _bytes(new) == _bytes(schedule):   # the same decisions: keep running the plan that runs
            return
        cache.replace(key, new)
        log.info("re-priced on %d planned runs' op times (%.3f s -> %.3f s of ops) in %.3fs: %s in, "
                 "%s out, %s recomputed per step (was %s, %s, %s)", runs + 1,
                 _op_seconds(schedule.sequence), _op_seconds(seq), time.perf_counter() - t0,
                 format_size(new.bytes_in), format_size(new.bytes_out), format_size(new.bytes_recomputed),
                 format_size(schedule.bytes_in), format_size(schedule.bytes_out),
                 format_size(schedule.bytes_recomputed))

    def plan(self, seq: scheduler.VariableSequence) -> Schedule:
        """``scheduler.plan`` with this engine's budget, policy, pins and pricing, checked."""
        options: dict = {"recompute": "prefer"} if self.recompute == "prefer" and self.policy == "window" else {}
        if self.policy in ("window", "milp"):   # priced with this machine's swap file (host_pricing.py)
            options["hardware"] = priced_hardware(seq, self._mem.tier.stats())
        if self.pin is not None:   # the user's pins (ooc/engine/pin_policy.py)
            options["pins"] = pins_of(seq, self.pin)
        try:
            schedule = scheduler.plan(seq, budget=self._mem.budget, window=self.window, policy=self.policy,
                                      **options)
        except scheduler.BudgetTooSmall as err:
            kept = [v for v, p in options.get("pins", {}).items() if p == "keep"]
            if kept:
                err.add_note(f"ooc: pin keeps {len(kept)} activations "
                             f"({format_size(sum(seq.variables[v].nbytes for v in kept))}) on the device")
            raise
        scheduler.check(schedule)
        return schedule

    def check_feasible(self, seq: scheduler.VariableSequence) -> None:
        """Raise ``BudgetTooSmall`` if no plan of ``seq`` (a step so far) fits the budget."""
        scheduler.plan(seq, budget=self._mem.budget, window=self.window, policy=self.policy)

    # -- hook-driven forms -----------------------------------------------------------------------

    def _note_plain(self, st: Stepper) -> None:
        """A planned step that kept to its plan that moves nothing: later steps may run it with
        no op intercepted, their saves compared with what this one saved."""
        if st.signature is not None and st.planned and st.diverged_at is None:
            trace = HookTrace.from_signature(st.signature)
            self._cache.hooked.add(st.start_key, HookPlan(st.schedule, st.schedule, trace, kept=True))

    def _note_anchored(self, st: Stepper, seconds: float) -> None:
        """After a planned per-op step that kept to a plan that moves bytes to its end, and whose
        prices are settled (``reprice``): the anchored form of its swap-only plan, if one proves
        within the budget (``scheduler.anchoring``); then its trial."""
        trace, cache = st.hook_trace, self._cache
        key, schedule = st.start_key, st.schedule
        if (trace is None or not st.planned or st.diverged_at is not None or not cache.hooked.enabled
                or cache.plan_of(key) is not schedule or _moves_nothing(schedule)
                or self.policy != "window" or self.pin is not None   # pins are the per-op plan's
                or self.recompute == "prefer"):   # asked to recompute: a form that swaps instead is not that
            return
        if len(st.rec.names) != len(schedule.sequence.functions):
            # The step ended before its plan did (a micro-batch without the update its plan
            # has): it proved part of the plan only. An anchored step does not see the ops it
            # would have missed, so a stale update (momentum created since the plan was made)
            # would go unnoticed where a per-op step diverges and re-plans.
            return
        if cache.hooked.per_op_ran(key, schedule, seconds):
            return
        if self.recompute != "never" and cache.repriced.get(key, (0,))[0] < REPRICED_RUNS:
            return   # the plan may still change with its prices
        trace.update = st.rec.optimizer_start
        mem = self._mem
        moved = anchor_within_budget(schedule, trace.gaps(), trace.first_saved(), budget=mem.budget,
                                     chunk=mem.chunk, window=self.window, policy=self.policy)
        cache.hooked.add(key, HookPlan(schedule, moved, trace, per_op=[seconds]))

    # -- the chunk -------------------------------------------------------------------------------

    def adapt_chunk(self, st: Stepper) -> bool:
        """With the default chunk, after the first recording step that completes: choose the
        chunk (and threshold, half a chunk) from the sizes it saved and the budget
        (``scheduler.chunk_size.choose_chunk``). A smaller chunk gives a new pool, and the
        next step records again (this one's sequence leaves out the tensors now managed).
        Returns whether the chunk changed. Decided once; ``set_budget`` asks again."""
        saved = st.saved_sizes()
        if not self.adapt_pending or saved is None:
            return False
        self.adapt_pending = False
        mem = self._mem
        floor = mem.pool.granularity   # the page; on a GPU, the VMM granularity
        chunk = choose_chunk(saved, mem.budget, mem.chunk, floor)
        left = unmanaged_bytes(saved, chunk // 2)
        if sum(saved) > mem.budget and left > mem.budget // UNMANAGED_SHARE:
            log.warning("saved activations in tensors under %s take %s, more than an eighth of the "
                        "%s budget, and stay outside it: the chunk cannot go below %s, the %s "
                        "granularity. Pass min_bytes= to manage smaller tensors (each takes a whole "
                        "chunk of the budget)", format_size(chunk // 2), format_size(left),
                        format_size(mem.budget), format_size(floor), mem.device.type)
        if chunk == mem.chunk:
            return False
        log.info("chunk %s -> %s (tensors from %s managed): saved activations under %s took %s of "
                 "the %s budget; the next step records again", format_size(mem.chunk),
                 format_size(chunk), format_size(chunk // 2), format_size(mem.min_bytes),
                 format_size(unmanaged_bytes(saved, mem.min_bytes)), format_size(mem.budget))
        self.set_chunk(chunk, chunk // 2)
        return True

    def set_budget(self, budget: int) -> None:
        """A new budget: the next step records and plans under it; with the default chunk, it
        also chooses the chunk again (never a larger one). Between steps only."""
        mem = self._mem
        chunk = min(mem.chunk, start_chunk(budget)) if self.adaptive and mem.on_cpu else mem.chunk
        if budget < chunk:
            from ooc.errors import OOCError
            raise OOCError(f"budget {format_size(budget)} is smaller than one chunk ({format_size(chunk)})")
        mem.budget = budget
        self.adapt_pending = self.adaptive
        self.set_chunk(chunk, chunk // 2 if self.adaptive else mem.min_bytes)

    def set_chunk(self, chunk: int, min_bytes: int) -> None:
        """Manage tensors from ``min_bytes`` on, in a new pool of ``chunk``-sized chunks sized
        to the budget; the plans made before go. Between steps only: no activation holds a
        pool range then (parameters, grads and state are resized in place, never in it)."""
        mem = self._mem
        mem.chunk, mem.min_bytes = chunk, min_bytes
        mem.pool.trim()   # the old pool's idle chunks: nothing will reuse them
        old, mem.pool = mem.pool, make_pool(mem.device, mem.budget, chunk)
        mem.held.pool = mem.pool
        close_pool(old)
        self._cache.clear()
        self._adopt_params()   # parameters now above the threshold are managed too


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


def start_chunk(budget: int) -> int:
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
