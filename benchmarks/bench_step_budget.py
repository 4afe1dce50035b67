"""A budget for the whole step on this CPU: the process's peak against the budget given.

    python benchmarks/bench_step_budget.py [--quick] [--runs N] [--out PATH]

``OutOfCore(..., options=ooc.Options(budget_covers="step"))`` bounds every tensor of the step
(``scheduler/whole_step.py``): the managed tensors get what is left where the step holds the
most beside them, less the CPU allocator's cache. This measures, for ResNet-18 at batch 32
(SGD with momentum, 8 steps), in a fresh process per case (``ooc.measure``: VmHWM reset once
model, optimizer and batch are built, so the weights are in the baseline; the table adds them
back, as the budget covers them): in core, then step budgets at 7/8, 1 and 5/4 of the step's
in-core peak (every tensor, from a trace on ``meta``), and for each the same engine given the
managed budget the step budget chose (``budget_covers="managed"``: the same plan, the figures
of the default mode). Median step time of the steady steps, median over ``--runs`` runs; the
peaks are the largest over runs, from step 2 on (the steps before it record and plan) and of
every step. ``--quick``: a small CNN at batch 8, one run, one step budget, a few seconds a case.
Writes benchmarks/results/step-budget.md (``--quick``: step-budget-quick.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import common  # noqa: E402
from ooc import measure, models  # noqa: E402
from ooc.trace import trace  # noqa: E402
from vmm.units import format_size  # noqa: E402

MiB = 1 << 20
FULL = dict(model="resnet18", batch=32, steps=8, runs=3, fractions=(7 / 8, 1.0, 5 / 4))
STEADY = 2   # the steps before it record and plan (on demand: step_budget.on_demand_bound)
QUICK = dict(model="small_cnn", batch=8, steps=5, runs=1, fractions=(1.0,))


def whole_peak(model: str, batch: int) -> tuple[int, int]:
    """The step's in-core peak of every tensor (a trace on ``meta``), and its weights' bytes."""
    with torch.device("meta"):
        net = models.get(model)
    x, y = models.example_batch(model, batch, "meta")
    seq = trace(net, x, targets=y, loss_fn=models.loss_fn(model), optimizer="sgd", device="meta")
    return seq.in_core_peak_bytes, sum(p.numel() * p.element_size() for p in net.parameters())


def runs_of(case: measure.Case, n: int) -> list[measure.CaseResult]:
    return [measure.run_case(case) for _ in range(n)]


def row(label: str, results: list[measure.CaseResult], weights: int, budget: int | None) -> list[str]:
    """One case's cells: the steady peak (from ``STEADY`` on) and the whole run's, each with
    the weights added back (the step budget covers them; the baseline held them); and the
    steady peak less the libraries' code the first steps paged in (file-backed, reclaimable:
    no budget of tensors bounds it, in core pays it too), which is what the budget is judged
    on. That code came in before the steady steps and stays mapped, so the difference is an
    upper bound on the steady steps' own rise."""
    steady = max(r.peak_rise_bytes if r.steady_peak_rise_bytes is None else r.steady_peak_rise_bytes
                 for r in results) + weights   # None: this kernel cannot reset the peak (every step's)
    codes = [r.steady_code_rise_bytes for r in results if r.steady_code_rise_bytes is not None]
    code = min(codes) if len(codes) == len(results) else None   # the least: data's share is then the most
    whole = max(r.peak_rise_bytes for r in results) + weights
    total = max(r.peak_total_bytes for r in results)
    step = statistics.median(r.median_step_s for r in results)
    stats = results[0].stats or {}

    def within(peak: int) -> str:
        return "" if budget is None else (" (within)" if peak <= budget else " (**over**)")

    data = steady if code is None else steady - code
    return [label, "" if budget is None else format_size(budget),
            format_size(stats["budget"]) if stats else "",
            format_size(stats.get("step_held_bytes") or 0) if stats else "",
            format_size(stats.get("step_records_bytes") or 0) if stats else "",
            f"{steady / MiB:.1f} MiB", "" if code is None else f"{code / MiB:.1f} MiB",
            f"{data / MiB:.1f} MiB{within(data)}", f"{whole / MiB:.1f} MiB", f"{total / MiB:.0f} MiB",
            f"{step * 1e3:.0f} ms", format_size(stats.get("plan.bytes_out", 0)) if stats else "",
            format_size(stats.get("plan.bytes_recomputed", 0)) if stats else ""]


def main() -> None:
    parser = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--runs", type=int, default=None, help="fresh processes per case (default 3; quick 1)")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    runs = args.runs or cfg["runs"]
    whole, weights = whole_peak(cfg["model"], cfg["batch"])
    base = dict(model=cfg["model"], batch=cfg["batch"], steps=cfg["steps"], steady_from=STEADY)
    rows = [row("in core", runs_of(measure.Case(method="incore", **base), runs), weights, None)]
    for fraction in cfg["fractions"]:
        budget = int(whole * fraction)
        step = runs_of(measure.Case(method="ooc", budget=budget, budget_covers="step", **base), runs)
        rows.append(row(f"step budget {fraction:.3g} of the step's peak", step, weights, budget))
        managed = step[0].stats["budget"]
        rows.append(row("  the same managed budget, budget_covers='managed'",
                        runs_of(measure.Case(method="ooc", budget=managed, **base), runs), weights, None))
    lines = common.header(
        f"A budget for the whole step: {cfg['model']} batch {cfg['batch']}, SGD with momentum",
        quick=args.quick,
        notes=[f"command: `python benchmarks/bench_step_budget.py{' --quick' if args.quick else ''}`",
               f"the step's in-core peak of every tensor (trace on meta): {format_size(whole)}; "
               f"its weights {format_size(weights)}",
               f"{cfg['steps']} steps per process, {runs} processes per case; step time: median of the steady "
               "steps, median over processes; peaks: the largest over processes",
               f"load average (1 min): {common.load_average()}"])
    lines += common.md_table(
        ["case", "step budget", "managed budget", "held beside", "records", f"peak from step {STEADY}",
         f"code paged in before step {STEADY}", "peak less that code", "peak, every step", "process total", "step",
         "moved out", "recomputed"], rows)
    lines += ["", f"Peaks: the process's peak rise (VmHWM, reset once model, optimizer and batch were built, and "
              f"again before step {STEADY} for the first column) plus the weights, which were in the baseline "
              "and which the step budget covers; the steps on demand (step 0 records) are bounded by the "
              "allocator's live bytes too ('peak, every step'). "
              "'code paged in': the growth of the process's file-backed resident pages (RssFile) over the "
              f"steps before step {STEADY}, nearly all libtorch_cpu.so's code that training runs for the "
              "first time: VmHWM counts it, it is clean and reclaimable, in core pages in the same, and no "
              "budget of tensors bounds it; the budget is judged on the peak less it (an upper bound on "
              "the steady steps' own rise: that code stays mapped). "
              "'held beside': the most the recorded step held beside its managed tensors "
              "(`stats()['step_held_bytes']`); 'records': what the step budget keeps for the engine's own "
              "records of the step, Python objects (`stats()['step_records_bytes']`). The managed-mode rows "
              "run the engine at the managed budget the step budget chose: what the default mode gives when "
              "told that budget."]
    common.write_report(common.result_path("step-budget", args.quick, out=args.out), lines)


if __name__ == "__main__":
    main()
