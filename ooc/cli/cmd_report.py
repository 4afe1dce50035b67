"""``ooc report``: a PNG of one step's memory and swap volume, from a plan or a trace."""

from __future__ import annotations

import argparse

from scheduler.ir import VariableSequence
from scheduler.planner import plan
from scheduler.schedule import Schedule
from vmm.units import parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="draw memory over one step and the swap volume (PNG)",
                       description="Draw a plan (ooc plan -o plan.json) or a trace planned under "
                                   "--budget: memory while each op runs, in core and under the plan, "
                                   "the budget line, and the bytes swapped in and out.")
    p.add_argument("input", help="plan JSON (ooc.schedule) or trace JSON (ooc.sequence)")
    p.add_argument("-o", "--output", default="ooc-report.png", help="PNG to write (default: ooc-report.png)")
    p.add_argument("--budget", help="budget for planning a trace, e.g. 4GiB")
    p.add_argument("--policy", default="window", help="planner policy for a trace (default: window)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ooc.errors import OOCError
    from ooc.report import plot_schedule

    try:
        schedule = Schedule.from_json(args.input)
    except OOCError as as_plan:
        if "not an ooc.schedule file" not in str(as_plan):
            raise
        if not args.budget:
            raise OOCError(f"{args.input} is a trace: give --budget to plan it") from None
        seq = VariableSequence.from_json(args.input)
        schedule = plan(seq, budget=parse_size(args.budget, what="--budget"), policy=args.policy)
    plot_schedule(schedule, args.output)
    print(f"wrote {args.output}")
    return 0
