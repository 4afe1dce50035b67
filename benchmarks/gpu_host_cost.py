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


class _Counting(TorchDispatchMode):
    """Calls each op as it comes, and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def host_cost(quick: bool) -> list[str]:
    """The section's markdown lines (see the module docstring)."""
    from ooc.engine import Options, OutOfCore

    case = QUICK_CASE if quick else CASE
    model0, x0, y0, loss_fn = case.build()
    x, y = x0.to(gpu_cases.DEVICE), y0.to(gpu_cases.DEVICE)
    rows: list[tuple[str, float, str]] = []
    mode = _Counting()
    budget = 0

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(model0).to(gpu_cases.DEVICE)
        return model, case.optimizer_for(model.parameters())

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, around: Callable[[], Any]) -> None:
        with around():
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    # in core, and the budget: four times the step's rise above its start (at least 256 MiB),
    # at most half the device: the engine's plan moves nothing
    model, opt = fresh()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = _timed(lambda: step(model, opt, contextlib.nullcontext))
    rise = torch.cuda.max_memory_allocated() - start
    budget = min(max(4 * rise, 256 << 20), torch.cuda.get_device_properties(0).total_memory // 2)
    rows.append(("in-core", statistics.median(times), ""))
    del model, opt
    model, opt = fresh()
    times = _timed(lambda: step(model, opt, lambda: mode))
    ops = mode.ops // (WARMUP + STEPS)
    rows.append(("dispatch mode only", statistics.median(times), ""))
    del model, opt
    profile: pstats.Stats | None = None
    for label, hook_steps in (("ooc per op", False), ("ooc per op, every op looked at", False), ("ooc", True)):
        model, opt = fresh()
        engine = OutOfCore(model, opt, budget=budget, device="cuda", options=Options(hook_steps=hook_steps))
        if label.endswith("looked at"):
            engine._plans.quiet_ops = frozenset   # no op left quiet
        times = _timed(lambda: step(model, opt, engine.step))
        st = engine.stats()
        forms = ", ".join(f"{k[6:]} {v}" for k, v in st.items() if k.startswith("steps.") and v)
        rows.append((label, statistics.median(times), f"{forms}; {st['bytes_in'] + st['bytes_out']} B moved"))
        if label == "ooc per op":
            profiler = cProfile.Profile()
            torch.cuda.synchronize()
            profiler.enable()
            step(model, opt, engine.step)
            torch.cuda.synchronize()
            profiler.disable()
            profile = pstats.Stats(profiler)
        engine.close()
        del model, opt, engine
    base = rows[0][1]
    lines = [f"{case.label}, {ops} ops a step; budget {budget / 2**30:.2f} GiB (the plan moves nothing). "
             f"Median of {STEPS} steps after {WARMUP}, each between two synchronizations.", "",
             "| run | step | vs in-core | host us per op over in-core | note |", "|---|---:|---:|---:|---|"]
    for label, seconds, note in rows:
        over = "" if label == "in-core" else f"{(seconds - base) / max(ops, 1) * 1e6:+.1f}"
        lines.append(f"| {label} | {seconds * 1e3:.1f} ms | {seconds / base:.2f}x | {over} | {note} |")
    if profile is not None:
        lines += ["", f"One `ooc per op` step under cProfile (its own overhead included): the {TOP} functions "
                  "with the most own time.", "", "| function | where | calls | own ms | with callees ms |",
                  "|---|---|---:|---:|---:|"]
        for (path, line, name), (_, calls, own, cumulative, _) in sorted(
                profile.stats.items(), key=lambda kv: -kv[1][2])[:TOP]:
            lines.append(f"| `{name}` | {_where(path, line)} | {calls} | {own * 1e3:.2f} | {cumulative * 1e3:.2f} |")
    return lines


def _timed(one_step: Callable[[], None]) -> list[float]:
    """The times of the steps after ``WARMUP``, each between two synchronizations."""
    times = []
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_step()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
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
