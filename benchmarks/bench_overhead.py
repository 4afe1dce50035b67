"""What the engine costs per op: a planned step that moves nothing, against in-core training.

    python benchmarks/bench_overhead.py [--quick] [--rounds N] [--steps N] [--out PATH]

ResNet-18 (torchvision's, if importable, else the zoo's copy of its architecture) at batch 8,
on 224-pixel images (the ImageNet shape) and on 32-pixel ones (CIFAR's: a step of a tenth
of a second or so, where a fixed cost per op weighs most), trained with SGD, four ways:

- ``in-core``: plain PyTorch;
- ``dispatch mode only``: plain PyTorch under a ``TorchDispatchMode`` that only forwards each
  op: what PyTorch's own Python dispatch costs per op, the floor of any engine that sees
  every op in Python (ooc records and follows its plan from there);
- ``ooc, nothing moves``: ``OutOfCore`` with a budget of twice the managed peak, so the
  plan moves no byte (checked: the row says so): the engine's own cost. After one step that
  follows the plan, its steps run plain (no op intercepted, ``ooc/runtime/plain_step.py``);
- ``ooc, nothing moves, per-op path``: the same with plain steps off
  (``engine._plans.hooked.enabled = False``): every op through the engine's dispatch mode, as a plan
  that moves bytes runs; the ops its plan gives no role only run and are recorded (quiet ops,
  ``scheduler.schedule.quiet_functions``);
- ``ooc, nothing moves, per-op path, every op looked at``: the same with no quiet op (what
  the per-op path cost before them);
- ``ooc 1/4``: a budget of a quarter of the managed peak (the bytes moved cost on top), or
  the smallest budget the planner accepts where a quarter is below it.

Every case runs in a fresh process, the cases interleaved in each of ``--rounds`` rounds; a
case's step time is the median of its steps after the first three (ooc records its first
step, re-plans once when SGD's momentum appears, and runs the plan once through its per-op path
before its steps run plain); a ratio is the median over rounds of
case / in-core in the same round, the range over rounds beside it. The per-op figures
divide a difference of step times by the ops per step (from the engine's plan), and
``Python calls / op`` counts the calls into ooc's own functions during one planned step
under ``cProfile`` (deterministic: a measure of the per-op work that no load on the machine
changes). Parameters after the run are compared bit for bit with in-core's.

``--quick``: ResNet-18 at batch 2 on 32-pixel images, one round of 3 steps (the smoke test).
Writes benchmarks/results/overhead.md (``--quick``: overhead-quick.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

import scheduler  # noqa: E402
from scheduler.errors import BudgetTooSmall  # noqa: E402
from vmm.units import format_size  # noqa: E402

MiB = 1 << 20
TARGET = 1.05   # issue 16 item 9: nothing moved, at most this much slower than in-core


@dataclass(frozen=True)
class Setting:
    """One model shape: what every case of it trains."""

    label: str
    batch: int
    image_size: int
    chunk: int | None = None   # None: the engine's default (it adapts)


FULL = (Setting("ResNet-18, 224 px", 8, 224), Setting("ResNet-18, 32 px", 8, 32, chunk=64 << 10))
QUICK = (Setting("ResNet-18, 32 px", 2, 32, chunk=64 << 10),)


@dataclass
class Row:
    method: str
    budget: int | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    cpu_ratios: list[float] = field(default_factory=list)
    identical: bool | None = None

    @property
    def step_s(self) -> float:
        return median(r["step_s"] for r in self.results)

    @property
    def cpu_s(self) -> float:
        return median(r["cpu_s"] for r in self.results)


# -- the child: one case in a fresh process --------------------------------------------------------


def _build(setting: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any, str]:
    """Model, optimizer, batch and loss from seed 0: every case trains the same thing."""
    import torch
    import torch.nn.functional as F

    from ooc import models

    torch.manual_seed(0)
    try:
        import torchvision

        model, source = torchvision.models.resnet18(), "torchvision"
    except Exception:   # not installed, or built for another torch (its import raises then)
        model, source = models.get("resnet18"), "ooc.models (torchvision's architecture)"
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = models.example_batch("resnet18", setting["batch"], image_size=setting["image_size"])
    return model, opt, x, y, F.cross_entropy, source


def _child(spec: dict[str, Any]) -> None:
    import cProfile
    import pstats

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import ooc
    from ooc.host import cpu_allocator

    class Forward(TorchDispatchMode):
        """Every op through Python and straight on: the floor of a dispatch-mode engine."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model, opt, x, y, loss_fn, source = _build(spec["setting"])
    method = spec["method"]
    engine = None
    if method.startswith("ooc"):
        chunk = spec["setting"]["chunk"]
        engine = ooc.OutOfCore(model, opt, budget=spec["budget"], options=ooc.Options(chunk=chunk or None))
        engine._plans.hooked.enabled = "per-op path" not in method
        if "every op looked at" in method:
            engine._plans.quiet_ops = frozenset   # no op left quiet: the per-op path before quiet ops

    def step() -> None:
        if engine is not None:
            with engine.step():
                loss_fn(model(x), y).backward()
                engine.optimizer_step()
            return
        with Forward() if method == "dispatch mode only" else contextlib.nullcontext():
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    times, cpus, misses = [], [], None
    for k in range(spec["steps"]):
        before = cpu_allocator.stats() if engine is not None and k == spec["steps"] - 1 else None
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if before:   # the last step's large allocations the allocator's cache could not serve
            misses = cpu_allocator.stats()["misses"] - before["misses"]
    steady = slice(3, None) if len(times) > 4 else slice(1, None) if len(times) > 1 else slice(None)
    out: dict[str, Any] = {"step_s": median(times[steady]), "cpu_s": median(cpus[steady]),
                           "times": times, "source": source, "threads": torch.get_num_threads(),
                           "misses": misses}
    if spec.get("params_out"):   # before the profiled step below: the same steps as in-core
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, spec["params_out"])
    if engine is not None:
        stats = engine.stats()
        plan = common.plan_stats(stats)
        out.update(ops=plan.get("functions"), planned=stats["last_planned"],
                   moved=plan.get("bytes_in", 0) + plan.get("bytes_out", 0),
                   managed=plan.get("variables"), chunk=engine._mem.chunk, plain_steps=stats["steps.plain"])
        if spec.get("profile"):   # one more planned step, counting calls into ooc's functions
            prof = cProfile.Profile()
            prof.enable()
            step()
            prof.disable()
            calls = sum(v[1] for k, v in pstats.Stats(prof).stats.items()
                        if f"{os.sep}ooc{os.sep}" in k[0])
            out["ooc_calls"] = calls
        engine.close()
    print("OVERHEAD-RESULT " + json.dumps(out), flush=True)


def run_child(spec: dict[str, Any], timeout: float = 1200) -> dict[str, Any]:
    return common.run_child(Path(__file__).resolve(), spec, "OVERHEAD-RESULT",
                            f"{spec['method']} case of {spec['setting']['label']}", timeout)


# -- the parent: rounds, table -------------------------------------------------------------------------


def measure(setting: Setting, rows: list[Row], rounds: int, steps: int, threads: int | None,
            tmp: Path, log) -> None:
    for r in range(rounds):
        for row in rows:
            params = str(tmp / f"{setting.image_size}-{setting.batch}-{row.method}.pt") if r == 0 else None
            spec = {"setting": asdict(setting), "method": row.method, "budget": row.budget,
                    "steps": steps, "params_out": params, "threads": threads,
                    "profile": r == 0 and row.method.startswith("ooc, nothing moves")}
            res = run_child(spec)
            res["params"] = params
            row.results.append(res)
            log(f"  round {r + 1}/{rounds} {setting.label} {row.method}: {res['step_s']:.3f} s/step")
        base = rows[0].results[-1]
        for row in rows:
            row.ratios.append(row.results[-1]["step_s"] / base["step_s"])
            row.cpu_ratios.append(row.results[-1]["cpu_s"] / base["cpu_s"])
    ref = rows[0].results[0]["params"]
    for row in rows[1:]:
        row.identical = common.same_state(ref, row.results[0]["params"])


def table(setting: Setting, rows: list[Row], peak: int) -> tuple[list[str], float | None]:
    inc, mode, full, per_op_path, looked = rows[0], rows[1], rows[2], rows[3], rows[4]
    ooc0 = full.results[0]
    ops = ooc0.get("ops") or 0
    lines = [f"### {setting.label}: batch {setting.batch}, {setting.image_size}x{setting.image_size} images",
             "",
             f"Model from {ooc0['source']}; {ops} ops per step; managed peak {format_size(peak)} "
             f"(activations of at least half a chunk, chunk {format_size(ooc0['chunk'])}); "
             f"'nothing moves' plan: {ooc0['moved']} bytes moved, {ooc0['managed']} managed tensors; "
             f"plain steps in its run: {ooc0.get('plain_steps', 0)} of {len(ooc0['times'])}.",
             ""]
    body = []
    for row in rows:
        lo, hi = min(row.ratios), max(row.ratios)
        per_op = (row.step_s - inc.step_s) / ops * 1e6 if ops and row is not inc else None
        moved, misses = row.results[-1].get("moved"), row.results[-1].get("misses")
        body.append([row.method, format_size(row.budget) if row.budget else "-", f"{row.step_s:.3f}",
                     f"{median(row.ratios):.3f}x ({lo:.2f}-{hi:.2f})",
                     f"{median(row.cpu_ratios):.3f}x ({min(row.cpu_ratios):.2f}-{max(row.cpu_ratios):.2f})",
                     f"{per_op:+.1f}" if per_op is not None else "-",
                     f"{moved / MiB:,.0f}" if moved is not None else "-",
                     str(misses) if misses is not None else "-",
                     "(reference)" if row is inc else ("yes" if row.identical else "NO")])
    lines += common.md_table(["method", "budget", "step s (wall)", "vs in-core, wall (range over rounds)",
                              "vs in-core, CPU time", "us/op over in-core (wall)", "MiB moved/step",
                              "large blocks faulted in/step", "params bitwise = in-core"], body)
    ratio, cpu_ratio = median(full.ratios), median(full.cpu_ratios)
    floor_us = (mode.cpu_s - inc.cpu_s) / ops * 1e6 if ops else float("nan")
    engine_us = (full.cpu_s - mode.cpu_s) / ops * 1e6 if ops else float("nan")
    calls, per_op_calls = ooc0.get("ooc_calls"), per_op_path.results[0].get("ooc_calls")
    per_op_us = (per_op_path.cpu_s - mode.cpu_s) / ops * 1e6 if ops else float("nan")
    looked_us = (looked.cpu_s - mode.cpu_s) / ops * 1e6 if ops else float("nan")
    looked_calls = looked.results[0].get("ooc_calls")
    lines += ["",
              f"- engine with nothing moved: **{ratio:.3f}x** in-core in wall time, {cpu_ratio:.3f}x in "
              f"CPU time (target <= {TARGET:.2f}x: {'met' if ratio <= TARGET else 'not met'} in wall time, "
              f"{'met' if cpu_ratio <= TARGET else 'not met'} in CPU time); {inc.results[0]['threads']} "
              f"torch thread(s)",
              f"- per op, in CPU time (medians): {floor_us:+.1f} us of PyTorch's Python dispatch (the "
              f"mode-only row minus in-core); the engine {engine_us:+.1f} us above that with plain "
              f"steps, {per_op_us:+.1f} us on its per-op path (ooc's own work per op, its step start and "
              f"end, and memory faulted in again: the column before last)",
              f"- Python calls into ooc's functions in one step that moves nothing: plain "
              f"{calls if calls is not None else '-'} ({(calls or 0) / ops:.2f} per op), per-op path "
              f"{per_op_calls if per_op_calls is not None else '-'} ({(per_op_calls or 0) / ops:.1f} per op)"
              if ops else "- Python calls per op: not measured",
              f"- quiet ops (the per-op path runs the ops its plan gives no role with none of its checks): "
              f"the engine {per_op_us:+.1f} us per op above the mode with them, {looked_us:+.1f} us with "
              f"every op looked at (CPU time, medians); Python calls into ooc {per_op_calls} against "
              f"{looked_calls}" if ops else "- quiet ops: not measured",
              ""]
    return lines, ratio


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--rounds", type=int, help="rounds of interleaved cases (default 5; quick 1)")
    ap.add_argument("--steps", type=int, help="steps per case (default 10, the first three warm-up; quick 3)")
    ap.add_argument("--threads", type=int, help="torch threads in every case (default: torch's default; "
                    "on a shared machine, 1 keeps OpenMP from spinning while other jobs hold a core)")
    args = common.parse_or_run_child(ap, _child)
    if args is None:
        return
    rounds = max(1, args.rounds or (1 if args.quick else 5))
    steps = max(3, args.steps or (3 if args.quick else 10))
    settings = QUICK if args.quick else FULL
    log = functools.partial(print, flush=True)
    load0, t0 = common.load_average(), time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for setting in settings:
            chunk = setting.chunk or 2 * MiB
            seq = managed_sequence(setting, chunk)
            peak = seq.in_core_peak_bytes
            quarter, label = max(peak // 4, chunk), "ooc 1/4"
            try:
                scheduler.plan(seq, budget=quarter)
            except BudgetTooSmall as e:   # a small model: one op's tensors take more than 1/4
                quarter, label = e.minimum, "ooc, smallest feasible budget"
            rows = [Row("in-core"), Row("dispatch mode only"), Row("ooc, nothing moves", max(2 * peak, chunk)),
                    Row("ooc, nothing moves, per-op path", max(2 * peak, chunk)),
                    Row("ooc, nothing moves, per-op path, every op looked at", max(2 * peak, chunk)),
                    Row(label, quarter)]
            log(f"{setting.label}: batch {setting.batch}, managed peak {format_size(peak)}")
            measure(setting, rows, rounds, steps, args.threads, Path(tmp), log)
            results.append((setting, rows, peak))
    elapsed = time.perf_counter() - t0
    lines = common.header("Engine overhead per op: a planned step that moves nothing vs in-core", quick=args.quick,
                          notes=[
        f"command: `python benchmarks/bench_overhead.py{' --quick' if args.quick else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}`; {rounds} round(s), "
        f"{steps} steps per case (median of the steps after the first three), cases interleaved, each "
        "in a fresh process; ratios are medians over rounds of case / in-core in the same round",
        "ooc: activations managed (the default), SGD with momentum; 'us/op over in-core' = (step "
        "time - in-core step time) / ops per step; CPU time = the process's (all threads, kernel "
        "time included: zeroing pages counts), less disturbed than wall time by other jobs",
        f"load average (1, 5, 15 min) before: {load0}; after: {common.load_average()} on "
        f"{os.cpu_count()} cores (other jobs share them: read ratios, not seconds); wall time "
        f"{elapsed / 60:.1f} min",
    ])
    for setting, rows, peak in results:
        tlines, _ = table(setting, rows, peak)
        lines += tlines
    lines += ANALYSIS
    common.write_report(common.result_path("overhead", args.quick, out=args.out), lines)


def managed_sequence(setting: Setting, chunk: int) -> scheduler.VariableSequence:
    """The step's sequence with only the activations the engine manages (at least half a
    chunk, in whole chunks), from a meta trace at the setting's image side
    (``ooc.measure.managed_peak`` traces the zoo's usual side only)."""
    import torch

    from ooc import models
    from ooc.trace import trace
    from scheduler.ir import Function, Kind, Variable, VariableSequence

    with torch.device("meta"):
        net = models.get("resnet18")
    x, y = models.example_batch("resnet18", setting.batch, "meta", image_size=setting.image_size)
    seq = trace(net, x, targets=y, loss_fn=models.loss_fn("resnet18"), optimizer="sgd", device="meta")
    keep = {v: Variable(v, -(-var.nbytes // chunk) * chunk, var.kind, var.name, var.live_in, var.live_out)
            for v, var in seq.variables.items() if var.kind is Kind.ACTIVATION and var.nbytes >= chunk // 2}
    functions = tuple(Function(f.index, f.name, tuple(u for u in f.uses if u.var in keep), f.cost)
                      for f in seq.functions)
    return VariableSequence(functions, keep, {})


ANALYSIS = [
    "## Reading the figures",
    "",
    "- Every aten op of the step (forward, backward, optimizer) goes from PyTorch's dispatcher "
    "into Python and back: the 'dispatch mode only' row is that alone, with nothing done in "
    "Python. It is PyTorch's cost, not ooc's, and any engine built on a TorchDispatchMode pays it "
    "(about 11 us per op for an elementwise add on this machine, more for ops with many "
    "arguments; 2-3 us of it is the wrapper that keeps torch.compile out of the mode).",
    "- ooc's own work per op of a planned step: record the op (name, measured time, which "
    "storages it reads and creates: a step that diverges is re-planned from its own record), "
    "check it against the plan, look every input storage up (a managed tensor to make "
    "resident, a buffer to copy for a rollback), run the plan's actions (a list lookup, empty "
    "for most ops). Issue 16 item 9 cut it from ~27 to ~12 Python calls per op (the calls "
    "line; tests/ooc/test_op_cost.py keeps it there): the arguments are scanned only where the "
    "op's schema has tensors, ops are looked up by id (a dict keyed by the op calls its "
    "Python __hash__), a planned step's pack hook no longer takes the dispatch modes off the "
    "stack and back for each saved tensor, and a step managing activations only no longer "
    "walks the model's parameters and optimizer state twice.",
    "- The rest is memory: 'large blocks faulted in/step' counts allocations of 1 MiB or more "
    "that ooc's CPU allocator could not serve from its cache, whose pages the kernel maps and "
    "zeroes again (about 1 GB/s here). The cache was capped at half the budget then (at most "
    "256 MiB; the cap is gone since 2026-11-25), so a small budget cached little: at 32 px and a 7 MiB budget "
    "the weight gradients (47 MB, allocated anew each step) are faulted in every step, "
    "while in core glibc's heap keeps them. Measured apart on a quiet machine (one process "
    "per case, 2 threads, 32 px): in-core 131 ms, ooc 181 ms, ooc with the cap raised to "
    "256 MiB 155 ms, so about half of the engine's extra time at that size is the cap, the "
    "other half PyTorch's dispatch and ooc's per-op work.",
    "- Before and after the first part of issue 16 item 9 (the per-op path), measured with this script's cases interleaved (one "
    "thread, 3 rounds, 'ooc, nothing moves' at commit cce20f8 and after): 224 px 1.055x -> "
    "1.032x in-core, 32 px 1.53x -> 1.44x, Python calls into ooc per op 27.4 -> 12.4. With 2 "
    "threads on a quiet machine (32 px) the engine went from 1.51x to 1.38x.",
    "- Plain steps (issue 16 item 9, second part): the dispatch mode's own cost is more than "
    "the 5% target leaves on a small model, so no per-op path can meet it there. A plan that "
    "moves nothing now runs its steps as plain PyTorch once one step has followed it "
    "(ooc/runtime/plain_step.py): no op is intercepted; the pack hook compares the sizes "
    "autograd saves with the verified step's, and a step that saves more is kept near the "
    "budget and re-planned. What is left of the engine there: a pack and an unpack call per "
    "saved tensor, the buffers copied for a rollback, the step's start and end (the Python "
    "calls line). Its CPU allocator's cache is bounded by the step's live peak only in those "
    "steps (no cap of half the budget): 0 large blocks faulted in per step, where the per-op "
    "row, capped, faults the weight gradients in again.",
    "- Quiet ops (issue 38, for the GPU's host): a planned per-op step runs the ops its plan gives no "
    "role (no action around them, no variable used or made, in no recompute chain) without the per-op "
    "path's residency checks, rollback copies, bindings and actions, only recorded. They cut ooc's "
    "Python calls by about a fifth (the quiet-ops line: 6,109 against 7,808 a step at 32 px, 6,025 "
    "against 7,772 at 224 px). Their time is within this machine's noise: a first run (commit "
    "2eed09d, before quiet ops recorded their reads of what the step made) gave +15.9 against +28.4 "
    "us per op at 32 px, this one +38.8 against +31.9; in one process, the two engines' steps "
    "interleaved (ResNet-18 32 px b8, one thread, median CPU time of 50 steps each, three runs): 83.6 "
    "vs 86.0, 76.6 vs 76.2, 83.6 vs 83.8 ms, 0-3% less. Most of a planned op's cost is PyTorch's "
    "dispatch and what every op still needs.",
    "- The ratio falls as the step grows: at 224 px the ops are long and a fixed cost per op "
    "weighs little; at 32 px the same ops are short, and PyTorch's dispatch alone adds 7% "
    "(one thread) to 11-14% (two) to the step: more than the 1.05x target leaves.",
    "- CPU time counts every thread of the process: with 2 threads, an OpenMP worker spinning "
    "while the main thread runs Python between ops counts too, so per-op CPU figures are "
    "upper bounds. Timings on this machine are noisy (other jobs share its two cores): the "
    "ranges over rounds say how much; the calls per op do not depend on it.",
]


if __name__ == "__main__":
    main()
