"""``ooc demo``: train a zoo model in core, then under a quarter of its memory, side by side."""

from __future__ import annotations

import argparse
import os
import tempfile

from tqdm import tqdm

from ooc.measure import Case, CaseResult, managed_peak, run_case, same_parameters
from vmm.units import format_size, parse_size

KINDS = ("activations", "params", "grads", "optimizer_state")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train in core and out of core, compare time, memory and bits",
                       description="Train a zoo model for a few steps in core, then the same steps "
                                   "under a budget (default: 1/4 of the in-core peak of the managed "
                                   "tensors), each in a fresh process, and print them side by side.")
    p.add_argument("--model", default="small_cnn", help="zoo model (default: small_cnn)")
    p.add_argument("--batch", type=int, default=16, help="batch size (default: 16)")
    p.add_argument("--steps", type=int, default=5, help="training steps per run (default: 5)")
    p.add_argument("--budget", help="budget for managed tensors, e.g. 96MiB (default: 1/4 of their in-core peak)")
    p.add_argument("--fraction", type=float, default=4.0, help="budget = peak / FRACTION (default: 4)")
    p.add_argument("--manage", default="activations",
                   help=f"comma-separated kinds to manage, of {','.join(KINDS)} (default: activations)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--storage", help="directory for the private swap directory (default: $TMPDIR)")
    p.add_argument("--chunk", default="2MiB", help="pool chunk size (default: 2MiB)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    manage = tuple(m.strip() for m in args.manage.split(",") if m.strip())
    bad = [m for m in manage if m not in KINDS]
    if bad:
        from ooc.errors import OOCError

        raise OOCError(f"--manage: unknown kind(s) {bad}; choose from {','.join(KINDS)}")
    if args.steps < 1 or args.batch < 1:
        from ooc.errors import OOCError

        raise OOCError("--steps and --batch must be at least 1")
    chunk = parse_size(args.chunk, what="--chunk")
    print(f"ooc demo: {args.model}, batch {args.batch}, {args.optimizer}, {args.steps} steps, "
          f"managing {', '.join(manage)}")
    if args.budget:
        budget = parse_size(args.budget, what="--budget")
        peak = None
    else:
        print("tracing one step on the meta device to find the in-core peak of the managed tensors ...")
        peak = managed_peak(args.model, args.batch, manage=manage, optimizer=args.optimizer, chunk=chunk)
        budget = max(chunk, int(peak / args.fraction))
        print(f"in-core peak of managed tensors: {format_size(peak)} -> budget {format_size(budget)} "
              f"(1/{args.fraction:g})")
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
    print(_table(results["incore"], results["ooc"], budget, same))
    return 0 if same else 1


def _table(inc: CaseResult, ooc_: CaseResult, budget: int, same: bool) -> str:
    st = ooc_.stats or {}
    plan = st.get("plan") or {}
    ratio = ooc_.median_step_s / inc.median_step_s
    saved = 1 - ooc_.peak_rise_bytes / inc.peak_rise_bytes if inc.peak_rise_bytes else 0.0
    rows = [
        ("", "in-core", f"ooc (budget {format_size(budget)})", ""),
        ("step time (median)", f"{inc.median_step_s:.3f} s", f"{ooc_.median_step_s:.3f} s", f"{ratio:.2f}x"),
        ("peak memory of training", format_size(inc.peak_rise_bytes), format_size(ooc_.peak_rise_bytes),
         f"{saved:+.0%}".replace("+", "-", 1) if saved > 0 else f"+{-saved:.0%}"),
        ("process peak (total)", format_size(inc.peak_total_bytes), format_size(ooc_.peak_total_bytes), ""),
        ("swapped per step (plan)", "0", f"{format_size(plan.get('bytes_out', 0))} out, "
                                         f"{format_size(plan.get('bytes_in', 0))} in", ""),
        ("stall time (last step)", "-", f"{st.get('last_stall_s') or 0:.3f} s", ""),
        ("parameters after training", "", "bitwise identical" if same else "DIFFERENT", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    note = ("peak memory of training = rise of the process's VmHWM above its footprint after model, "
            "optimizer and data were built (fresh process per run); step time excludes the first two "
            "steps (ooc records and plans there).")
    return "\n" + "\n".join(lines) + "\n\n" + note
