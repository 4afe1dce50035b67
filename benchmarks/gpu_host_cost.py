"""Where a step's host time goes on a GPU (bench_gpu.py's "Host cost per op" section, issue 38).

The first GPU run (gpu.md, H200) found ooc's per-op steps of ResNet-50 b32 at 99 ms against
28 ms in core under a plan that moved nothing, and a ~320 M Llama (5,872 ops a step) at 0.19x
in core with both budgets and with swap only: ~80 us of host time an op, where the same code
costs ~15 us an op of ooc's own work on this project's 2-core CPU (benchmarks/results/
overhead.md). Nobody knows yet which part is PyTorch's Python dispatch, which ooc's Python and
which the CUDA calls under it. Five ways to run the same steps, each the median of the timed
steps between two synchronizations, and the ops a step runs (counted by the dispatch mode of
the second row):

- ``in-core``: plain PyTorch;
- ``dispatch mode only``: in core under a ``TorchDispatchMode`` that only calls each op
  (what any engine built on one pays: PyTorch's cost, not ooc's);
- ``ooc per op``: the engine with ``Options(hook_steps=False)`` and a budget far above the
  step's peak: its plan moves nothing, every op goes through its dispatch mode, and the ops
  the plan gives no role are only run and recorded (quiet ops);
- ``ooc per op, every op looked at``: the same with no quiet op (the per-op path before them);
- ``ooc``: the engine's default with the same budget: plain steps (no op intercepted).

Then a profile (``cProfile``) of one ``ooc per op`` step: the functions with the most own
time, which name the part that costs.
"""

from __future__ import annotations

import contextlib
import copy
import cProfile
import pstats
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpu_cases
from gpu_cases import GpuCase

CASE = GpuCase("resnet50", "ResNet-50 b32", 32, "sgd")
QUICK_CASE = GpuCase("resnet50", "ResNet-50 b4 64x64 (quick)", 4, "sgd", image_size=64)
WARMUP, STEPS, TOP = 8, 5, 20
QUICK_WARMUP, QUICK_STEPS = 2, 2   # the dry run's: each row's code runs, its figures mean nothing


class _Counting(TorchDispatchMode):
    """Calls each op as it comes, and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_cost(quick: bool) -> tuple[list[str], dict[str, float]]:
    """The section's markdown lines (see the module docstring), and the host's seconds per op
    the simulator charges the engine's per-op path (``Hardware.host_op_s`` for an op it looks
    at, ``host_quiet_op_s`` for a quiet one), from the time each step took to queue: every op
    looked at gives the first; the default per-op path, with its quiet ops, the second."""
    from ooc.engine import Options, OutOfCore

    case = QUICK_CASE if quick else CASE
    warmup, steps = (QUICK_WARMUP, QUICK_STEPS) if quick else (WARMUP, STEPS)
    model0, x0, y0, loss_fn = case.build()
    x, y = x0.to(gpu_cases.DEVICE), y0.to(gpu_cases.DEVICE)
    mode = _Counting()

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(model0).to(gpu_cases.DEVICE)
        return model, case.optimizer_for(model.parameters())

    def trained(around: Callable[[torch.nn.Module, torch.optim.Optimizer], Any]) -> list[tuple[float, float]]:
        model, opt = fresh()
        ctx = around(model, opt)

        def step() -> None:
            with ctx() if callable(ctx) else ctx:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return _timed(step, warmup, steps)

    # in core, and the budget: four times the step's rise above its start (at least 256 MiB),
    # at most half the device: the engine's plan moves nothing
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rows = [("in-core", trained(lambda m, o: contextlib.nullcontext), "")]
    rise = torch.cuda.max_memory_allocated() - start
    budget = min(max(4 * rise, 256 << 20), torch.cuda.get_device_properties(0).total_memory // 2)
    rows.append(("dispatch mode only", trained(lambda m, o: lambda: mode), ""))
    ops = mode.ops // (warmup + steps)
    profile: pstats.Stats | None = None
    quiet = 0
    for label, hook_steps in (("ooc per op", False), ("ooc per op, every op looked at", False), ("ooc", True)):
        engines = []

        def engine_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
            e = OutOfCore(model, opt, budget=budget, device="cuda", options=Options(hook_steps=hook_steps))
            if label.endswith("looked at"):
                e._plans.quiet_ops = frozenset   # no op left quiet
            engines.append((e, model, opt))
            return e.step
        times = trained(engine_of)
        engine, model, opt = engines[0]
        st = engine.stats()
        forms = ", ".join(f"{k[6:]} {v}" for k, v in st.items() if k.startswith("steps.") and v)
        if label == "ooc per op":
            quiet = len(engine._plans.quiet_ops())
            forms += f"; {quiet} quiet ops"
            profiler = cProfile.Profile()
            torch.cuda.synchronize()
            profiler.enable()
            with engine.step():
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            profiler.disable()
            profile = pstats.Stats(profiler)
        rows.append((label, times, f"{forms}; {st['bytes_in'] + st['bytes_out']} B moved"))
        engine.close()
    step_s = {label: statistics.median(s for s, _ in times) for label, times, _ in rows}
    queue_s = {label: statistics.median(q for _, q in times) for label, times, _ in rows}
    looked = queue_s["ooc per op, every op looked at"] / max(ops, 1)
    quiet_s = (queue_s["ooc per op"] - (ops - quiet) * looked) / quiet if quiet else looked
    host = {"host_op_s": max(looked, 0.0), "host_quiet_op_s": max(quiet_s, 0.0),
            "hook_host_s": queue_s["ooc"] / max(ops, 1)}   # not the simulator's: a hook-driven step's
    base = step_s["in-core"]
    lines = [f"{case.label}, {ops} ops a step; budget {budget / 2**30:.2f} GiB (the plan moves nothing). "
             f"Median of {steps} steps after {warmup}, each between two synchronizations; 'queued' is the "
             "host's time until the step's code returned (its ops queued, the device maybe still busy).", "",
             "| run | step | vs in-core | queued | host us per op over in-core | note |",
             "|---|---:|---:|---:|---:|---|"]
    for label, _, note in rows:
        seconds = step_s[label]
        over = "" if label == "in-core" else f"{(seconds - base) / max(ops, 1) * 1e6:+.1f}"
        lines.append(f"| {label} | {seconds * 1e3:.1f} ms | {seconds / base:.2f}x | {queue_s[label] * 1e3:.1f} ms "
                     f"| {over} | {note} |")
    lines += ["", f"The simulator's host lane, from these: {host['host_op_s'] * 1e6:.1f} us to queue an op the "
              f"engine looks at, {host['host_quiet_op_s'] * 1e6:.1f} us a quiet one (`Hardware.host_op_s`, "
              "`host_quiet_op_s`; the 'sim' column of the cases above and below uses them); "
              f"{host['hook_host_s'] * 1e6:.1f} us an op of a hook-driven step (the `ooc` row: "
              "the host lane of a row whose timed steps ran a plain or anchored form)."]
    if profile is not None:
        lines += ["", f"One `ooc per op` step under cProfile (its own overhead included): the {TOP} functions "
                  "with the most own time.", "", "| function | where | calls | own ms | with callees ms |",
                  "|---|---|---:|---:|---:|"]
        for (path, line, name), (_, calls, own, cumulative, _) in sorted(
                profile.stats.items(), key=lambda kv: -kv[1][2])[:TOP]:
            lines.append(f"| `{name}` | {_where(path, line)} | {calls} | {own * 1e3:.2f} | {cumulative * 1e3:.2f} |")
    return lines, host


def _timed(one_step: Callable[[], None], warmup: int, steps: int) -> list[tuple[float, float]]:
    """(step, queued) seconds of the ``steps`` steps after ``warmup``, each step between two
    synchronizations; queued: until its code returned."""
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0, t1 - t0))
    return times


def _where(path: str, line: int) -> str:
    """``path:line`` from the package down (``torch/...``, ``ooc/...``), or the builtin's mark."""
    if path == "~":
        return "(built-in)"
    for root in ("/torch/", "/ooc/", "/vmm/", "/scheduler/", "/transformers/"):
        k = path.rfind(root)
        if k >= 0:
            return f"{path[k + 1:]}:{line}"
    return f"{path.rsplit('/', 1)[-1]}:{line}"
