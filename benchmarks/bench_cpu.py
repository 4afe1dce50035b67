"""Out-of-core training on this CPU: step time and process memory against in-core and checkpointing.

    python benchmarks/bench_cpu.py [--quick] [--rounds N] [--steps N] [--models A,B] [--out PATH]

For ResNet-50 (the issue's CNN), a small CNN (small_cnn) and a GPT-2 style transformer, each
at a batch where saved activations dominate memory, trains the same batches from the same
seed with:

- ``incore``: plain PyTorch;
- ``ooc`` (``OutOfCore``, activations managed, policy "window") at budgets of 1, 1/2, 1/4 and
  1/8 of the in-core peak of the managed tensors (``ooc.measure.managed_peak``, a meta
  trace; ResNet-50: 1, 7/8, 3/4, 1/2, 1/4; GPT: 7/8 too, a point of the frontier against
  checkpointing every 2nd block, which saves only 15-35% of in-core's rise); a budget below
  what the plan needs is reported as "infeasible (min X)". These run with the engine's
  defaults, recomputation included (the planner swaps or recomputes each activation the
  budget forces out, whichever it prices cheaper);
- ``ooc 1/4 swap-only``: the same at 1/4 with ``recompute="never"``, and ``ooc 1/4
  recompute=prefer``: every activation forced out that a chain can re-create is recomputed
  (issue 15's comparison: what each lever costs on this machine);
- ``checkpoint``: ``torch.utils.checkpoint`` around every block, and around every other block;
- ``ooc`` at 1/4 with ``verify=True`` (a checksum per swapped chunk), for the small CNN
  (ResNet-50 runs budgets 1, 1/2 and 1/4 only, to keep the run under a quarter of an hour).

Every case runs in a fresh process (``ooc.measure.run_case``): peak memory is the kernel's
VmHWM, as a rise above the footprint once model, optimizer and data are built (the memory
training needs), with the whole process's peak beside it. Step time is the median of the
steps after the first four (warm-up: ooc records its first step, re-plans once after the
optimizer creates its state, and prices the plan again after each of its first two runs, on
the fastest op times so far). Cases run in ``--rounds`` rounds, methods interleaved in each
round, so every round yields an in-core time measured minutes apart at most; the ratio is
the median over rounds of (case / in-core of the same round). Parameters after the run are
compared bit for bit with in-core's (``params_out`` + ``same_parameters``).

Every child runs in the caller's environment, untouched (``ooc.measure.child_env``): in-core
and checkpointing as PyTorch runs them by default, ooc with what the engine sets up itself.

Then the issue 4 targets (ResNet-50 at 1/4: step <= 1.15x in-core, peak rise >= 50 % below
in-core, faster than checkpointing at equal or lower peak memory) are checked and stated,
with where ooc's extra time goes: the ``ooc 1`` row moves nothing (the engine's per-op
dispatch and bookkeeping), the stall column is time spent waiting for transfers, and one
more small-CNN row at 1/4 with a single I/O thread shows what two I/O threads cost the two compute
threads on two cores. The verify and single-thread rows run in the first round only.

``--quick``: tiny models, fewer cases, one round of 3 steps (for the smoke test).
Writes benchmarks/results/cpu.md and cpu.png (``--quick``: cpu-quick.*).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from ooc.errors import OOCError  # noqa: E402
from ooc.measure import Case, CaseResult, case_result, child_env, managed_peak, run_case, same_parameters, steady_steps  # noqa: E402
from vmm.units import format_size  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Model:
    label: str
    name: str
    batch: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    chunk: int = 2 * MiB
    verify: bool = False   # add the verify=True and 1-I/O-thread rows at 1/4
    target: bool = False   # the CNN: its 1/4 row is checked against the targets
    fractions: tuple[str, ...] = ("1", "1/2", "1/4", "1/8")   # budgets, of the managed peak

    def describe(self) -> str:
        kw = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({kw}) batch {self.batch}" if kw else f"{self.name} batch {self.batch}"


GPT_FULL = dict(depth=6, width=256, heads=4, seq_len=256, vocab=8192)
# The CNN is "a ResNet or VGG from the zoo": ResNet-50 at 224 px, batch 8 (activations
# ~8x its parameters). The small CNN (64 px, 32 channels) moves more bytes per FLOP: the
# harder case for swapping, and the one the verify and I/O-thread rows are run on.
FULL = (Model("ResNet-50", "resnet50", 8, target=True, fractions=("1", "7/8", "3/4", "1/2", "1/4")),
        Model("CNN", "small_cnn", 32, verify=True),
        Model("GPT", "gpt2", 8, GPT_FULL, fractions=("1", "7/8", "1/2", "1/4", "1/8")))
QUICK = (Model("CNN", "small_cnn", 4, dict(width=16, blocks=4), chunk=256 << 10, verify=True,
               target=True),
         Model("GPT", "gpt2", 2, dict(depth=2, width=64, heads=2, seq_len=128, vocab=512),
               chunk=256 << 10))

#: --quick runs fewer cases (each is a fresh process importing torch: ~3 s before any work).
QUICK_FRACTIONS = {"CNN": ("1/4",), "GPT": ("1/4",)}


@dataclass
class Row:
    """One method on one model, over every round."""

    label: str
    case: Case
    verify: bool = False
    once: bool = False     # first round only (diagnostic rows)
    results: list[CaseResult] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    infeasible: str | None = None
    error: str | None = None
    identical: str | None = None

    def med(self, fn) -> float:
        return median(fn(r) for r in self.results)

    @property
    def step_s(self) -> float:
        return self.med(lambda r: r.median_step_s)

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    @property
    def rise(self) -> int:
        return int(self.med(lambda r: r.peak_rise_bytes))

    @property
    def total(self) -> int:
        return int(self.med(lambda r: r.peak_total_bytes))

    def stat(self, key: str) -> Any:
        st = self.results[-1].stats or {}
        return st.get(key)


# -- running cases -------------------------------------------------------------------------------


def run_verify_case(case: Case, timeout: float = 1800) -> CaseResult:
    """``run_case`` with ``OutOfCore(..., verify=True)``: ``Case`` has no ``verify`` field, so
    the child is ``ooc.measure``'s own, with ``ooc.OutOfCore`` wrapped before it runs."""
    code = ("import functools, json, sys, ooc\n"
            "from ooc import measure\n"
            "measure.VERIFY = True\n"
            "measure._child(json.loads(sys.argv[1]))\n"
            "sys.stdout.flush()\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(case))],
                          capture_output=True, text=True, timeout=timeout, env=child_env())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OOC-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        err = proc.stderr.strip().splitlines()
        raise OOCError(f"verify case of {case.model} failed: {err[-1] if err else proc.returncode}")
    return case_result(case, json.loads(line[len("OOC-RESULT "):]))


def _minimum(message: str) -> str | None:
    """The minimum budget named by a BudgetTooSmall message, if it is one."""
    m = re.search(r"at least ([0-9.]+ [KMGT]?i?B)", message)
    return m.group(1) if m else None


def build_rows(model: Model, steps: int, tmp: Path, quick: bool) -> tuple[list[Row], int]:
    peak = managed_peak(model.name, model.batch, chunk=model.chunk, model_kwargs=model.kwargs)
    base = Case(model.name, model.batch, "incore", steps=steps, model_kwargs=model.kwargs,
                chunk=model.chunk)
    out = lambda tag: str(tmp / f"{model.label}-{tag}.pt")  # noqa: E731
    rows = [Row("in-core", replace(base, params_out=out("incore")))]
    for frac in QUICK_FRACTIONS[model.label] if quick else model.fractions:
        rows.append(Row(f"ooc {frac}", replace(base, method="ooc", budget=int(peak * Fraction(frac)),
                                               params_out=out("ooc" + frac.replace("/", "of")))))
    if not quick or model.target:   # issue 15: the same budget without recomputation
        rows.append(Row("ooc 1/4 swap-only", replace(base, method="ooc", budget=peak // 4, recompute="never",
                                                     params_out=out("swap"))))
        if not quick:
            rows.append(Row("ooc 1/4 recompute=prefer", replace(base, method="ooc", budget=peak // 4,
                                                                recompute="prefer", params_out=out("prefer"))))
    if not quick or model.target:
        rows.append(Row("checkpoint (every block)", replace(base, method="checkpoint", params_out=out("cp1"))))
    if not quick or model.label == "GPT":
        rows.append(Row("checkpoint (every 2nd block)", replace(base, method="checkpoint2",
                                                            params_out=out("cp2"))))
    if model.verify:
        rows.append(Row("ooc 1/4 + verify", replace(base, method="ooc", budget=peak // 4,
                                                    params_out=out("verify")), verify=True, once=True))
        if not quick:
            rows.append(Row("ooc 1/4, 1 I/O thread", replace(base, method="ooc", budget=peak // 4, threads=1,
                                                             params_out=out("t1")), once=True))
    return rows, peak


def run_rounds(plans: list[tuple[Model, list[Row]]], rounds: int, log) -> None:
    for r in range(rounds):
        for model, rows in plans:
            # Rotate the order each round, so that no method always runs first (cold caches)
            # or always right after the heaviest one.
            order = rows[r % len(rows):] + rows[:r % len(rows)]
            done: dict[str, CaseResult] = {}
            for row in order:
                if row.infeasible or row.error or (row.once and r > 0):
                    continue
                case = row.case if r == 0 else replace(row.case, params_out=None)
                t0 = time.perf_counter()
                try:
                    res = run_verify_case(case) if row.verify else run_case(case)
                except OOCError as exc:
                    minimum = _minimum(str(exc))
                    if minimum:
                        row.infeasible = f"infeasible (min {minimum})"
                    else:
                        row.error = str(exc)[-300:]
                    log(f"  {model.label} {row.label}: {row.infeasible or row.error}")
                    continue
                row.results.append(res)
                done[row.label] = res
                log(f"  round {r + 1} {model.label} {row.label}: step {res.median_step_s:.3f} s, "
                    f"rise {res.peak_rise_bytes / MiB:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
            incore = done.get("in-core")
            if incore is not None:
                for row in rows:
                    if row.label in done:
                        row.ratios.append(done[row.label].median_step_s / incore.median_step_s)


def check_identical(rows: list[Row]) -> None:
    """Bitwise comparison with in-core's final state dict; when it differs, say whether the
    parameters differ or only buffers (BatchNorm's running statistics, which checkpointing's
    recomputed forward updates a second time)."""
    import torch

    ref = rows[0].case.params_out
    if not rows[0].results or not ref or not os.path.exists(ref):
        return
    for row in rows[1:]:
        if row.results and row.case.params_out and os.path.exists(row.case.params_out):
            if same_parameters(ref, row.case.params_out):
                row.identical = "yes"
                continue
            a = torch.load(ref, weights_only=True)
            b = torch.load(row.case.params_out, weights_only=True)
            diff = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
            only_stats = all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in diff)
            row.identical = ("parameters yes; BN running stats differ" if only_stats
                             else f"**NO** ({len(diff)} tensors differ)")


# -- reporting ---------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def table(model: Model, rows: list[Row], peak: int) -> list[str]:
    inc = rows[0]
    out = []
    for row in rows:
        budget = "-" if row.case.budget is None else format_size(row.case.budget)
        if not row.results:
            out.append([row.label, budget, row.infeasible or f"failed: {row.error}"] + [""] * 8)
            continue
        moved = (row.stat("plan.bytes_in") + row.stat("plan.bytes_out")) if row.stat("plan.functions") else None
        recomputed = row.stat("plan.bytes_recomputed") if row.stat("plan.functions") else None
        counted = row.results[-1].median_counted("bytes_in", "bytes_out")
        counted_re = row.results[-1].median_counted("bytes_recomputed")
        stall = row.stat("last_stall_s")
        planned = row.stat("last_planned")
        ident = row.identical or "-"
        if row is inc:
            ident = "(reference)"
        rel = row.rise / inc.rise - 1 if inc.results and inc.rise else float("nan")
        out.append([
            row.label + ("" if planned in (None, 1) else " (not planned!)"), budget,
            f"{row.step_s:.3f}", f"{row.ratio:.2f}x" + (f" ({min(row.ratios):.2f}-{max(row.ratios):.2f})"
                                                         if len(row.ratios) > 1 else ""), _mib(row.rise), f"{rel:+.0%}", _mib(row.total),
            "-" if stall is None else f"{stall:.3f}",
            "-" if moved is None else f"{moved / MiB:,.0f} / " + ("-" if counted is None else f"{counted / MiB:,.0f}"),
            "-" if recomputed is None else f"{recomputed / MiB:,.0f} / "
            + ("-" if counted_re is None else f"{counted_re / MiB:,.0f}"), ident])
    head = ["method", "budget", "step s", "vs in-core (range over rounds)", "peak rise MiB", "rise vs in-core",
            "peak total MiB", "stall s/step", "MiB moved/step (plan / counted)",
            "MiB recomputed/step (plan / counted)", "params bitwise = in-core"]
    return [f"### {model.label}: {model.describe()}", "",
            f"In-core peak of the managed tensors (activations >= {format_size(model.chunk // 2)}, "
            f"meta trace): {format_size(peak)}.", ""] + common.md_table(head, out)


def monotonic(rows: list[Row]) -> list[str]:
    """Issue 15 item 6: the measured peak rise never grows as the budget falls (the default
    ooc rows, by budget)."""
    pts = sorted(((r.case.budget, r.rise) for r in rows if re.fullmatch(r"ooc [0-9/]+", r.label) and r.results),
                 reverse=True)
    if len(pts) < 2:
        return []
    ok = all(b[1] <= a[1] for a, b in zip(pts, pts[1:]))
    chain = " / ".join(f"{_mib(rise)}" for _, rise in pts)
    return [f"Peak rise as the budget falls ({', '.join(format_size(b) for b, _ in pts)}): {chain} MiB: "
            f"{'never rises' if ok else '**rises**'}.", ""]


def targets(model: Model, rows: list[Row]) -> tuple[list[str], dict[str, bool | None]]:
    by = {r.label: r for r in rows}
    inc, q = by["in-core"], by["ooc 1/4"]
    lines = [f"## Issue 4 targets ({model.label}, ooc at 1/4 of the managed peak)", ""]
    if not q.results or not inc.results:
        lines += [f"- not measured: ooc 1/4 {q.infeasible or q.error}", ""]
        return lines, {"time": None, "memory": None, "checkpoint": None}
    word = lambda ok: "**PASS**" if ok else "**FAIL**"  # noqa: E731
    saved = 1 - q.rise / inc.rise
    cps = [r for r in rows if r.label.startswith("checkpoint") and r.results]
    beats = {cp.label: (q.ratio < cp.ratio, q.rise <= cp.rise) for cp in cps}   # same-round ratios
    verdict = {"time": q.ratio <= 1.15, "memory": saved >= 0.5,
               "checkpoint": bool(cps) and all(f and s for f, s in beats.values())}
    lines += [
        f"- step time <= 1.15x in-core: {word(verdict['time'])} ({q.ratio:.2f}x, rounds "
        f"{min(q.ratios):.2f}-{max(q.ratios):.2f}x; {q.step_s:.3f} s vs {inc.step_s:.3f} s)",
        f"- peak memory >= 50 % below in-core: {word(verdict['memory'])} (peak rise {_mib(q.rise)} "
        f"vs {_mib(inc.rise)} MiB: {saved:.1%} below; whole process {_mib(q.total)} vs {_mib(inc.total)} MiB)",
        f"- faster than torch.utils.checkpoint at equal or lower peak memory (ooc 1/4 both faster "
        f"and not larger than each checkpoint variant): {word(verdict['checkpoint'])}",
    ]
    oocs = [r for r in rows if r.label.startswith("ooc") and r.results and "verify" not in r.label
            and "thread" not in r.label]
    for cp in cps:
        faster, smaller = beats[cp.label]
        within = [r for r in oocs if r.rise <= cp.rise]
        best = min(within, key=lambda r: r.ratio, default=None)
        tail = ""
        if best is not None:
            tail = (f"; the fastest ooc point within its memory is {best.label} ({_mib(best.rise)} MiB, "
                    f"{best.ratio / cp.ratio - 1:+.1%} time)")
        lines.append(f"  - vs {cp.label} ({cp.ratio:.2f}x in-core, rise {_mib(cp.rise)} MiB): ooc 1/4 takes "
                     f"{q.ratio / cp.ratio - 1:+.1%} time at {q.rise / cp.rise - 1:+.0%} memory"
                     f" ({'faster' if faster else 'slower'}, {'not larger' if smaller else 'larger'}){tail}")
    dom = []
    for cp in cps:
        winners = [r.label for r in oocs if r.ratio <= cp.ratio and r.rise <= cp.rise]
        dom.append(f"{cp.label}: {', '.join(winners) if winners else 'no ooc point'}")
    lines += ["", "Frontier (ooc points at least as fast and as small as each checkpoint point): "
              + "; ".join(dom) + ". Differences of a few per cent are within this machine's "
              "round-to-round noise (see the ranges).", ""]
    lines += breakdown(rows)
    return lines, verdict


def _misses_per_step(row: Row | None) -> float | None:
    """The CPU allocator's cache misses per step over the case's run (recording steps included)."""
    steps, misses = (None, None) if row is None else (row.stat("steps"), row.stat("cpu_allocator.misses"))
    return misses / steps if steps and misses is not None else None


def breakdown(rows: list[Row]) -> list[str]:
    """Where ooc 1/4's extra time goes, from the rows themselves."""
    by = {r.label: r for r in rows if r.results}
    inc, full, q = by.get("in-core"), by.get("ooc 1"), by.get("ooc 1/4")
    if not (inc and full and q):
        return []
    stall = q.stat("last_stall_s") or 0.0
    moved = (q.stat("plan.bytes_in") or 0) + (q.stat("plan.bytes_out") or 0)
    out = ["Where ooc 1/4's extra time goes (medians; the parts are differences of medians):", "",
           f"- engine overhead with nothing moved (ooc 1 - in-core): {full.step_s - inc.step_s:+.3f} s "
           f"({full.step_s / inc.step_s - 1:+.0%}): the plan moves nothing, so after one step "
           f"through the dispatch mode ({full.stat('plan.functions') or '?'} ops per step) its "
           "steps run plain (no op intercepted, saved tensors through pack/unpack hooks; "
           "ooc/runtime/plain_step.py) with ooc's allocator, whose cache is bounded by the live "
           "peak there (the median of the steady steps mixes both kinds)",
           f"- waiting for transfers (stall, last step): {stall:.3f} s",
           f"- the rest (ooc 1/4 - ooc 1 - stall): {q.step_s - full.step_s - stall:+.3f} s: ops slowed by "
           "fresh pages the kernel zeroes inside them (the allocator's misses, next but one), by "
           f"the I/O threads sharing {os.cpu_count()} cores, and by the host's work for the "
           "virtual disk (steal time)",
           f"- bytes moved: {moved / MiB:,.0f} MiB per step, {moved / q.step_s / 1e9:.2f} GB/s over the step"]
    at_1, at_q, swap = (_misses_per_step(r) for r in (full, q, by.get("ooc 1/4 swap-only")))
    if at_1 is not None and at_q is not None:
        swap_only = f", swap-only {swap:.0f}" if swap is not None else ""
        out.append(f"- fresh memory: large allocations ooc's CPU allocator could not serve from its cache, "
                   f"per step over the run: ooc 1 {at_1:.0f}, ooc 1/4 {at_q:.0f}{swap_only}; "
                   "each maps pages the kernel zeroes inside the op that first writes them (see below)")
    resident = q.stat("plan.peak_resident_bytes") or 0
    out.append(f"- memory: ooc 1/4's rise of {_mib(q.rise)} MiB = at most {_mib(resident)} MiB of managed "
               f"tensors (the plan's resident peak, within the {_mib(q.case.budget)} MiB budget) + "
               f"{_mib(q.rise - resident)} MiB that PyTorch allocates outside the budget (gradients "
               f"flowing backward, workspaces, weights' grads and momentum, saved tensors < "
               f"{format_size(q.case.chunk // 2)}); in core the same outside part is "
               f"~{_mib(inc.rise - (full.stat('plan.peak_resident_bytes') or 0))} MiB; ooc's pool "
               f"mapped at most {_mib(q.stat('pool_peak_mapped_bytes') or 0)} MiB")
    one = by.get("ooc 1/4, 1 I/O thread")
    if one:
        out.append(f"- with 1 I/O thread instead of 2 (first round only, one sample each: read it with "
                   f"the noise in mind): {one.step_s:.3f} s vs "
                   f"{q.results[0].median_step_s:.3f} s in the same round, stall "
                   f"{one.stat('last_stall_s') or 0:.3f} s")
    return out + [""]


def plot(results: list[tuple[Model, list[Row]]], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results):
        def pts(prefix: str, exclude: str = "\0") -> list[Row]:
            return [r for r in rows if r.label.startswith(prefix) and exclude not in r.label
                    and "thread" not in r.label and r.results]
        for label, sel, style in (("in-core", pts("in-core"), "ks"),
                                  ("ooc (window)", pts("ooc", "verify"), "o-"),
                                  ("checkpoint", pts("checkpoint"), "^--"),
                                  ("ooc 1/4 + verify", pts("ooc 1/4 + verify"), "D")):
            if not sel:
                continue
            xs, ys = [r.rise / MiB for r in sel], [r.ratio for r in sel]
            ax.plot(xs, ys, style, label=label)
            for r, x, y in zip(sel, xs, ys):
                tag = r.label.replace("ooc ", "").replace("checkpoint ", "").replace(" + verify", "")
                if label != "in-core":
                    ax.annotate(tag.strip("()"), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(f"{model.label}: {model.describe()}", fontsize=9)
        ax.set_xlabel("peak memory rise (MiB, VmHWM above the built model)")
        ax.set_ylabel("step time / in-core")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Step time vs peak memory (lower-left is better)")
    common.save_plot(fig, path)


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--rounds", type=int, help="rounds of interleaved cases (default 3; quick 1)")
    ap.add_argument("--steps", type=int, help="steps per case (default 8: 4 warm-up + 4 timed; quick 3)")
    ap.add_argument("--models", help="comma-separated labels of the models to run (default: all; "
                    f"{', '.join(m.label for m in FULL)})")
    args = ap.parse_args()
    rounds = max(1, args.rounds or (1 if args.quick else 3))
    steps = max(3, args.steps or (3 if args.quick else 8))
    models = QUICK if args.quick else FULL
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {m.label for m in models}
        if unknown:
            ap.error(f"--models: no model labelled {', '.join(sorted(unknown))}")
        models = tuple(m for m in models if m.label in wanted)
    log = functools.partial(print, flush=True)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        plans = []
        for model in models:
            rows, peak = build_rows(model, steps, Path(tmp), args.quick)
            log(f"{model.label}: {model.describe()}, managed peak {format_size(peak)}")
            plans.append((model, rows, peak))
        run_rounds([(m, rows) for m, rows, _ in plans], rounds, log)
        for _, rows, _ in plans:
            check_identical(rows)
    load1 = os.getloadavg()[0]
    elapsed = time.perf_counter() - t_start

    lines = common.header("Out-of-core training on this CPU: step time and peak memory", quick=args.quick, notes=[
        f"command: `python benchmarks/bench_cpu.py{' --quick' if args.quick else ''}`; {rounds} round(s), "
        f"{steps} steps per case (median of steps {steady_steps(steps).start + 1}-{steps}), methods interleaved; "
        f"ratios are medians over rounds of case / in-core in the same round",
        "memory: VmHWM of a fresh process per case, as a rise above the footprint after model, "
        "optimizer and data are built (reset through /proc/self/clear_refs), and the whole "
        "process's peak; MiB moved/step = swap-in + swap-out bytes of the plan, and counted by the "
        "engine (median over the same steps, last round): a settled plan may run anchored, at "
        "autograd's saved-tensor hooks (its chains rerun from templates, or swapped where none "
        "reruns them), where the engine times that form faster; recomputed likewise",
        "ooc: activations managed, policy window, 2 I/O threads, swap file in $TMPDIR; the budget "
        "bounds the managed tensors only (PyTorch's other allocations are not in it)",
        f"load average (1 min) before/after: {load0:.2f} / {load1:.2f} on {os.cpu_count()} cores; "
        f"wall time {elapsed / 60:.1f} min",
    ])
    verdict = None
    for model, rows, peak in plans:
        lines += table(model, rows, peak) + [""] + monotonic(rows)
        if model.target:
            tlines, verdict = targets(model, rows)
            lines += tlines
    lines += ANALYSIS
    path = common.result_path("cpu", args.quick, out=args.out)
    common.write_report(path, lines)
    plot([(m, rows) for m, rows, _ in plans], common.result_path("cpu", args.quick, ".png", out=args.out))
    print("\n".join(lines[lines.index(next(ln for ln in lines if ln.startswith("### "))):]))
    if verdict is not None:
        print("issue 4 targets:", {k: ("PASS" if v else "FAIL" if v is not None else "n/a") for k, v in verdict.items()})


ANALYSIS = [
    "## Reading the figures",
    "",
    "- The budget bounds only the tensors ooc manages (saved activations of at least half a "
    "chunk). Everything else PyTorch allocates during the step stays outside it, so the peak "
    "rise falls by less than the budget does: halving the budget again saves less each time.",
    "- Every method runs as its users run it: in-core and checkpointing with PyTorch's and "
    "glibc's defaults (glibc keeps freed blocks in its heap: fast, but the heap does not "
    "shrink, so in-core's rise is well above its live bytes), ooc with its recycling CPU "
    "allocator (ooc/host/cpu_allocator.py). The first version of this benchmark fixed glibc's "
    "mmap threshold at 1 MiB for every method; that made in-core training ~30% slower (fresh "
    "pages are zeroed by the kernel at about 1 GB/s on this VM) and ooc's ratios look better "
    "than they were (small CNN at 1/4: 1.29x then, 1.36x here against PyTorch's defaults).",
    "- Down to 1/4, ooc's extra time is not waiting: the stall column is small (at 1/8 "
    "waiting starts to show). Profiled on ResNet-50 (perf, and per-thread CPU and run-queue "
    "time from /proc): at budget 1, where nothing moves, the cost is memory faulted in and zeroed "
    "by the kernel again: with the allocator's cache uncapped and kept between steps, budget 1 "
    "ran at in-core speed (0.99x at e3fdb54); capped at half the budget, at most 256 MiB, it "
    "was +10% again (that cap is gone since 2026-11-25: "
    "ooc/engine/lifetime.py's recycle_bytes says why). What 1/4 adds "
    "with ~1.2 GB moved per step, profiled on the AMD EPYC host in 2026-11: the I/O threads' CPU (~0.2 s per step: O_DIRECT page pinning "
    "and the Python around each transfer), the main thread off its core ~0.3 s per step "
    "(preempted by the woken I/O threads, or waiting for the GIL they hold), and OpenMP's "
    "second thread spinning at barriers meanwhile. On the Intel Xeon host (2026-11-25) the I/O "
    "threads' own CPU was 0.09 ns per moved byte (time.thread_time around each transfer), and "
    "the largest part of ResNet-50's 1/4 swap-only step that perf could name was the kernel "
    "zeroing fresh huge pages inside ops (clear_page_erms, ~9-12% of both cores' samples, "
    "against none that perf listed with nothing moved): ~70 allocator misses and ~44,000 page "
    "faults per step against 0 and ~5,000 with nothing moved. Memory passes between the "
    "device pool (swap-ins, in the backward) and the allocator's cache under one live-peak bound, "
    "and each pass costs fresh, zeroed pages. A 1 GiB floor on the cache took the misses to 0 "
    "and the step to 1.07x the per-op path with nothing moved, but the rise grew from ~505 to "
    "~658 MiB. Two designs that keep the pages were tried and dropped (closing note of issue "
    "15, 2026-11-25): memfd-backed blocks remapped on a miss (no zeroing, but populating 4 KiB "
    "shared pages cost more: +0.27 s of main-thread CPU per step) and mremap of the blocks the "
    "bound drops into the missing block (~590 MiB moved per step, zeroing down from 11.6% to "
    "8.7% of samples, no measurable step-time gain: most fresh pages are mapped when the pool "
    "shrinks in the backward, not at a miss that drops cached blocks). What removed it: the "
    "pool's chunks became anonymous pages lent by the allocator's cache and given back to it "
    "(vmm/anon_host.py, mremap; edd35a4): at 1/4 swap-only ~11 misses and ~5,500 faults per "
    "step, 1.42-1.46 -> 1.20-1.26 s, rise 505 -> 497 MiB. Priced on the edge-board preset's "
    "1 GB/s flash, the planner then recomputed 250-310 MiB a step that cost more than swapping "
    "it on this VM's file (1.6 GB/s per I/O thread); plans are now priced on what the swap "
    "file measured in the recording step (ooc/engine/host_pricing.py), and priced once more "
    "after the plan's first run on that run's op times (the recording step's convolutions ran "
    "1.8x slower on cold memory, so every replay chain looked dear: c07dfb0). Which part is the bytes: with the same plan "
    "and a tier that moves nothing, 1/4 ran at 1.10-1.13x in-core, and at 1.01-1.06x once the "
    "pool kept its pages between steps (they were trimmed at each step's end and faulted in again by the "
    "next backward's swap-ins; now they stay where the allocator's bound lets them, b0d0181); "
    "the same transfers as bare os.pwritev/preadv calls on two Python threads cost as much as "
    "the tier's (so its Python is not the cost), and the VM's steal time rose from 0.2% to "
    "6.5% of both cores while they ran: the host's work for the virtual disk comes out of this "
    "machine's CPUs. On two cores all of it comes out of the compute threads. A GPU moves "
    "bytes with DMA engines beside the compute; here every moved byte costs CPU time (about 0.07-0.1 ns "
    "per byte since the pool shares its pages), which is what the planner weighs against "
    "recomputing it.",
    "- torch.utils.checkpoint pays a recomputed forward per wrapped block, whatever the "
    "memory; ooc pays per byte moved. At budgets that move little, ooc is the cheaper way to "
    "the same memory; at deep cuts the bytes add up.",
    "- verify=True adds a CRC32 per chunk on the I/O threads (see storage.md for its CPU cost "
    "per GB): more CPU taken from the compute threads.",
    "- Bitwise: ooc copies bytes, so every ooc row ends with in-core's exact parameters. "
    "Checkpointing's recomputed forward runs BatchNorm in training mode again: the parameters "
    "match, the running statistics are updated twice and do not.",
    "- Timings on this machine are noisy (other jobs share its two cores): read the ratios, "
    "measured against in-core in the same round, rather than absolute seconds.",
]


if __name__ == "__main__":
    main()
