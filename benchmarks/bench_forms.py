"""A plan that recomputes, run per op and at the hooks from templates, side by side on this CPU.

    python benchmarks/bench_forms.py [--quick] [--rounds N] [--steps N] [--out PATH]

GPT (6x256, batch 8: the model of docs/guide/steps.md's anchored figures) at 1/2 and 1/4 of
its managed peak, ``recompute="auto"``, each case in a fresh process (``ooc.measure.run_case``:
peak memory is VmHWM's rise above the footprint after model, optimizer and data are built),
methods interleaved in each round:

- ``in-core``; ``checkpoint (every block)``;
- ``ooc, per op``: ``Options(hook_steps=False)``, every planned step through the dispatch mode
  (the plan recomputes where the planner prices it cheaper than the swap file);
- ``ooc``: the engine's defaults. Once the plan's prices settle, a per-op step captures its
  chains' templates and the engine tries the anchored form (chains rerun from templates,
  ``ooc/runtime/templates.py``; dropout's chains swapped) against the per-op plan, two steps
  each in turn, and keeps the faster.

Step time: the median of the last ``TIMED`` steps (after the recording, pricing and trial
steps), as a ratio to the in-core case of the same round, median over rounds. Per step, what
the engine counted in those steps: bytes moved and recomputed, and how many ran anchored.
Parameters after the run are compared bit for bit with in-core's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from ooc.measure import Case, CaseResult, managed_peak, run_case, same_parameters  # noqa: E402
from vmm.units import format_size  # noqa: E402

GPT = dict(depth=6, width=256, heads=4, seq_len=256, vocab=8192)
GPT_QUICK = dict(depth=2, width=64, heads=2, seq_len=128, vocab=512)
TIMED = 6   # the settled steps a step time is the median of (--quick: 3)
WARM = 8    # the steps before them: recording, re-recording, two priced runs, the form, its trial


def cases(batch: int, kwargs: dict, chunk: int, steps: int, tmp: Path, quick: bool) -> list[tuple[str, Case]]:
    peak = managed_peak("gpt2", batch, chunk=chunk, model_kwargs=kwargs)
    base = Case("gpt2", batch, "incore", steps=steps, model_kwargs=kwargs, chunk=chunk,
                params_out=str(tmp / "incore.pt"))
    out = [("in-core", base)]
    if not quick:
        out.append(("checkpoint (every block)", replace(base, method="checkpoint", params_out=str(tmp / "cp.pt"))))
    for label, frac in (("1/4", 4),) if quick else (("1/2", 2), ("1/4", 4)):
        ooc = replace(base, method="ooc", budget=peak // frac)
        out.append((f"ooc {label}, per op", replace(ooc, hook_steps=False, params_out=str(tmp / f"perop{frac}.pt"))))
        out.append((f"ooc {label}", replace(ooc, params_out=str(tmp / f"ooc{frac}.pt"))))
    return out


def settled(r: CaseResult, key: str | None = None, timed: int = TIMED) -> float:
    if key is None:
        return median(r.step_s[-timed:])
    return median(c[key] for c in r.counted[-timed:])


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--rounds", type=int, help="rounds of interleaved cases (default 3; quick 1)")
    ap.add_argument("--steps", type=int, help=f"steps per case (default {WARM + TIMED + 4}; quick {WARM + 3})")
    args = ap.parse_args()
    timed = 3 if args.quick else TIMED
    rounds = max(1, args.rounds or (1 if args.quick else 3))
    steps = max(WARM + timed, args.steps or (WARM + timed if args.quick else WARM + timed + 4))
    batch, kwargs, chunk = (4, GPT_QUICK, 256 << 10) if args.quick else (8, GPT, 2 << 20)
    results: dict[str, list[CaseResult]] = {}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-forms-") as tmp:
        plan = cases(batch, kwargs, chunk, steps, Path(tmp), args.quick)
        for k in range(rounds):
            for label, case in plan:
                r = run_case(case)
                results.setdefault(label, []).append(r)
                print(f"round {k + 1}: {label}: {settled(r, timed=timed):.3f} s", flush=True)
        same = {label: same_parameters(plan[0][1].params_out, case.params_out) for label, case in plan}
    load1 = os.getloadavg()[0]
    incore = results["in-core"]
    rows = []
    for label, rs in results.items():
        ratio = median(settled(r, timed=timed) / settled(i, timed=timed) for r, i in zip(rs, incore))
        last = rs[-1]
        moved = recomputed = anchored = "-"
        if last.counted:
            moved = format_size(int(settled(last, "bytes_in", timed) + settled(last, "bytes_out", timed)))
            recomputed = format_size(int(settled(last, "bytes_recomputed", timed)))
            anchored = f"{sum(c['steps.anchored'] for c in last.counted[-timed:])} of {timed}"
        rows.append([label, f"{median(settled(r, timed=timed) for r in rs):.3f}", f"{ratio:.2f}x",
                     format_size(median(r.peak_rise_bytes for r in rs)),
                     format_size(median(r.peak_total_bytes for r in rs)), moved, recomputed, anchored,
                     "yes" if same[label] else "NO"])
    lines = common.header("A plan that recomputes, per op and from templates at the hooks (CPU, measured)",
                          quick=args.quick, notes=[
        f"command: `python benchmarks/bench_forms.py{' --quick' if args.quick else ''}`; GPT "
        f"{kwargs['depth']}x{kwargs['width']} batch {batch}, {rounds} round(s) of {steps} steps, step time the "
        f"median of the last {timed} (settled: after recording, pricing and the trial between forms), "
        "ratios the median over rounds of case / in-core of the same round",
        "memory: VmHWM of a fresh process per case, rise above the footprint after model, optimizer "
        "and data are built, and the whole process's peak; moved / recomputed: counted by the engine "
        f"over the last {timed} steps (median per step), last round",
        f"load average (1 min) before/after: {load0:.2f} / {load1:.2f} on {os.cpu_count()} cores"])
    lines += common.md_table(["method", "step s", "vs in-core", "peak rise", "peak total", "moved / step",
                              "recomputed / step", "anchored steps", "bitwise"], rows)
    common.write_report(common.result_path("forms", args.quick, out=args.out), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
