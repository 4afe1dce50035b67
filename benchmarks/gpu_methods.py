"""One training run of one GPU case by one method, measured the same way for every method.

Methods (``gpu.json``'s ``method``): ``in-core`` (plain PyTorch), ``in-core-repeat`` (the same
again: are the kernels deterministic, so that "bitwise" means something?),
``checkpoint-every-block`` and ``checkpoint-every-2nd`` (``torch.utils.checkpoint``,
non-reentrant, RNG state preserved), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(
pin_memory=True)``: every saved tensor to pinned host memory and back, no prefetch),
``compile-budget-<f>`` (``torch.compile`` with ``activation_memory_budget = f``), ``ooc`` and
``ooc-swap-only`` (``OutOfCore(device="cuda")`` under a budget, with and without
recomputation), ``ooc-one-arena`` (swap-ins in PyTorch's allocator) and
``ooc-one-arena-priced-once`` (its plans priced on the recording step's op times alone).

Every run starts from the same CPU copy of the weights, seeds the global generator the same
way (dropout draws the same masks), times each step between two ``torch.cuda.synchronize()``
and reports the median of the steps after warm-up. Peak device memory is PyTorch's peak
allocated bytes over the run plus, for ooc, the peak of its VMM pool (mapped outside
PyTorch's allocator).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import gpu_cases
from gpu_cases import GpuCase, checkpoint_every
from scheduler.anchoring import TRIAL_RUNS
from scheduler.step_plans import REPRICED_RUNS


# Warm-up steps before the timed ones, the same for every method (their parameters compare
# bitwise after the same steps): ooc records, meets the optimizer's state, runs its plan
# REPRICED_RUNS times timing each op (its prices, on a warm allocator) and once more untimed,
# then tries the plan's anchored form against it, two steps each in turn; the timed steps
# begin with the form it kept.
WARMUP = 3 + REPRICED_RUNS + 2 * TRIAL_RUNS


@dataclass
class Row:
    """One line of gpu.json (issue 38's keys first; the rest says how the figure came about)."""

    case: str
    method: str
    budget_fraction: float | None = None
    step_ms: float | None = None
    samples_per_s: float | None = None
    peak_bytes: int | None = None
    bytes_moved: int | None = None
    bytes_recomputed: int | None = None
    bitwise: bool | None = None
    predicted_step_ms: float | None = None
    label: str = ""
    budget_bytes: int | None = None
    torch_peak_bytes: int | None = None
    torch_reserved_peak_bytes: int | None = None   # PyTorch's reserved: what a cap bounds
    pool_peak_bytes: int | None = None
    steps_ms: list[float] = field(default_factory=list)
    step_peaks: list[int] = field(default_factory=list)   # PyTorch's peak allocated, each step (warm-up too)
    forms: dict[str, int] = field(default_factory=dict)   # ooc: steps of each form
    note: str = ""
    wall_s: float | None = None   # the whole run: building, warm-up, timed steps (to plan a GPU session's time)
    priced_op_ms: float | None = None   # ooc: the op times its plan was priced on, added up (vs in core's step)
    priced_runs: int | None = None   # ooc: the planned runs that timed their ops and priced the plan again
    # the host's time to queue a step (until its code returned, before the synchronize), median
    # of the timed steps: over a step's ops, the host's time per op (a host-bound step's bound)
    queued_ms: float | None = None
    # ooc: the host's waits inside a step (the commit point's drain, a swap a node needed at
    # once), median of the timed steps: queued_ms holds them, so a step whose queued_ms is its
    # step time is host-bound only where this is small
    stall_ms: float | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Setup:
    """What every run of one case shares: the CPU weights and batch, the reference params."""

    case: GpuCase
    model: torch.nn.Module
    x: Any
    y: Any
    loss_fn: Any
    steps: int
    activation_peak: int = 0                 # in-core: peak allocated above the step's start
    total_peak: int = 0                      # in-core: peak allocated, weights and state too
    reference: list[torch.Tensor] | None = None
    reference_steps: int = 0                 # the steps that trained ``reference``
    hardware: Any = None                     # the simulator's, with the measured link
    hook_host_s: float = 0.0                 # the host's time per op of a hook-driven step


def run(setup: Setup, method: str, *, fraction: float | None = None, warmup: int = WARMUP,
        engine_kw: dict[str, Any] | None = None, recordings: Path | None = None,
        steps: int | None = None, budget_bytes: int | None = None) -> Row:
    """Train ``setup.steps`` timed steps (after ``warmup``) by ``method``; never raises: a
    failure is a row with ``error`` set (one broken method must not hide the others).
    ``fraction``: the budget, of the in-core activation peak (of the whole in-core peak when
    ``engine_kw`` manages more than activations); ``engine_kw``: more ``OutOfCore`` options;
    ``recordings``: a directory for the engine's own recorded step (what it planned on);
    ``steps``: timed steps, if not ``setup.steps``; ``budget_bytes``: the budget itself,
    instead of a fraction."""
    case = setup.case
    engine_kw = dict(engine_kw or {})
    row = Row(case.name, method, fraction, label=case.label)
    if engine_kw:
        row.note = ", ".join(f"{k}={v!r}" for k, v in engine_kw.items())
    if fraction is not None:
        whole = set(engine_kw.get("manage", ("activations",))) != {"activations"}
        row.budget_bytes = int((setup.total_peak if whole else setup.activation_peak) * fraction)
    if budget_bytes is not None:
        row.budget_bytes = budget_bytes
    t0 = time.perf_counter()
    try:
        _train(setup, method, row, warmup, engine_kw, recordings, steps or setup.steps)
    except Exception as exc:   # the row says what broke; the log has the traceback
        traceback.print_exc()
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        row.wall_s = time.perf_counter() - t0
    return row


def _train(setup: Setup, method: str, row: Row, warmup: int, engine_kw: dict[str, Any],
           recordings: Path | None, steps: int) -> None:
    case = setup.case
    model = copy.deepcopy(setup.model).to(gpu_cases.DEVICE)
    if method == "checkpoint-every-block":
        row.note = f"{checkpoint_every(model, 1)} blocks checkpointed"
    elif method == "checkpoint-every-2nd":
        row.note = f"{checkpoint_every(model, 2)} blocks checkpointed"
    opt = case.optimizer_for(model.parameters())
    x, y = setup.x.to(gpu_cases.DEVICE), setup.y.to(gpu_cases.DEVICE)
    runner: Any = model
    if method.startswith("compile-budget-"):
        import torch._dynamo as dynamo
        import torch._functorch.config as fconfig

        dynamo.reset()
        fconfig.activation_memory_budget = float(method.rsplit("-", 1)[1])
        runner = torch.compile(model)
        warmup = max(warmup, 2)
    engine = None
    if method.startswith("ooc"):
        from ooc.engine import OutOfCore, Options

        engine_kw.setdefault("recompute", "never" if method == "ooc-swap-only" else "auto")
        if method.endswith("bounded"):   # a budget for the whole step, its plans bounded op by op (beside.py)
            engine_kw["options"] = Options(arena="pytorch", budget_covers="step")
        elif "one-arena" in method:
            engine_kw["options"] = Options(arena="pytorch")
        else:   # the VMM pool, asked for by name since one arena became the default on CUDA
            engine_kw.setdefault("options", Options(arena="pool"))
        engine = OutOfCore(model, opt, budget=row.budget_bytes, device="cuda", **engine_kw)
        if method.endswith("priced-once"):   # the recording step's op times alone (no warm runs)
            engine._planner.reprice = False
    scaler = torch.amp.GradScaler(gpu_cases.DEVICE) if case.scaler else None
    moved = [0]
    hooks = _counted_save_on_cpu(moved) if method == "save_on_cpu" else contextlib.nullcontext()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()   # else the first step reads the last run's peak
    torch.manual_seed(1)
    times, queued, per_step, rises, peak, reserved = [], [], [], [], 0, 0
    try:
        for i in range(warmup + steps):
            before = _counters(engine)
            moved[0] = 0
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
            reserved = max(reserved, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            at_start = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            _one_step(case, runner, opt, x, y, setup.loss_fn, engine, hooks, scaler)
            tq = time.perf_counter()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            # each step's peak, warm-up too: ooc's first steps record and try forms, and may
            # hold more than the later ones
            row.step_peaks.append(torch.cuda.max_memory_allocated())
            if i >= warmup:
                times.append(t1 - t0)
                queued.append(tq - t0)
                rises.append(torch.cuda.max_memory_allocated() - at_start)
                after = _counters(engine)
                step = {k: after[k] - before[k] for k in after} if engine else {"bytes_moved": 2 * moved[0]}
                if engine is not None:   # did this step run its plan (not on demand)? how long did the host wait?
                    st = engine.stats()
                    step["planned"], step["stall_s"] = st["last_planned"], st["last_stall_s"]
                per_step.append(step)
    except BaseException:   # an engine that failed mid-step gives its pool back all the same
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
        raise
    peak = max(peak, torch.cuda.max_memory_allocated())
    reserved = max(reserved, torch.cuda.max_memory_reserved())
    row.steps_ms = [round(t * 1e3, 2) for t in times]
    row.step_ms = statistics.median(times) * 1e3
    row.queued_ms = statistics.median(queued) * 1e3
    row.note += ("; " if row.note else "") + f"host queued {row.queued_ms:.1f} ms"
    row.samples_per_s = case.batch / (row.step_ms / 1e3)
    row.torch_peak_bytes = peak
    row.torch_reserved_peak_bytes = reserved
    row.peak_bytes = row.torch_peak_bytes
    if method == "in-core":   # the budgets' base: what a steady step allocates above its start
        setup.activation_peak = max(rises)
        setup.total_peak = row.torch_peak_bytes
    if method == "save_on_cpu":
        row.bytes_moved = int(statistics.median(s["bytes_moved"] for s in per_step))
    params = [p.detach().cpu() for p in model.parameters()]
    if setup.reference is None:
        setup.reference, setup.reference_steps = params, warmup + steps
    elif warmup + steps == setup.reference_steps:
        row.bitwise = all(torch.equal(a, b) for a, b in zip(setup.reference, params))
    else:   # other parameters after other step counts, whatever the method
        row.note += ("; " if row.note else "") + (f"bitwise not compared: {warmup + steps} steps, "
                                                  f"in-core {setup.reference_steps}")
    if engine is not None:
        _engine_figures(setup, engine, row, per_step)
        if recordings is not None and engine.last_recording is not None:
            recordings.mkdir(parents=True, exist_ok=True)
            engine.last_recording.to_json(recordings / f"{case.name}-{method}-{row.budget_fraction:g}.json")
        engine.close()
    del model, opt, runner


def _one_step(case: GpuCase, runner: Any, opt: Any, x: Any, y: Any, loss_fn: Any, engine: Any,
              hooks: Any, scaler: Any) -> None:
    """The user's loop: forward under the case's autocast, backward (scaled), update."""
    with case.attention(), engine.step() if engine is not None else contextlib.nullcontext():
        with hooks if engine is None else contextlib.nullcontext():
            with case.autocast():
                loss = loss_fn(runner(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)


def _engine_figures(setup: Setup, engine: Any, row: Row, per_step: list[dict[str, int]]) -> None:
    import scheduler

    st = engine.stats()
    row.pool_peak_bytes = int(st["pool_peak_mapped_bytes"] or 0)
    if engine._mem.arena == "pytorch":   # the swap-ins are among PyTorch's allocations: no pool of its own
        row.note += ("; " if row.note else "") + (f"swap-ins peaked at {row.pool_peak_bytes / 2**30:.2f} GiB "
                                                  "in PyTorch's allocator")
        row.pool_peak_bytes = 0
    row.peak_bytes = (row.torch_peak_bytes or 0) + row.pool_peak_bytes
    row.bytes_moved = int(statistics.median(s["bytes_in"] + s["bytes_out"] for s in per_step))
    row.bytes_recomputed = int(statistics.median(s["bytes_recomputed"] for s in per_step))
    row.stall_ms = statistics.median(s["stall_s"] for s in per_step) * 1e3
    row.note += ("; " if row.note else "") + f"the host's waits in a step {row.stall_ms:.1f} ms"
    row.forms = {"steps": st["steps"], "plans": st["plans"], "plain": st["steps.plain"],
                 "anchored": st["steps.anchored"],
                 "planned_timed": sum(s["planned"] for s in per_step)}
    if engine._plans.schedule is not None and setup.hardware is not None:
        schedule, hw = _timed_form(engine, per_step, setup)
        r = scheduler.simulate(schedule, hw, timeline=False)
        row.predicted_step_ms = r.total_s * 1e3
        if _hooked(per_step) and schedule is not engine._plans.schedule:
            row.note += ("; " if row.note else "") + "sim: the hook-driven form the timed steps ran"
        plan = engine._plans.schedule.summary()
        # the op times the engine priced its plan on (each op's fastest of the recording and the
        # re-priced runs); over in core's step, they overstate the ops (a slow host or a cold
        # allocator timed with them) and the plan pays for it
        row.priced_runs, fastest = _prices(engine)
        priced = (fastest or engine._plans.schedule.sequence).functions
        row.priced_op_ms = sum(f.cost.seconds or 0.0 for f in priced) * 1e3
        row.note += ("; " if row.note else "") + (f"its ops priced at {row.priced_op_ms:.1f} ms in all "
                                                  f"(recording + {row.priced_runs} timed runs)")
        row.note += ("; " if row.note else "") + (f"plan: {plan.get('bytes_in', 0) + plan.get('bytes_out', 0)} B moved, "
                    f"{plan.get('bytes_recomputed', 0)} B recomputed per step")


def _timed_form(engine: Any, per_step: list[dict[str, int]], setup: Setup) -> tuple[Any, Any]:
    """The schedule the timed steps ran and the hardware to simulate it on: the per-op plan
    with the host lane measured for per-op steps, or, when most timed steps were hook-driven,
    the kept form's plan (an anchored plan is another plan, moved to the hooks: swap only, or
    with the chains its templates rerun)
    with the host's time per op of a hook-driven step (``Setup.hook_host_s``)."""
    import scheduler
    from scheduler.step_plans import PlanState, at_settled_prices

    plan = engine._plans.schedule
    if not _hooked(per_step):   # the per-op plan, at the prices it settled on
        runs, fastest = _prices(engine)
        return at_settled_prices(PlanState(plan, runs, fastest)), setup.hardware
    entry = next((e for e in engine._plans.hooked._entries.values() if e.plan is plan and e.moved is not None), None)
    hw = scheduler.hardware(setup.hardware, host_op_s=setup.hook_host_s, host_quiet_op_s=setup.hook_host_s)
    return (plan if entry is None else entry.moved), hw


def _hooked(per_step: list[dict[str, int]]) -> bool:
    """Whether most timed steps ran a hook-driven form (plain or anchored)."""
    return 2 * sum(s["hooked"] for s in per_step) > len(per_step)


def _prices(engine: Any) -> tuple[int, Any]:
    """The planned runs that priced the running plan again, and the sequence at the fastest op
    times they measured (None: priced on its recording alone)."""
    cache = engine._plans
    return cache.prices(cache.guess(engine._store.start_key()))


def _counters(engine: Any) -> dict[str, int]:
    if engine is None:
        return {}
    st = engine.stats()
    return {"bytes_in": st["bytes_in"], "bytes_out": st["bytes_out"],
            "bytes_recomputed": st["bytes_recomputed"], "hooked": st["steps.plain"] + st["steps.anchored"]}


def _counted_save_on_cpu(moved: list[int]) -> Any:
    """``save_on_cpu(pin_memory=True)`` as PyTorch ships it, its pack hook wrapped to count
    the bytes it copies to the host (each comes back once in the backward)."""
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
    inner = hooks.pack_hook

    def pack(t: torch.Tensor) -> Any:
        moved[0] += t.numel() * t.element_size()
        return inner(t)

    hooks.pack_hook = pack
    return hooks
