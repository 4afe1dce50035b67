"""``ooc plan TRACE --budget SIZE``: plan when each tensor leaves the device and comes back.

Reads a variable sequence (``ooc trace ... -o trace.json``; a plan file works too: its
sequence is planned again), runs ``scheduler.plan`` (which proves the schedule safe with
``scheduler.check`` before returning it), writes the Schedule with ``-o`` and prints a
table: policy, budget, window, in-core peak, peak resident, bytes in/out, transfers, plan time,
and when the plan recomputes tensors instead of swapping them, the largest of those tensors
with the function before which each is recomputed, the chain it reruns and the chain's
predicted seconds (``ooc.cli.recomputed``; priced on the hardware the planner priced on,
``scheduler.recompute.default_hardware``). ``--recompute auto|prefer|never`` is the window
policy's ``recompute`` option (``scheduler.plan``).

``--json`` prints one JSON object: the keys of ``Schedule.summary()`` (policy, budget,
window, functions, variables, in_core_peak_bytes, peak_resident_bytes, bytes_in,
bytes_out, bytes_recomputed) plus ``plan_seconds``, ``transfers_in``, ``transfers_out``,
``output`` and ``recomputed`` (every recompute action: ``{"var", "name", "bytes", "before",
"functions", "seconds"}``; empty when the plan only swaps).

``--compare`` plans every policy at the same budget and prints them side by side (with
``--json``: ``{"budget", "window", "policies": [...]}``, one entry per policy, either its
summary or ``{"policy", "feasible": false, "minimum_bytes"}``). ``-o`` still writes the
``--policy`` schedule.

Errors the user can fix (missing or foreign file, a size such as "sixteen", a budget below
what the step needs, an unknown policy, ``--recompute`` with a policy that only swaps) print
one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

DEFAULT_POLICY = "window"
RECOMPUTE_HELP = ("how policy window frees memory: auto (default: swap or recompute each tensor, "
                  "whichever the hardware prices lower), prefer (recompute every tensor that can be), "
                  "never (swap only)")


def register(subparsers: Any) -> None:
    from scheduler.planner import POLICIES
    from scheduler.recompute import RECOMPUTE_MODES

    from ooc.cli.args import MANAGE_HELP, SIZE_HELP, choice, manage_kinds, output_file, positive_int, size

    p = subparsers.add_parser(
        "plan", help="plan swap-outs and swap-ins of a traced step within a device budget",
        description="Plan one training step (a trace from `ooc trace -o`) within a device memory "
                    "budget, prove the plan safe, and write it as JSON.", epilog=SIZE_HELP)
    p.add_argument("input", metavar="TRACE", help="variable sequence JSON (ooc trace -o), or a plan JSON")
    p.add_argument("--budget", required=True, metavar="SIZE", type=size,
                   help="device bytes the plan may use, e.g. 16GiB (2^30 bytes), 15.5GB (10^9 bytes), 512MiB")
    p.add_argument("--window", metavar="SIZE", type=size,
                   help="prefetch window of the window policies (default 1.5 x budget; policy window with recomputation on a GPU preset also tries 3 x and keeps the faster)")
    p.add_argument("--policy", default=DEFAULT_POLICY, metavar="NAME", type=choice(POLICIES, "policy"),
                   help=f"{DEFAULT_POLICY} (default), " + ", ".join(n for n in POLICIES if n != DEFAULT_POLICY))
    p.add_argument("--recompute", metavar="MODE", type=choice(RECOMPUTE_MODES, "recompute mode"),
                   help=RECOMPUTE_HELP)
    p.add_argument("--manage", metavar="KINDS", type=manage_kinds, help=MANAGE_HELP)
    p.add_argument("-o", "--output", metavar="FILE", type=output_file(), help="write the schedule as JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--compare", action="store_true",
                   help="plan every policy at this budget and print them side by side")
    p.add_argument("--data-parallel", metavar="N", type=positive_int, default=1,
                   help="ranks of a DDP job: also show the bytes each rank all-reduces per step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from scheduler.errors import BudgetTooSmall
    from scheduler.planner import POLICIES
    from scheduler.recompute import default_hardware

    from ooc.cli.recomputed import as_json, recomputed

    policy, budget, window = args.policy, args.budget, args.window  # checked by the parser
    check_recompute(args.recompute, policy, compare=args.compare)
    policies = POLICIES if args.compare else (policy,)
    with Progress(1 + len(policies) + bool(args.output), disable=args.no_progress) as bar:
        bar.stage(f"loading {args.input}")
        seq = load_sequence(args.input, args.manage)
        rows: dict[str, dict[str, Any]] = {}
        schedule = None
        for name in policies:
            bar.stage(f"planning ({name})")
            try:
                s, info = plan_and_summarize(seq, budget, window, name, recompute=args.recompute)
            except BudgetTooSmall as exc:
                if not args.compare:
                    raise
                rows[name] = {"policy": name, "feasible": False, "minimum_bytes": exc.minimum}
                continue
            rows[name] = {**info, "feasible": True} if args.compare else info
            if name == policy:
                schedule = s
        if args.output:
            if schedule is None:  # --compare, and the chosen policy does not fit: say why
                plan_and_summarize(seq, budget, window, policy, recompute=args.recompute)
            bar.stage(f"writing {args.output}")
            schedule.to_json(args.output)
    if args.compare:
        if args.json:
            print(json.dumps({"budget": budget, "window": window, "policies": list(rows.values()),
                              "output": args.output}))
        else:
            print(_compare_table(seq, budget, window, rows, policy, args.output))
        return 0
    # the hardware the planner priced swap against recompute on (plan's default)
    hw = default_hardware(seq)
    rc = recomputed(schedule, hw)
    info = {**rows[policy], "output": args.output, "recomputed": as_json(rc)}
    if args.data_parallel > 1:   # beside the transfers: what the same link may also carry
        from scheduler.data_parallel import allreduce_bytes

        info.update(data_parallel=args.data_parallel, allreduce_bytes=allreduce_bytes(seq, args.data_parallel))
    if args.json:
        print(json.dumps(info))
    else:
        print(_table(info, _listing(rc, schedule, hw)))
    return 0


# -- shared with ``ooc simulate`` ------------------------------------------------------------


def load(path: str) -> Any:
    """A trace or a plan file: a ``VariableSequence`` or a ``Schedule``, by its schema.

    Missing, unreadable, non-JSON and foreign files raise ``SequenceFormatError`` with one
    line that names the file (the CLI exits 2 with it).
    """
    from scheduler import ir, schedule
    from scheduler.errors import SequenceFormatError
    from scheduler.json_files import load_json

    data = load_json(path)
    kinds = {ir.SCHEMA: (ir.VERSION, ir.VariableSequence),
             schedule.SCHEMA: (schedule.VERSION, schedule.Schedule)}
    found = data.get("schema") if isinstance(data, dict) else type(data).__name__
    if found not in kinds:
        raise SequenceFormatError(
            f"{path}: not an ooc trace or plan (schema is {found!r}; expected "
            f"{ir.SCHEMA!r} from `ooc trace -o` or {schedule.SCHEMA!r} from `ooc plan -o`)")
    version, cls = kinds[found]
    if data.get("version") != version:
        raise SequenceFormatError(f"{path}: {found} version {data.get('version')!r} is not "
                                  f"supported (this ooc reads {version})")
    return cls.from_dict(data, where=os.fspath(path))


def load_sequence(path: str, manage: tuple[str, ...] | None = None) -> Any:
    """The variable sequence in ``path`` (a plan file gives the sequence it planned); with
    ``manage``, only what ``OutOfCore(manage=...)`` would manage of it (``managed``)."""
    from scheduler.schedule import Schedule

    obj = load(path)
    seq = obj.sequence if isinstance(obj, Schedule) else obj
    return seq if manage is None else managed(seq, manage)


def managed(seq: Any, manage: tuple[str, ...]) -> Any:
    """``scheduler.managed.managed_view`` with the engine's defaults (from 1 MiB, 2 MiB chunks)."""
    from scheduler.managed import kinds_of, managed_view

    return managed_view(seq, kinds_of(manage))


def check_recompute(recompute: str | None, policy: str, *, compare: bool = False) -> None:
    """Refuse ``--recompute`` with a policy that does not take it, before any work: silently
    ignoring it would show a swap-only plan to a user who asked for recomputation."""
    from vmm.errors import OOCError

    if recompute is not None and policy != "window" and not compare:
        raise OOCError(f"--recompute chooses how policy window frees memory; policy {policy} does not "
                       f"take it: drop --recompute, or plan with --policy window")


def plan_and_summarize(seq: Any, budget: int, window: int | None, policy: str, *,
                       recompute: str | None = None, hardware: Any = None,
                       beside: tuple[int, ...] = ()) -> tuple[Any, dict[str, Any]]:
    """``scheduler.plan`` timed, and its summary: ``Schedule.summary()`` + plan_seconds +
    transfers_in/transfers_out. ``window`` is passed to the window policies only,
    ``recompute`` (None: plan's default) to policy window only, ``hardware`` (None: plan's
    default) to the policies that price recomputation on it (window, milp), ``beside`` (the
    bytes held outside the plan at each function: a plan bounded by the device) to window."""
    from scheduler.planner import plan
    from scheduler.schedule import Op

    options: dict[str, Any] = {"beside": beside} if beside else {}
    if policy == "window" and recompute is not None:
        options["recompute"] = recompute
    if policy in ("window", "milp") and hardware is not None:
        options["hardware"] = hardware
    t0 = time.perf_counter()
    s = plan(seq, budget, window if policy.startswith("window") else None, policy, **options)
    seconds = time.perf_counter() - t0
    n_in = n_out = 0
    for acts in (*s.before, *s.after):
        for a in acts:
            n_in += a.op is Op.SWAP_IN
            n_out += a.op is Op.SWAP_OUT
    return s, {**s.summary(), "plan_seconds": round(seconds, 4),
               "transfers_in": n_in, "transfers_out": n_out}


class Progress:
    """A stage-by-stage tqdm bar on stderr, only on a terminal (never in pipes or tests)."""

    def __init__(self, total: int, *, disable: bool = False) -> None:
        self._bar = None
        if disable or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency; a bar is a nicety
            return
        self._bar = tqdm(total=total, file=sys.stderr, leave=False, unit="step",
                         bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
        self._started = False

    def stage(self, what: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description_str(what)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()


# -- tables ---------------------------------------------------------------------------------


def _listing(rows: list[Any], schedule: Any, hw: Any) -> list[str]:
    """The recomputed tensors under a one-line total, or nothing when the plan only swaps."""
    from vmm.units import format_size as fs

    from ooc.cli.recomputed import table

    if not rows:
        return []
    seconds = sum(r.seconds for r in rows)
    return [f"{'recomputed':<15}{len(rows):,} tensors, {fs(sum(r.nbytes for r in rows))}; their chains "
            f"rerun {seconds * 1e3:,.3f} ms on {hw.name} (predicted)",
            *table(rows, schedule)]


def _table(info: dict[str, Any], listing: list[str]) -> str:
    from vmm.units import format_size as fs

    def size(n: int) -> str:
        return f"{fs(n)}  ({n} B)"

    rows = [
        ("policy", info["policy"]),
        ("budget", size(info["budget"])),
        ("window", size(info["window"]) if info["window"] else "-"),
        ("functions", f"{info['functions']:,}"),
        ("variables", f"{info['variables']:,}"),
        ("in-core peak", size(info["in_core_peak_bytes"])),
        ("peak resident", size(info["peak_resident_bytes"])),
        ("bytes in", size(info["bytes_in"])),
        ("bytes out", size(info["bytes_out"])),
        ("transfers", f"{info['transfers_in']:,} in, {info['transfers_out']:,} out"),
        *([("all-reduce", f"{size(info['allreduce_bytes'])} per rank per step ({info['data_parallel']} "
                          f"ranks, ring); ooc simulate --data-parallel shows whether it shares a link")]
          if "allreduce_bytes" in info else []),
        ("plan time", f"{info['plan_seconds']:.3f} s (planned and checked)"),
    ]
    lines = [f"{k:<15}{v}" for k, v in rows]
    if info["bytes_in"] == 0 and info["bytes_out"] == 0 and not info.get("bytes_recomputed"):
        lines.append("nothing moves: the step fits in the budget as is")
    lines.extend(listing)
    if info.get("output"):
        lines.append(f"wrote {info['output']}")
    return "\n".join(lines)


def _compare_table(seq: Any, budget: int, window: int | None, rows: dict[str, dict[str, Any]],
                   chosen: str, output: str | None) -> str:
    from vmm.units import format_size as fs

    lines = [
        f"{len(seq.functions):,} functions, in-core peak {fs(seq.in_core_peak_bytes)}; "
        f"budget {fs(budget)}" + (f", window {fs(window)}" if window else ""),
        "",
        f"{'policy':<14}{'bytes in':>12}{'bytes out':>12}{'transfers':>11}"
        f"{'peak resident':>15}{'plan s':>9}",
    ]
    for name, r in rows.items():
        if not r.get("feasible", True):
            lines.append(f"{name:<14}  infeasible (min {fs(r['minimum_bytes'])})")
            continue
        lines.append(
            f"{name:<14}{fs(r['bytes_in']):>12}{fs(r['bytes_out']):>12}"
            f"{r['transfers_in'] + r['transfers_out']:>11,}{fs(r['peak_resident_bytes']):>15}"
            f"{r['plan_seconds']:>9.3f}")
    if output:
        lines.append(f"wrote {output} ({chosen})")
    return "\n".join(lines)
