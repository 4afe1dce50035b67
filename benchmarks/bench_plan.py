"""How long tracing and planning take: ResNet-50 at batch 1440, and GPT-2 style depth scaling.

    python benchmarks/bench_plan.py [--quick] [--runs N] [--out PATH]

Full mode (median of ``--runs`` = 3 each, wall clock):

1. trace ResNet-50 (224x224, SGD) at batch 1440 on meta with ``ooc.trace`` (target < 30 s);
2. plan it under a 16 GiB budget with ``scheduler.plan``, policies ``window`` (target < 1 s)
   and ``window-paper``; plan time includes ``check`` (every plan is proven safe before it
   is returned), whose own time is shown too;
3. plan time vs sequence length: GPT-2 style decoders (width 768, 12 heads, seq 1024,
   batch 8, Adam) of 12, 24, 48, 96 and 192 layers, traced once each on meta, planned at a
   quarter of their in-core peak (the same memory pressure at every depth), both window
   policies. The plot (plan.png) shows seconds vs functions with a least-squares line.

``--quick``: a small CNN and 2/4/8-layer toy decoders, one run each, a few seconds.
Writes benchmarks/results/plan.md and plan.png (``--quick``: plan-quick.*).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
import torch

import common
import ooc
from ooc import models
from scheduler.check import check
from scheduler.planner import plan
from vmm.units import format_size

GiB = 1 << 30
POLICIES = ("window", "window-paper")

# (label, zoo name, model keywords, batch, optimizer)
FULL_RESNET = ("ResNet-50 224x224", "resnet50", {}, 1440, "sgd")
QUICK_RESNET = ("small CNN 64x64", "small_cnn", {}, 8, "sgd")
GPT = {"width": 768, "heads": 12, "seq_len": 1024}
QUICK_GPT = {"width": 128, "heads": 4, "seq_len": 128, "vocab": 1000}
FULL_DEPTHS = (12, 24, 48, 96, 192)
QUICK_DEPTHS = (2, 4, 8)


def trace(name: str, kw: dict[str, Any], batch: int, optimizer: str) -> Any:
    with torch.device("meta"):
        model = models.get(name, **kw)
    x, y = models.example_batch(name, batch, "meta", **kw)
    return ooc.trace(model, x, y, loss_fn=models.loss_fn(name), optimizer=optimizer, name=name)


def time_plan(seq: Any, budget: int, policy: str, runs: int) -> dict[str, Any]:
    t = common.median_of(lambda: plan(seq, budget, policy=policy), runs)
    s = t.value
    c = common.median_of(lambda: check(s), runs)
    return {"policy": policy, "budget": budget, "median": t.median, "min": t.min, "max": t.max,
            "cpu": t.cpu, "check": c.median, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
            "peak": c.value.peak_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--runs", type=int, help="runs per measurement (default 3; quick 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    runs = max(1, args.runs or (1 if args.quick else 3))

    # 1-2. ResNet-50 at batch 1440: trace, then plan under 16 GiB.
    label, name, kw, batch, opt = QUICK_RESNET if args.quick else FULL_RESNET
    t_trace = common.median_of(lambda: trace(name, kw, batch, opt), runs)
    seq = t_trace.value
    budget = 16 * GiB if not args.quick else seq.in_core_peak_bytes // 2
    print(f"{label} b{batch}: {len(seq.functions)} functions, in-core peak "
          f"{format_size(seq.in_core_peak_bytes)}, traced in {t_trace.median:.2f} s", flush=True)
    resnet_plans = []
    for policy in POLICIES:
        r = time_plan(seq, budget, policy, runs)
        resnet_plans.append(r)
        print(f"  plan {policy:<13} {r['median']:.3f} s (check {r['check']:.3f} s), "
              f"{format_size(r['bytes_in'])} in", flush=True)

    # 3. Plan time vs sequence length.
    depths = QUICK_DEPTHS if args.quick else FULL_DEPTHS
    gkw = QUICK_GPT if args.quick else GPT
    gbatch = 2 if args.quick else 8
    scaling = []
    for depth in depths:
        t = common.median_of(lambda: trace("gpt2", {**gkw, "depth": depth}, gbatch, "adam"), 1)
        g = t.value
        b = g.in_core_peak_bytes // 4
        row = {"depth": depth, "functions": len(g.functions), "variables": len(g.variables),
               "uses": sum(len(f.uses) for f in g.functions), "in_core": g.in_core_peak_bytes,
               "budget": b, "trace": t.median}
        for policy in POLICIES:
            row[policy] = time_plan(g, b, policy, runs)
        scaling.append(row)
        print(f"GPT-2 {depth:>3} layers: {row['functions']:>6} functions, trace {t.median:.1f} s, "
              + ", ".join(f"{p} {row[p]['median']:.3f} s" for p in POLICIES), flush=True)
        del g

    # Linear fit (least squares) of plan CPU seconds vs functions, per policy: CPU time,
    # because wall time on this shared 2-core machine also counts other jobs' turns.
    fits = {}
    n = np.array([r["functions"] for r in scaling], dtype=float)
    for policy in POLICIES:
        s = np.array([r[policy]["cpu"] for r in scaling])
        slope, icept = np.polyfit(n, s, 1)
        pred = slope * n + icept
        r2 = 1 - float(((s - pred) ** 2).sum()) / float(((s - s.mean()) ** 2).sum() or 1.0)
        fits[policy] = (slope, icept, r2)

    # Report.
    lines = common.header(
        "Time to trace and to plan one training step", quick=args.quick,
        notes=[f"medians of {runs} run(s), wall clock, and CPU seconds of the process where "
               f"shown (the machine is shared with other jobs: wall time includes their turns, "
               f"CPU time is the work itself); plan time = `scheduler.plan(...)`, which includes "
               f"`check` (every plan is replayed and proven safe before it is returned); the "
               f"check column is `check(schedule)` alone",
               "traces on meta (`ooc.trace`, shapes only, no memory)"])
    lines += [f"## {label}, batch {batch}", ""]
    lines += common.md_table(
        ["step", "functions", "in-core peak", "budget", "wall s (median)", "min-max", "CPU s",
         "target"],
        [["trace on meta", len(seq.functions), format_size(seq.in_core_peak_bytes), "-",
          f"**{t_trace.median:.2f}**", f"{t_trace.min:.2f}-{t_trace.max:.2f}", f"{t_trace.cpu:.2f}",
          "< 30 s: " + ("met" if t_trace.median < 30 else "NOT met")]]
        + [[f"plan, policy {r['policy']}", len(seq.functions), format_size(seq.in_core_peak_bytes),
            format_size(r["budget"]), f"**{r['median']:.3f}** (check {r['check']:.3f})",
            f"{r['min']:.3f}-{r['max']:.3f}", f"{r['cpu']:.3f}",
            ("< 1 s: " + ("met" if r["median"] < 1 else "NOT met")) if r["policy"] == "window" else "-"]
           for r in resnet_plans])
    lines += ["", "Bytes the plans move per step: " + "; ".join(
        f"{r['policy']} {format_size(r['bytes_in'])} in / {format_size(r['bytes_out'])} out, "
        f"peak {format_size(r['peak'])}" for r in resnet_plans) + ".", ""]

    desc = (f"width {gkw['width']}, {gkw['heads']} heads, seq {gkw['seq_len']}, batch {gbatch}, Adam")
    lines += [f"## Plan time vs sequence length (GPT-2 style, {desc})", "",
              "Budget = 1/4 of each model's in-core peak. Trace: one run each. Plan: wall / CPU "
              "seconds, medians.", ""]
    rows = []
    for r in scaling:
        rows.append([r["depth"], f"{r['functions']:,}", f"{r['uses']:,}", f"{r['variables']:,}",
                     format_size(r["in_core"]), format_size(r["budget"]), f"{r['trace']:.1f}"]
                    + [f"{r[p]['median']:.3f} / {r[p]['cpu']:.3f} (check {r[p]['check']:.3f})"
                       for p in POLICIES]
                    + [f"{r['window']['cpu'] / r['functions'] * 1e6:.1f}"])
    lines += common.md_table(["layers", "functions", "uses", "variables", "in-core peak", "budget",
                              "trace s"] + [f"plan s, {p}: wall / CPU" for p in POLICIES]
                             + ["window CPU us/function"], rows)
    lines += ["", "Least-squares line, plan CPU seconds = a x functions + b: " + "; ".join(
        f"{p}: a = {fits[p][0] * 1e6:.1f} us/function, b = {fits[p][1]:.3f} s, R^2 = {fits[p][2]:.4f}"
        for p in POLICIES) + ". R^2 near 1 and a flat us/function column mean plan time grows "
        "linearly with the sequence.", "", f"![plan time vs functions]({_png(args).name})", ""]
    common.write_report(common.result_path("plan", args.quick, out=args.out), lines)

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, marker, color in zip(POLICIES, ("o", "s"), ("tab:blue", "tab:orange")):
        ax.plot(n, [r[policy]["cpu"] for r in scaling], marker, color=color,
                label=f"{policy}, CPU s (median)")
        ax.plot(n, [r[policy]["median"] for r in scaling], marker, color=color, mfc="none", ms=7,
                alpha=0.6, label=f"{policy}, wall s (median)")
        slope, icept, r2 = fits[policy]
        xs = np.linspace(0, n.max() * 1.05, 50)
        ax.plot(xs, slope * xs + icept, "--", lw=1, color=color,
                label=f"{policy} fit: {slope * 1e6:.1f} us/function, R$^2$={r2:.3f}")
    for r in scaling:
        ax.annotate(f"{r['depth']} layers", (r["functions"], r["window"]["cpu"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("functions in the step (aten ops)")
    ax.set_ylabel("plan time, s (includes check)")
    ax.set_title(f"scheduler.plan time vs sequence length\nGPT-2 style, {desc}, budget = in-core/4",
                 fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_plot(fig, _png(args))
    return 0


def _png(args: argparse.Namespace) -> Any:
    return common.result_path("plan", args.quick, ".png", out=args.out)


if __name__ == "__main__":
    sys.exit(main())
