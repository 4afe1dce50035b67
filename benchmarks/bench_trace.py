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
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import ooc
from ooc import models
from ooc.trace import summary
from vmm.units import format_size

RESULTS = Path(__file__).resolve().parent / "results"

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


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def bench(label: str, name: str, kw: dict, batch: int, opt: str, runs: int) -> dict:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = models.get(name, **kw)
    build = time.perf_counter() - t0
    x, y = models.example_batch(name, batch, "meta", **kw)
    times, seq = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        seq = ooc.trace(model, x, y, loss_fn=models.loss_fn(name), optimizer=opt, name=name)
        times.append(time.perf_counter() - t0)
    info = summary(seq)
    return {**info, "label": label, "batch": batch, "optimizer": opt, "build": build,
            "cold": times[0], "median": statistics.median(times), "min": min(times),
            "max": max(times), "runs": runs}


def flops(n: float) -> str:
    return f"{n / 1e12:.2f} T" if n >= 1e12 else f"{n / 1e9:.2f} G"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one run each")
    ap.add_argument("--runs", type=int, default=3, help="traces per model in full mode (default 3)")
    ap.add_argument("--out", type=Path, help="Markdown output (default results/trace.md)")
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

    out = args.out or RESULTS / ("trace-quick.md" if args.quick else "trace.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Time to trace one training step on meta (`ooc.trace`)",
        "",
        f"- machine: {machine()}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, ooc {ooc.__version__}, "
        f"commit {commit()}",
        f"- date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- mode: {'quick' if args.quick else 'full'}; trace time = median of {runs} run(s) of "
        f"`ooc.trace(model, x, y, optimizer=...)` on meta (warm-up step + recorded step + "
        f"building the sequence); cold = first run in the process; build = constructing the "
        f"model on meta. Machine shared with other jobs: times are wall-clock.",
        "",
        "| model | batch | optimizer | functions | variables | in-core peak | FLOPs/step "
        "| build s | trace s (median) | min-max s | cold s | ops/s | note |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        n_vars = sum(k["count"] for k in r["variables"].values())
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['optimizer']} | {r['functions']} | {n_vars} "
            f"| {format_size(r['in_core_peak_bytes'])} | {flops(r['flops'])} "
            f"| {r['build']:.2f} | **{r['median']:.2f}** | {r['min']:.2f}-{r['max']:.2f} "
            f"| {r['cold']:.2f} | {r['functions'] / r['median']:,.0f} | {r['note']} |")
    resnet = next((r for r in rows if r["label"] == "ResNet-50" and r["batch"] == 1440), None)
    if resnet is not None:
        verdict = "met" if resnet["median"] < 30 else "NOT met"
        lines += ["", f"Target (ResNet-50, batch 1440, on meta, < 30 s): {verdict} "
                      f"({resnet['median']:.2f} s)."]
    lines.append("")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
