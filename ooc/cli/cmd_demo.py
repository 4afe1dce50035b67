"""``ooc demo``: train a zoo model in core, then under a quarter of its memory, side by side.

``--json`` prints one JSON object instead of the table (progress goes to stderr): the run's
settings, ``managed_peak_bytes`` (None with --budget), per run (``incore``, ``ooc``) the
median step time, the steps it is the median of and the peaks, the plan's bytes per step,
``step_time_ratio`` and ``bitwise_identical``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from ooc.measure import Case, CaseResult, managed_peak, run_case, same_parameters, steady_steps
from vmm.units import format_size


def register(sub: Any) -> None:
    from ooc.cli.args import (MANAGE_KINDS, SIZE_HELP, manage_kinds, positive_float, positive_int, size,
                              swap_directory, zoo_model)

    p = sub.add_parser("demo", help="train in core and out of core, compare time, memory and bits",
                       description="Train a zoo model for a few steps in core, then the same steps "
                                   "under a budget (default: 1/4 of the in-core peak of the managed "
                                   "tensors), each in a fresh process, and print them side by side.",
                       epilog=SIZE_HELP)
    p.add_argument("--model", default="small_cnn", type=zoo_model, help="zoo model (default: small_cnn)")
    p.add_argument("--batch", type=positive_int, default=16, help="batch size (default: 16)")
    p.add_argument("--steps", type=positive_int, default=12,
                   help="training steps per run (default: 12; step time is the median after the "
                        "first four, or fewer warm-up steps when there are fewer than 8 steps; give 6 "
                        "or more. On a CPU, steps 5-8 are also where a settled plan that swaps is "
                        "tried anchored and per-op, two steps each)")
    p.add_argument("--budget", type=size, metavar="SIZE",
                   help="budget for managed tensors, e.g. 96MiB (default: 1/4 of their in-core peak)")
    p.add_argument("--fraction", type=positive_float,
                   help="instead of --budget: budget = peak / FRACTION (default: 4)")
    p.add_argument("--manage", default=("activations",), type=manage_kinds, metavar="KINDS",
                   help=f"comma-separated kinds to manage, of {','.join(MANAGE_KINDS)} (default: activations)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--storage", type=swap_directory, metavar="DIR",
                   help="directory for the private swap directory (default: $TMPDIR)")
    p.add_argument("--chunk", default="2MiB", type=size, metavar="SIZE", help="pool chunk size (default: 2MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ooc.errors import OOCError

    if args.budget is not None and args.fraction is not None:
        raise OOCError("--budget and --fraction both set the budget: give one of them")
    manage, chunk, fraction = args.manage, args.chunk, args.fraction or 4.0
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the object only
    print(f"ooc demo: {args.model}, batch {args.batch}, {args.optimizer}, {args.steps} steps, "
          f"managing {', '.join(manage)}", file=out)
    peak = None
    if args.budget is not None:
        budget = args.budget
    else:
        print("tracing one step on the meta device to find the in-core peak of the managed tensors ...",
              file=out)
        peak = managed_peak(args.model, args.batch, manage=manage, optimizer=args.optimizer, chunk=chunk)
        budget = max(chunk, int(peak / fraction))
        print(f"in-core peak of managed tensors: {format_size(peak)} -> budget {format_size(budget)} "
              f"(1/{fraction:g})", file=out)
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="ooc-demo-") as tmp:
        os.chmod(tmp, 0o700)
        results: dict[str, CaseResult] = {}
        for method in ("incore", "ooc"):
            case = Case(model=args.model, batch=args.batch, method=method, steps=args.steps,
                        budget=budget if method == "ooc" else None, manage=manage,
                        optimizer=args.optimizer, storage=args.storage, chunk=chunk,
                        params_out=os.path.join(tmp, f"{method}.pt"))
            label = "in-core" if method == "incore" else f"ooc {format_size(budget)}"
            with tqdm(total=args.steps, desc=f"{label:>14}", unit="step", leave=True) as bar:
                results[method] = run_case(case, on_step=lambda _: bar.update(1))
        same = same_parameters(os.path.join(tmp, "incore.pt"), os.path.join(tmp, "ooc.pt"))
    if args.json:
        print(json.dumps(_figures(args, results["incore"], results["ooc"], budget, peak, same)))
    else:
        print(_table(results["incore"], results["ooc"], budget, same))
    return 0 if same else 1


def _figures(args: argparse.Namespace, inc: CaseResult, ooc_: CaseResult, budget: int,
             peak: int | None, same: bool) -> dict[str, Any]:
    """What the table shows, as plain data with stable keys (``--json``)."""
    st = ooc_.stats or {}

    def run(r: CaseResult) -> dict[str, Any]:
        steps = steady_steps(len(r.step_s))
        return {"median_step_s": r.median_step_s, "median_of_steps": [s + 1 for s in steps],
                "step_s": list(r.step_s), "peak_rise_bytes": r.peak_rise_bytes,
                "peak_total_bytes": r.peak_total_bytes}

    return {
        "model": args.model, "batch": args.batch, "steps": args.steps, "optimizer": args.optimizer,
        "manage": list(args.manage), "chunk": args.chunk, "budget": budget,
        "managed_peak_bytes": peak, "incore": run(inc),
        "ooc": {**run(ooc_), "bytes_in_per_step": st.get("plan.bytes_in", 0),
                "bytes_out_per_step": st.get("plan.bytes_out", 0),
                "bytes_recomputed_per_step": st.get("plan.bytes_recomputed", 0),
                "anchored_steps": st.get("steps.anchored", 0), "plain_steps": st.get("steps.plain", 0),
                "planned_in_core_peak_bytes": st.get("plan.in_core_peak_bytes"),
                "last_stall_s": st.get("last_stall_s")},
        "step_time_ratio": ooc_.median_step_s / inc.median_step_s,
        "bitwise_identical": same,
    }


def _table(inc: CaseResult, ooc_: CaseResult, budget: int, same: bool) -> str:
    st = ooc_.stats or {}
    ratio = ooc_.median_step_s / inc.median_step_s
    saved = 1 - ooc_.peak_rise_bytes / inc.peak_rise_bytes if inc.peak_rise_bytes else 0.0
    rows = [
        ("", "in-core", f"ooc (budget {format_size(budget)})", "ooc vs in-core"),
        ("step time (median)", f"{inc.median_step_s:.3f} s", f"{ooc_.median_step_s:.3f} s", f"{ratio:.2f}x"),
        ("peak memory of training", format_size(inc.peak_rise_bytes), format_size(ooc_.peak_rise_bytes),
         f"{saved:+.0%}".replace("+", "-", 1) if saved > 0 else f"+{-saved:.0%}"),
        ("process peak (total)", format_size(inc.peak_total_bytes), format_size(ooc_.peak_total_bytes), ""),
        ("swapped per step (plan)", "0", f"{format_size(st.get('plan.bytes_out', 0))} out, "
                                         f"{format_size(st.get('plan.bytes_in', 0))} in", ""),
        ("recomputed per step (plan)", "0", format_size(st.get("plan.bytes_recomputed", 0)), ""),
        ("steps without op interception", "-", _hooks_only(st, len(ooc_.step_s)), ""),
        ("stall time (last step)", "-", f"{st.get('last_stall_s') or 0:.3f} s", ""),
        ("parameters after training", "", "bitwise identical" if same else "DIFFERENT", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    notes = ["peak memory of training = rise of the process's VmHWM above its footprint after "
             "model, optimizer and data were built (fresh process per run); " + _step_note(len(ooc_.step_s))]
    if st.get("steps.anchored"):
        notes.append("anchored steps run the settled plan's swaps at autograd's saved-tensor hooks, "
                     "with no op intercepted; the engine runs them and the per-op form in turn (two "
                     "steps each) and keeps the faster, so those turns fall inside the step time")
    if st.get("plan.functions") and not st.get("plan.bytes_out"):
        notes.append(f"the budget {format_size(budget)} holds every managed tensor (their in-core "
                     f"peak is {format_size(st.get('plan.in_core_peak_bytes', 0))}): nothing was swapped; "
                     f"give a smaller --budget to see swapping")
    return "\n" + "\n".join(lines) + "\n\n" + "\n".join(notes)


def _hooks_only(st: dict[str, Any], steps: int) -> str:
    """How many ooc steps ran at autograd's saved-tensor hooks alone: anchored steps (a
    settled swapping plan moved onto the hooks) and plain ones (a plan that moves nothing).
    The rest intercepted every op: recording, planning, re-pricing and the anchored trial's
    per-op turns, or a plan that recomputes, which only the per-op path can run."""
    anchored, plain = int(st.get("steps.anchored", 0)), int(st.get("steps.plain", 0))
    parts = [f"{anchored} anchored"] if anchored else []
    parts += [f"{plain} plain"] if plain else []
    return f"{anchored + plain} of {steps}" + (f" ({', '.join(parts)})" if parts else "")


def _step_note(n: int) -> str:
    """What the step-time row is the median of, from the rule that computed it."""
    steps = steady_steps(n)
    if steps.start == 0:
        return ("step time is the only step's, which for ooc includes recording and planning "
                "(give --steps 4 or more for a steady figure).")
    which = (f"that of step {steps.start + 1}" if len(steps) == 1
             else f"the median of steps {steps.start + 1}-{steps.stop}")
    skipped = {1: "the first step (ooc records and plans there; give --steps 6 or more to also leave "
                  "out its re-plan in step 2 and its re-pricing in step 3)",
               2: "the first two steps (ooc records and plans there; give --steps 6 or more to also "
                  "leave out step 3, after which a CPU plan is priced again on its op times)",
               3: "the first three steps (ooc records and plans there, and prices the plan again "
                  "after its first run; give --steps 8 or more to also leave out step 4, after "
                  "which it is priced on its two runs' fastest op times)",
               4: "the first four steps (ooc records and plans there, and prices the plan again "
                  "after each of its first two runs)"}[steps.start]
    return f"step time = {which} of {n}, leaving out {skipped}."
