"""Time to record one training step with ``ooc.trace`` on ``meta`` (no memory used).

    python benchmarks/bench_trace.py [--quick] [--runs N] [--out PATH]

Full mode: ResNet-50 at batch 1440 (224x224, the seed paper's case; target < 30 s), GPT-2
style decoders of 12 and 48 layers (width 768, seq 1024, batch 8), DenseNet-121, U-Net and
NNTrainer's VGG16 (32x32, batch 64); the median of ``--runs`` (3) traces each, plus the first
(cold) one. Model building is timed apart. ``--quick``: tiny sizes, one run each, a few seconds.
Writes a Markdown table to benchmarks/results/trace.md (``--quick``: trace-quick.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import common
import ooc
from ooc import models
from ooc.trace import summary
from vmm.units import format_size

# (label, zoo name, model keywords, batch, optimizer, note)
FULL = [
    ("ResNet-50", "resnet50", {}, 1440, "sgd", "224x224, paper case, target < 30 s"),
    ("ResNet-50", "resnet50", {}, 1440, "adam", "224x224"),
    ("GPT-2 12 layers", "gpt2", {"depth": 12}, 8, "adam", "width 768, seq 1024"),
    ("GPT-2 48 layers", "gpt2", {"depth": 48}, 8, "adam", "width 768, seq 1024"),
    ("DenseNet-121", "densenet121", {}, 256, "sgd", "224x224"),
    ("U-Net", "unet", {}, 16, "adam", "256x256, base 64, depth 4"),
    ("VGG16 (CIFAR)", "vgg16", {"small_input": True, "num_classes": 100}, 64, "sgd",
     "32x32, NNTrainer case"),
]
QUICK = [
    ("small CNN", "small_cnn", {}, 8, "adam", "64x64"),
    ("tiny transformer", "tiny_transformer", {}, 4, "adam", "2 layers, seq 32"),
    ("GPT-2 2 layers", "gpt2", {"depth": 2, "width": 128, "heads": 4, "seq_len": 128,
                                "vocab": 1000}, 2, "sgd", "width 128, seq 128"),
    ("ResNet-50", "resnet50", {}, 1440, "sgd", "224x224, one run"),
]


def bench(label: str, name: str, kw: dict, batch: int, opt: str, runs: int) -> dict:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = models.get(name, **kw)
    build = time.perf_counter() - t0
    x, y = models.example_batch(name, batch, "meta", **kw)
    t = common.median_of(
        lambda: ooc.trace(model, x, y, loss_fn=models.loss_fn(name), optimizer=opt, name=name),
        runs)
    info = summary(t.value)
    return {**info, "label": label, "batch": batch, "optimizer": opt, "build": build,
            "cold": t.times[0], "median": t.median, "min": t.min, "max": t.max, "runs": runs}


def flops(n: float) -> str:
    return f"{n / 1e12:.2f} T" if n >= 1e12 else f"{n / 1e9:.2f} G"


def main(argv: list[str] | None = None) -> int:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--runs", type=int, default=3, help="traces per model in full mode (default 3)")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cases = QUICK if args.quick else FULL
    runs = 1 if args.quick else max(1, args.runs)
    rows = []
    for label, name, kw, batch, opt, note in cases:
        r = bench(label, name, kw, batch, opt, runs)
        r["note"] = note
        rows.append(r)
        print(f"{label:<18} b{batch:<5} {opt:<5} {r['functions']:>6} fns  "
              f"peak {format_size(r['in_core_peak_bytes']):>10}  trace {r['median']:.2f} s "
              f"(cold {r['cold']:.2f} s, build {r['build']:.2f} s)", flush=True)

    lines = common.header("Time to trace one training step on meta (`ooc.trace`)",
                          quick=args.quick, notes=[
        f"ooc {ooc.__version__}",
        f"trace time = median of {runs} run(s) of `ooc.trace(model, x, y, optimizer=...)` on "
        f"meta (warm-up step + recorded step + building the sequence); cold = first run in the "
        f"process; build = constructing the model on meta. Machine shared with other jobs: "
        f"times are wall-clock.",
    ])
    table = []
    for r in rows:
        n_vars = sum(k["count"] for k in r["variables"].values())
        table.append([r["label"], r["batch"], r["optimizer"], r["functions"], n_vars,
                      format_size(r["in_core_peak_bytes"]), flops(r["flops"]),
                      f"{r['build']:.2f}", f"**{r['median']:.2f}**",
                      f"{r['min']:.2f}-{r['max']:.2f}", f"{r['cold']:.2f}",
                      f"{r['functions'] / r['median']:,.0f}", r["note"]])
    lines += common.md_table(
        ["model", "batch", "optimizer", "functions", "variables", "in-core peak", "FLOPs/step",
         "build s", "trace s (median)", "min-max s", "cold s", "ops/s", "note"],
        table, align="lrlrrrrrrrrrl")
    resnet = next((r for r in rows if r["label"] == "ResNet-50" and r["batch"] == 1440), None)
    if resnet is not None:
        verdict = "met" if resnet["median"] < 30 else "NOT met"
        lines += ["", f"Target (ResNet-50, batch 1440, on meta, < 30 s): {verdict} "
                      f"({resnet['median']:.2f} s)."]
    common.write_report(args.out or common.result_path("trace", args.quick), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
