"""``ooc fit TRACE --device-memory SIZE``: the budget at which a step fits a GPU, fastest first.

The budget bounds ooc's bytes, not the device's: PyTorch holds the weights, the backward's
gradients of activations and its temporaries beside them, and the device's peak is not
monotone in the budget (``scheduler.device_fit``). So "which budget for my 16 GiB GPU?" has no
closed form: this plans the trace at ``--budgets`` budgets from the smallest any plan takes to
the one that moves nothing, simulates each (``scheduler.simulate``, as ``ooc simulate``) and
models its device peak (``scheduler.arenas.device_peaks``), and names the fastest plan whose
peak plus ``--margin`` fits. Everything printed is a prediction, not a measurement; the margin
is for what the model leaves out (the allocator's rounding, cuDNN's workspaces: the H200's
measured peaks were 0.07-1.04 GiB over it). ``--plot FILE`` draws step time and device peak
against the budget; ``--json`` prints one object. No budget that fits: exit 2, naming the
lowest modelled peak. With one arena it also tries plans bounded by the device itself
(``scheduler.beside``: the plan holds at each op at most the device less what PyTorch holds
there), which ``Options(budget_covers="step")`` runs; ``--flat-only`` leaves them out.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_MARGIN = 1 << 30
DEFAULT_BUDGETS = 32


def register(subparsers: Any) -> None:
    from scheduler.device_fit import ARENAS
    from scheduler.hardware import PRESETS
    from scheduler.recompute import RECOMPUTE_MODES

    from ooc.cli.args import (MANAGE_HELP, SIZE_HELP, choice, host_us, manage_kinds, output_file, positive_int, size,
                              size_or_zero)
    from ooc.cli.cmd_plan import RECOMPUTE_HELP

    p = subparsers.add_parser(
        "fit", help="the fastest budget whose step fits a GPU's memory (predicted)",
        description="Plan a trace at budgets from the smallest any plan takes to the in-core peak, "
                    "simulate each and model the whole step's device peak, and name the fastest "
                    "plan that fits the device: a prediction, not a measurement.", epilog=SIZE_HELP)
    p.add_argument("input", metavar="TRACE", help="trace JSON (ooc trace -o, or a GPU profile)")
    p.add_argument("--device-memory", metavar="SIZE", type=size, required=True,
                   help="the device's memory the step may take, e.g. 16GiB")
    p.add_argument("--margin", metavar="SIZE", type=size_or_zero, default=DEFAULT_MARGIN,
                   help="kept free for what the model leaves out (default 1GiB)")
    p.add_argument("--arena", default="pytorch", metavar="NAME", type=choice(ARENAS, "arena"),
                   help="where swap-ins live, as Options(arena=...): pytorch (one arena, the default) "
                        "or pool (ooc's pool beside PyTorch's allocator)")
    p.add_argument("--budgets", metavar="N", type=positive_int, default=DEFAULT_BUDGETS,
                   help=f"budgets to plan, evenly spread (default {DEFAULT_BUDGETS})")
    p.add_argument("--manage", metavar="KINDS", type=manage_kinds, default=("activations",),
                   help=f"{MANAGE_HELP} (default: activations)")
    p.add_argument("--recompute", metavar="MODE", type=choice(RECOMPUTE_MODES, "recompute mode"),
                   help=RECOMPUTE_HELP)
    p.add_argument("--hardware", default=None, metavar="NAME", type=choice(sorted(PRESETS), "hardware"),
                   help="hardware preset (default: as ooc simulate)")
    p.add_argument("--host-us", metavar="OP[,QUIET]", type=host_us,
                   help="a GPU's host time per op, as ooc simulate --host-us")
    p.add_argument("--plot", metavar="PNG", type=output_file(".png"),
                   help="draw step time and device peak against the budget")
    p.add_argument("--flat-only", action="store_true",
                   help="only budgets of ooc's bytes: no plan bounded by the device (one arena)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from scheduler.device_fit import BOUNDED_TRIES, fit_device
    from scheduler.schedule import Schedule
    from vmm.errors import OOCError
    from vmm.units import format_size as fs

    from ooc.cli.cmd_plan import Progress, load, managed
    from ooc.cli.cmd_simulate import hardware_for

    if args.margin >= args.device_memory:
        raise OOCError(f"--margin {fs(args.margin)} leaves nothing of --device-memory {fs(args.device_memory)}")
    full = load(args.input)
    if isinstance(full, Schedule):
        raise OOCError(f"{args.input} is a plan, planned at one budget; fit plans a trace at many: "
                       f"give the trace it was planned from")
    hw = hardware_for(full, args.hardware, args.host_us)
    planned = managed(full, args.manage)
    options = {} if args.recompute is None else {"recompute": args.recompute}
    bounded = args.arena == "pytorch" and not args.flat_only
    with Progress(args.budgets + 1 + BOUNDED_TRIES * bounded, disable=args.no_progress) as bar:
        bar.stage("planning")
        fit = fit_device(full, planned, hw, args.device_memory, arena=args.arena, margin=args.margin,
                         n=args.budgets, plan_options=options, bounded=bounded,
                         progress=lambda done, total: bar.stage(f"planned {done}/{total} budgets"))
    if args.plot:
        from ooc.fit_plot import plot_fit

        plot_fit(fit, args.device_memory, args.plot, title=f"{args.input} on {hw.name}, {args.arena} arena")
    if args.json:
        print(json.dumps({"hardware": hw.name, "arena": args.arena, "device_bytes": args.device_memory,
                          "limit_bytes": fit.limit, "candidates": [asdict(c) for c in fit.candidates],
                          "best": None if fit.best is None else asdict(fit.best)}))
    else:
        print(_table(fit, hw.name, args))
    if fit.best is None:
        low = fit.smallest_peak
        where = (f"the lowest modelled device peak is {fs(low.device_peak)}, at a budget of {fs(low.budget)}"
                 if low is not None else "no budget between the largest working set and the in-core peak plans")
        raise OOCError(f"no budget fits {fs(args.device_memory)} less a {fs(args.margin)} margin: {where}; "
                       f"a smaller batch, or manage more kinds (--manage)")
    return 0


def _table(fit: Any, hw_name: str, args: argparse.Namespace) -> str:
    from vmm.units import format_size as fs

    lines = [f"{args.input} on {hw_name}, {args.arena} arena: predicted, not measured",
             f"{'budget':>10} {'step':>11} {'device peak':>12} {'moved':>10} {'recomputed':>11}  fits"]
    for c in fit.candidates:
        mark = "yes" if c.device_peak <= fit.limit else ""
        if c is fit.best:
            mark = "yes  <- fastest that fits"
        lines.append(f"{fs(c.budget):>10} {c.step_s * 1e3:>8.1f} ms {fs(c.device_peak):>12} "
                     f"{fs(c.bytes_moved):>10} {fs(c.bytes_recomputed):>11}  {mark}"
                     + ("  (bounded by the device)" if c.bounded else ""))
    if fit.best is not None:
        b = fit.best
        how = (f"OutOfCore(..., budget={b.budget}, options=Options(budget_covers='step', arena='pytorch')): "
               f"a plan bounded by the device, for every tensor of the step" if b.bounded
               else f"OutOfCore(..., budget={b.budget})")
        lines.append(f"fastest within {fs(args.device_memory)} less {fs(args.margin)}: budget {fs(b.budget)} "
                     f"({how}), step {b.step_s * 1e3:.1f} ms, device peak {fs(b.device_peak)}")
    return "\n".join(lines)
