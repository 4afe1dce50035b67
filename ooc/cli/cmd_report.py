"""``ooc report``: a PNG of one step's memory and swap volume, from a plan or a trace.

Prints what it drew in one line (policy, budget, in-core and planned peak, bytes moved), or
with ``--json`` one JSON object: the keys of ``Schedule.summary()`` plus ``output``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_OUTPUT = "ooc-report.png"


def register(sub: Any) -> None:
    from scheduler.planner import POLICIES

    from ooc.cli.args import SIZE_HELP, choice, output_file, size

    p = sub.add_parser("report", help="draw memory over one step and the swap volume (PNG)",
                       description="Draw a plan (ooc plan -o plan.json) or a trace planned under "
                                   "--budget: memory while each op runs, in core and under the plan, "
                                   "the budget line, and the bytes swapped in and out.", epilog=SIZE_HELP)
    p.add_argument("input", metavar="INPUT", help="plan JSON (ooc plan -o) or trace JSON (ooc trace -o)")
    p.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="PNG", type=output_file(".png"),
                   help=f"PNG to write (default: {DEFAULT_OUTPUT})")
    p.add_argument("--budget", metavar="SIZE", type=size, help="budget for planning a trace, e.g. 4GiB")
    p.add_argument("--policy", default="window", metavar="NAME", type=choice(POLICIES, "policy"),
                   help=f"planner policy for a trace: {', '.join(POLICIES)} (default: window)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from scheduler.planner import plan
    from scheduler.schedule import Schedule
    from vmm.errors import OOCError
    from vmm.units import format_size as fs

    from ooc.cli.cmd_plan import load
    from ooc.report import plot_schedule

    obj = load(args.input)
    if isinstance(obj, Schedule):
        if args.budget is not None:
            raise OOCError(f"{args.input} is already a plan (budget {fs(obj.budget)}); --budget "
                           f"applies to a trace: re-plan with `ooc plan`")
        schedule = obj
    else:
        if args.budget is None:
            raise OOCError(f"{args.input} is a trace: give --budget to plan it")
        schedule = plan(obj, budget=args.budget, policy=args.policy)
    plot_schedule(schedule, args.output)
    info = {**schedule.summary(), "output": args.output}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"wrote {args.output}: policy {info['policy']}, budget {fs(info['budget'])}, "
              f"in-core peak {fs(info['in_core_peak_bytes'])}, planned peak "
              f"{fs(info['peak_resident_bytes'])}, {fs(info['bytes_in'])} in and "
              f"{fs(info['bytes_out'])} out per step")
    return 0
