"""The largest GPT-2 style model this CPU trains under a 2 GiB budget, in core and out of core.

    python benchmarks/bench_model_size.py [--quick] [--budget SIZE] [--time-limit MIN] [--out PATH]

A GPT-2 decoder of fixed width (1024, 16 heads, 256 tokens, vocabulary 8192, batch 2) grows
in depth; Adam, so every parameter carries 16 bytes of state (weight, gradient, two moments).

- In core: the deepest model whose training memory stays within the budget, found by a
  binary search over depths with real runs. Training memory = steady-state peak (VmHWM,
  reset after two warm-up steps) minus the process before the model was built (Python,
  PyTorch, ooc, warmed up by one in-core step of a depth-1 model of the family, freed): it
  includes the weights, which ``ooc.measure``'s peak rise does not (the model is built
  before its baseline); that rise is shown beside it.
- Out of core: ``OutOfCore(budget=2GiB, manage=(activations, params, grads,
  optimizer_state), policy="window")`` on growing depths (doubling the parameters), until a
  run fails or the next one would not finish within ``--time-limit`` (extrapolated from the
  last step time, linear in parameters). The limit here is time and disk, not memory: every
  step streams the whole state through the swap file. Also the in-core winner trained out
  of core, for a same-model step-time ratio. Depths 24, 48, 96 (311 M, 613 M, 1.2 G
  parameters: 4.6, 9.1, 18 GiB of state) are tried in turn.

Each case is one fresh process (``bench_nntrainer.run_steady``), 3 steps (2 warm-up, the
first records and plans, the second re-plans once Adam's state exists), so step times are
single steady steps for the big models: the point is what trains, and roughly how fast.
``--quick``: width 128, a 16 MiB budget, depth 1 in core, depths 3 and 6 out of core (the
last one moves bytes), a few seconds per case.
Writes benchmarks/results/model_size.md (``--quick``: model_size-quick.md).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402,F401  (its version goes in the header)

import common  # noqa: E402
from bench_nntrainer import Steady, run_steady  # noqa: E402

from ooc.errors import OOCError  # noqa: E402
from ooc.measure import Case  # noqa: E402
from vmm.units import format_size, parse_size  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
ALL = ("activations", "params", "grads", "optimizer_state")


@dataclass(frozen=True)
class Family:
    width: int
    heads: int
    seq_len: int
    vocab: int
    batch: int
    chunk: int
    incore_depths: tuple[int, ...]
    ooc_depths: tuple[int, ...]

    def kwargs(self, depth: int) -> dict:
        return dict(depth=depth, width=self.width, heads=self.heads, seq_len=self.seq_len,
                    vocab=self.vocab)

    def params(self, depth: int) -> int:
        w = self.width
        block = 12 * w * w + 13 * w        # attention 4w^2+4w, MLP 8w^2+5w, two LayerNorms 4w
        return depth * block + self.vocab * w + self.seq_len * w + 2 * w   # tied head, ln_f


FULL = Family(width=1024, heads=16, seq_len=256, vocab=8192, batch=2, chunk=2 * MiB,
              incore_depths=(2, 4, 6, 8, 10, 12), ooc_depths=(24, 48, 96))
QUICK = Family(width=128, heads=2, seq_len=64, vocab=512, batch=2, chunk=256 << 10,
               incore_depths=(1,), ooc_depths=(3, 6))


@dataclass
class Result:
    depth: int
    method: str
    steady: Steady | None = None
    error: str | None = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.steady is not None


def run(fam: Family, depth: int, method: str, budget: int, steps: int, log) -> Result:
    case = Case("gpt2", fam.batch, method, steps=steps, optimizer="adam", model_kwargs=fam.kwargs(depth),
                chunk=fam.chunk, budget=budget if method == "ooc" else None,
                manage=ALL if method == "ooc" else ("activations",))
    t0 = time.perf_counter()
    try:
        res = Result(depth, method, run_steady(case, warm=2, timeout=3600,
                                               warmup={"batch": 1, "model_kwargs": fam.kwargs(1)}))
    except OOCError as exc:
        res = Result(depth, method, error=str(exc)[-240:])
    s = res.steady
    log(f"  {method} depth {depth} ({fam.params(depth) / 1e6:,.0f} M params): "
        + (f"step {s.median_step_s:.2f} s, training memory {s.training_bytes / MiB:,.0f} MiB"
           if s else f"failed: {res.error}") + f" ({time.perf_counter() - t0:.0f} s)")
    return res


def search_incore(fam: Family, budget: int, steps: int, log) -> list[Result]:
    """Binary search over ``incore_depths``: the deepest whose training memory fits."""
    tried: dict[int, Result] = {}
    lo, hi = -1, len(fam.incore_depths)   # fam.incore_depths[lo] fits, [hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        d = fam.incore_depths[mid]
        r = tried[d] = run(fam, d, "incore", budget, steps, log)
        if r.fits and r.steady.training_bytes <= budget:
            lo = mid
        else:
            hi = mid
    return [tried[d] for d in sorted(tried)]


def grow_ooc(fam: Family, budget: int, steps: int, deadline: float, log) -> list[Result]:
    out: list[Result] = []
    for d in fam.ooc_depths:
        if out and out[-1].fits:
            prev = out[-1]
            # Extrapolate the whole case (build + every step) linearly in parameters.
            per_param = (prev.steady.build_s + sum(prev.steady.step_s)) / fam.params(prev.depth)
            need = per_param * fam.params(d) * 1.2
            if time.perf_counter() + need > deadline:
                out.append(Result(d, "ooc", note=f"not run: ~{need / 60:.0f} min expected, over the time limit"))
                break
        r = run(fam, d, "ooc", budget, steps, log)
        out.append(r)
        if not r.fits:
            break
    return out


def _row(fam: Family, r: Result, budget: int, ref_step: float | None, ref_params: int | None) -> list[str]:
    n = fam.params(r.depth)
    head = [f"{r.depth}", f"{n / 1e6:,.0f} M", format_size(16 * n), r.method]
    if r.steady is None:
        return head + [r.note or f"failed: {r.error}", "", "", "", "", "", "", ""]
    s = r.steady
    verdict = "yes" if r.method == "ooc" or s.training_bytes <= budget else "no (over budget)"
    plan = common.plan_stats(s.stats)
    moved = format_size(plan.get("bytes_in", 0) + plan.get("bytes_out", 0)) if plan else "-"
    per_param = "-"
    if ref_step and ref_params:
        per_param = f"{(s.median_step_s / n) / (ref_step / ref_params):.2f}x"
    return head + [verdict, f"{s.training_bytes / MiB:,.0f}", f"{s.rise_bytes / MiB:,.0f}",
                   f"{s.peak_steady / MiB:,.0f}", f"{s.median_step_s:.2f}", per_param, moved, _planned(s)]


def _planned(s: Steady) -> str:
    """Did the timed step execute its plan? (A diverged step finishes on demand: slower, and
    its memory is not bounded by the plan.)"""
    st = s.stats
    if not st:
        return "-"
    if st.get("last_diverged_at", -1) != -1:
        return f"**diverged at op {st['last_diverged_at']}**"
    return "yes" if st.get("last_planned") else "**no**"


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--budget", default=None, help="memory budget (default 2GiB; quick 16MiB)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="minutes for the whole search (default 7; quick 2)")
    ap.add_argument("--steps", type=int, default=3, help="steps per case (default 3: 2 warm-up + 1)")
    args = ap.parse_args()
    fam = QUICK if args.quick else FULL
    budget = parse_size(args.budget or ("16MiB" if args.quick else "2GiB"), what="budget")
    limit_s = 60 * (args.time_limit or (2 if args.quick else 7))
    steps = max(3, args.steps)
    log = functools.partial(print, flush=True)
    load0, t0 = os.getloadavg()[0], time.perf_counter()

    log(f"in core, budget {format_size(budget)}:")
    incore = search_incore(fam, budget, steps, log)
    best_in = max((r for r in incore if r.fits and r.steady.training_bytes <= budget),
                  key=lambda r: r.depth, default=None)
    log(f"out of core, budget {format_size(budget)}:")
    same = run(fam, best_in.depth, "ooc", budget, steps, log) if best_in else None
    grown = grow_ooc(fam, budget, steps, t0 + limit_s, log)
    best_ooc = max((r for r in grown if r.fits), key=lambda r: r.depth, default=None)
    load1, elapsed = os.getloadavg()[0], time.perf_counter() - t0

    ref_step = best_in.steady.median_step_s if best_in else None
    ref_params = fam.params(best_in.depth) if best_in else None
    rows = [_row(fam, r, budget, ref_step, ref_params) for r in incore]
    if same is not None:
        rows.append(_row(fam, same, budget, ref_step, ref_params))
    rows += [_row(fam, r, budget, ref_step, ref_params) for r in grown]

    lines = common.header(f"Largest GPT-2 style model trained under {format_size(budget)}", quick=args.quick, notes=[
        f"command: `python benchmarks/bench_model_size.py{' --quick' if args.quick else ''}`; "
        f"gpt2(width={fam.width}, heads={fam.heads}, seq_len={fam.seq_len}, vocab={fam.vocab}), "
        f"batch {fam.batch}, depth grown; Adam (16 B of state per parameter); {steps} steps per case "
        f"(2 warm-up), one process per case",
        "training memory = steady-state VmHWM (reset after the warm-up steps) minus the process "
        "before the model was built (PyTorch warmed up by one step of a depth-1 model); rise = ooc.measure's peak rise (above the built model, "
        "weights excluded); 'fits' for in-core = training memory <= budget; for ooc the budget "
        "bounds the managed tensors (all four kinds) and the run must complete",
        "time per parameter = (step s / parameters) relative to the largest in-core model",
        f"load average (1 min) before/after: {load0:.2f} / {load1:.2f} on {os.cpu_count()} cores; "
        f"wall time {elapsed / 60:.1f} min (limit {limit_s / 60:.0f})",
    ])
    lines += common.md_table(["depth", "parameters", "param+grad+Adam", "method", "fits / trains",
                              "training memory MiB", "rise MiB", "peak total MiB", "step s",
                              "time per parameter", "moved/step", "last step planned"], rows)
    lines.append("")
    if best_in is not None:
        lines.append(f"- largest in core within {format_size(budget)}: depth {best_in.depth}, "
                     f"{fam.params(best_in.depth) / 1e6:,.0f} M parameters, step {ref_step:.2f} s")
    if same is not None and same.fits and best_in is not None:
        lines.append(f"- the same model out of core: step {same.steady.median_step_s:.2f} s "
                     f"({same.steady.median_step_s / ref_step:.2f}x in-core), training memory "
                     f"{same.steady.training_bytes / MiB:,.0f} MiB")
    if best_ooc is not None:
        ratio = fam.params(best_ooc.depth) / fam.params(best_in.depth) if best_in else float("nan")
        lines.append(f"- largest out of core under the same budget (within the time limit): depth "
                     f"{best_ooc.depth}, {fam.params(best_ooc.depth) / 1e6:,.0f} M parameters "
                     f"({ratio:.1f}x the in-core one), step {best_ooc.steady.median_step_s:.2f} s")
    lines += [""] + ANALYSIS
    common.write_report(common.result_path("model_size", args.quick, out=args.out), lines)
    print("\n".join(lines))


ANALYSIS = [
    "## Reading the figures",
    "",
    "- In core, the budget has to hold the weights, their gradients, Adam's two moments (16 B "
    "per parameter), the activations and PyTorch's own working memory (its kernels and thread "
    "pools map tens of MiB once a step has run).",
    "- Out of core, the budget bounds the managed tensors only; what must fit is the largest "
    "single op's working set (for this family, the optimizer step of the tied embedding: "
    "weight, gradient and two moments of vocab x width) plus what the plan keeps resident. "
    "The model's size is then limited by the swap file's disk space and by time: every step "
    "streams the whole state through the file (weights in for the forward and again for the "
    "backward, gradients out and in, moments in and out, weights out), tens of bytes per "
    "parameter per step, at the disk's and the CPU's pace.",
    "- The process's own memory out of core is more than the budget: PyTorch's unmanaged "
    "allocations (small tensors, temporaries) and the engine's bookkeeping come on top; see "
    "the training memory column. The model is built in RAM before the engine takes it over "
    "(the zoo builds on the CPU), so building needs the weights' bytes once.",
    "- The rise column (ooc.measure's definition) spans the two warm-up steps, which run "
    "unplanned: the recording step, then the step after Adam has created its state. For "
    "parameters, gradients and optimizer state those steps are not held to the budget (the "
    "engine's own resident peak goes several times over it there), so the rise exceeds the "
    "budget even where the planned steps' training memory does not.",
    "- The same model out of core with nothing to move is still slower than in core: with "
    "parameters managed the engine switches Adam to its per-parameter implementation "
    "(foreach=False, so that one op touches one parameter's tensors), and every aten op "
    "passes through the engine's dispatch mode in Python.",
    "- Step times of the large models are single steady steps (a median would multiply the "
    "minutes): read them as orders of magnitude.",
]


if __name__ == "__main__":
    main()
