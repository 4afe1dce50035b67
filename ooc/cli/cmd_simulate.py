"""``ooc simulate PLAN --hardware NAME``: predict a plan's step time and memory on given hardware.

Runs ``scheduler.simulate`` (a discrete-event model: one compute stream, one copy channel
per direction, the hardware preset's datasheet figures) on a plan from ``ooc plan -o``, or
on a trace with ``--budget`` (planned first, as ``ooc plan`` would, but swap against
recompute priced on ``--hardware``; ``--recompute`` as in ``ooc plan``). The results are
*predictions*, not measurements. Prints a table: step time, compute, stall, lower bound,
peak device bytes, bytes in/out, speed relative to compute only (the paper's "55% of
in-core speed" is 0.55), and with ``--allocator`` whether the allocation stream fits the
device's memory under PyTorch's caching allocator or fixed-size chunks (``vmm``, ``--chunk``).
When the plan recomputes tensors, the table lists the largest with what their chains cost on
this hardware (``ooc.cli.recomputed``: the seconds ``scheduler.simulate`` charges them).

``--data-parallel N`` simulates one rank of an N-rank DistributedDataParallel job: the
gradients' all-reduce runs beside the transfers, over the preset's interconnect or, on the
PCIe presets, over the same host link as the swaps (``scheduler/data_parallel.py``).

``--json`` prints one JSON object with exactly the keys of ``SimResult.to_dict()``,
``recomputed`` (every recompute action: ``{"var", "name", "bytes", "before", "functions",
"seconds"}``, its seconds on this hardware; empty when the plan only swaps) and
``device_peaks`` (``scheduler.arenas.DevicePeaks``: the whole step's device peak on a GPU
with one arena and with ooc's pool beside PyTorch's allocator, and each arena's; the
``device`` line of the table);
``--timeline FILE`` writes the predicted timeline as a Chrome/Perfetto trace, with one track
per kind of work: compute, wait, swap-in, swap-out, and recompute (one span per chain).

Errors the user can fix print one line and exit 2 (see ``ooc plan``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_HARDWARE = "v100-16gb-nvlink"


def register(subparsers: Any) -> None:
    from scheduler.hardware import PRESETS
    from scheduler.planner import POLICIES
    from scheduler.recompute import RECOMPUTE_MODES
    from scheduler.simulate import ALLOCATORS

    from ooc.cli.args import MANAGE_HELP, SIZE_HELP, choice, host_us, manage_kinds, output_file, positive_int, size
    from ooc.cli.cmd_plan import RECOMPUTE_HELP

    p = subparsers.add_parser(
        "simulate", help="predict step time and device memory of a plan on given hardware",
        description="Predict the time and device memory of one training step of a plan (or of a "
                    "trace, planned first with --budget) on a hardware preset: a simulation, "
                    "not a measurement.", epilog=SIZE_HELP)
    p.add_argument("input", metavar="PLAN", help="plan JSON (ooc plan -o), or a trace JSON with --budget")
    p.add_argument("--hardware", default=None, metavar="NAME",
                   type=choice(sorted(PRESETS), "hardware"),
                   help=f"hardware preset: {', '.join(sorted(PRESETS))} (default {DEFAULT_HARDWARE}; for a "
                        "GPU profile, h100-80gb-pcie5 with the link the profile measured)")
    p.add_argument("--device-memory", metavar="SIZE", type=size,
                   help="usable device memory instead of the preset's nominal size, e.g. 15.25GiB")
    p.add_argument("--allocator", metavar="NAME", type=choice(ALLOCATORS, "allocator"),
                   help="also replay the allocations: caching (PyTorch's) or vmm (fixed chunks)")
    p.add_argument("--chunk", metavar="SIZE", type=size, help="chunk size of --allocator vmm (default 2MiB)")
    p.add_argument("--timeline", metavar="FILE", type=output_file(),
                   help="write the timeline as a Chrome trace JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--host-us", metavar="OP[,QUIET]", type=host_us,
                   help="a GPU's host: microseconds to queue an op the engine looks at, and one its plan "
                        "gives no role (bench_gpu.py's 'Host cost per op' measures both); an op starts "
                        "no sooner than queued (default: the host is not modelled)")
    p.add_argument("--data-parallel", metavar="N", type=positive_int, default=1,
                   help="ranks of a DDP job: simulate one rank, its gradient all-reduce beside the swaps")
    p.add_argument("--budget", metavar="SIZE", type=size, help="plan a trace input within this budget first")
    p.add_argument("--window", metavar="SIZE", type=size, help="with --budget: prefetch window (window policies)")
    p.add_argument("--policy", metavar="NAME", type=choice(POLICIES, "policy"),
                   help=f"with --budget: planner policy ({', '.join(POLICIES)}; default window)")
    p.add_argument("--recompute", metavar="MODE", type=choice(RECOMPUTE_MODES, "recompute mode"),
                   help=f"with --budget: {RECOMPUTE_HELP}")
    p.add_argument("--manage", metavar="KINDS", type=manage_kinds, help=f"with --budget: {MANAGE_HELP}")
    p.add_argument("--bounded", action="store_true",
                   help="with --budget and --manage: the budget is the device's, and the plan holds at each op "
                        "at most it less what the trace holds outside the managed tensors there "
                        "(Options(budget_covers='step') with one arena; see ooc fit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from scheduler.arenas import device_peaks
    from scheduler.beside import unmanaged_bytes
    from scheduler.schedule import Schedule
    from scheduler.simulate import simulate
    from scheduler.timeline import write_chrome_trace
    from vmm.errors import OOCError
    from vmm.units import format_size

    from ooc.cli.cmd_plan import DEFAULT_POLICY, Progress, check_recompute, load, managed, plan_and_summarize
    from ooc.cli.recomputed import as_json, recomputed

    # Every value was checked by the parser; what remains are combinations, still before work.
    chunk = None
    if args.chunk is not None:
        if args.allocator != "vmm":
            raise OOCError("--chunk sets the chunk size of --allocator vmm; add --allocator vmm")
        chunk = args.chunk
    budget, window = args.budget, args.window
    policy = args.policy if args.policy is not None else DEFAULT_POLICY
    if budget is None and (args.window is not None or args.policy is not None or args.recompute is not None
                           or args.manage is not None or args.bounded):
        raise OOCError("--window, --policy, --recompute, --manage and --bounded plan a trace: give --budget too")
    if args.bounded and (args.manage is None or policy != "window"):
        raise OOCError("--bounded plans the managed tensors beside the rest of the step: give --manage, "
                       "and the window policy")
    check_recompute(args.recompute, policy)

    with Progress(3 + bool(args.timeline), disable=args.no_progress) as bar:
        bar.stage(f"loading {args.input}")
        obj = load(args.input)
        seq = obj.sequence if isinstance(obj, Schedule) else obj   # the whole step (--manage plans part of it)
        hw = hardware_for(seq, args.hardware, args.host_us, args.device_memory)
        bar.stage("planning")
        if isinstance(obj, Schedule):
            if budget is not None:
                raise OOCError(
                    f"{args.input} is already a plan (policy {obj.policy}, budget {format_size(obj.budget)}); "
                    f"--budget/--window/--policy/--recompute apply to a trace: re-plan with `ooc plan`")
            schedule = obj
        else:
            if budget is None:
                raise OOCError(f"{args.input} is a trace, not a plan: give --budget SIZE to plan it "
                               f"first, or run `ooc plan` and simulate its -o file")
            # priced on the hardware simulated: auto's swap-or-recompute choice is made for it
            if args.manage is not None:
                obj = managed(obj, args.manage)
            beside = tuple(unmanaged_bytes(seq, obj)[:len(obj.functions)]) if args.bounded else ()
            schedule, _ = plan_and_summarize(obj, budget, window, policy, recompute=args.recompute,
                                             hardware=hw, beside=beside)
        bar.stage(f"simulating on {hw.name}")
        result = simulate(schedule, hw, allocator=args.allocator, chunk_bytes=chunk,
                          timeline=bool(args.timeline), data_parallel=args.data_parallel)
        if args.timeline:
            bar.stage(f"writing {args.timeline}")
            write_chrome_trace(result.timeline, args.timeline,
                               process_name=f"ooc simulate ({hw.name}, {schedule.policy})")
    rc = recomputed(schedule, hw)
    peaks = device_peaks(seq, schedule)
    if args.json:
        print(json.dumps({**result.to_dict(), "recomputed": as_json(rc), "device_peaks": asdict(peaks)}))
    else:
        print(_table(result, schedule, args.timeline, rc, peaks))
    return 0


def hardware_for(seq: Any, name: str | None, host_us: tuple[float, float] | None = None,
                 device_memory: int | None = None) -> Any:
    """The preset ``name`` (``--hardware``), else a GPU profile's own link on the H100 preset,
    else ``DEFAULT_HARDWARE``; with ``--host-us`` (microseconds to queue an op, a quiet one) and
    ``--device-memory`` applied."""
    from scheduler.hardware import hardware
    from scheduler.recompute import default_hardware

    overrides: dict[str, Any] = {}
    if device_memory is not None:
        overrides["device_bytes"] = device_memory
    if host_us is not None:
        overrides["host_op_s"], overrides["host_quiet_op_s"] = (us * 1e-6 for us in host_us)
    if name is not None:
        return hardware(name, **overrides)
    if "link_bytes_per_s" in seq.meta:   # a GPU profile: its own link
        return hardware(default_hardware(seq), **overrides)
    return hardware(DEFAULT_HARDWARE, **overrides)


def _table(r: Any, schedule: Any, timeline: str | None, rc: list[Any], peaks: Any) -> str:
    from vmm.units import format_size as fs

    from ooc.cli.recomputed import table

    def ms(s: float) -> str:
        return f"{s * 1e3:,.2f} ms"

    hw = r.hardware
    lines = [
        f"simulated on {hw.name} ({fs(hw.device_bytes)} device, "
        f"{hw.h2d_bandwidth / 1e9:.3g}/{hw.d2h_bandwidth / 1e9:.3g} GB/s in/out): a prediction, "
        f"not a measurement",
        f"plan: policy {r.policy}, budget {fs(r.budget)}, {len(schedule.sequence.functions):,} functions",
        "",
        f"{'step time':<16}{ms(r.total_s)}",
        f"{'compute':<16}{ms(r.compute_s)}  (in-core step: nothing swapped)",
        f"{'stall':<16}{ms(r.stall_s)}  (compute waiting for copies)",
        f"{'lower bound':<16}{ms(r.lower_bound_s)}  (perfect overlap of these transfers)",
        f"{'relative speed':<16}{r.relative_speed:.3f}  (compute / step time)",
        f"{'peak':<16}{fs(r.peak_bytes)}  ({r.peak_bytes} B, at function {r.peak_function})",
        f"{'device, GPU':<16}{fs(peaks.two_arenas)} with ooc's pool (PyTorch's {fs(peaks.torch)} + pool "
        f"{fs(peaks.pool)}), {fs(peaks.one_arena)} in one arena (arena='pytorch')",
        f"{'':<16}(the whole step's tensors, modelled: no allocator rounding, no workspaces)",
        f"{'bytes in':<16}{fs(r.bytes_in)}  in {r.transfers_in:,} copies, "
        f"link busy {ms(r.h2d_busy_s)}",
        f"{'bytes out':<16}{fs(r.bytes_out)}  in {r.transfers_out:,} copies, "
        f"link busy {ms(r.d2h_busy_s)}",
    ]
    if r.host_s:
        lines.append(f"{'host':<16}{ms(r.host_s)} queuing the step's ops; compute waited for it {ms(r.host_wait_s)}")
    if r.data_parallel > 1:
        link = ("over the host link, queued with the swaps" if hw.collective_bandwidth == 0 else
                f"over its own {hw.collective_bandwidth / 1e9:.3g} GB/s interconnect")
        lines.append(f"{'all-reduce':<16}{fs(r.allreduce_bytes)} per rank ({r.data_parallel} ranks, ring), "
                     f"{link}: busy {ms(r.allreduce_s)}, compute waited {ms(r.allreduce_stall_s)}")
    if r.allocator is not None:
        name = r.allocator if r.allocator == "caching" else f"vmm, {fs(r.chunk_bytes)} chunks"
        lines.append(f"{'allocator':<16}{name}: reserved peak {fs(r.reserved_peak_bytes)}")
    if rc:
        lines.append(f"{'recompute':<16}{ms(r.recompute_s)}  ({len(rc):,} tensors, {fs(r.bytes_recomputed)} "
                     f"re-created by rerunning their chains on the compute stream)")
        lines.extend(table(rc, schedule))
    if r.fits:
        lines.append(f"{'fits':<16}yes, within {fs(hw.device_bytes)}")
    else:
        where = f" at function {r.oom_function}" if r.oom_function is not None else ""
        lines.append(f"{'fits':<16}NO: out of device memory{where}")
        lines.append(f"{'':<16}{_what_to_do(r)}")
    if timeline:
        lines.append(f"wrote {timeline} (open in https://ui.perfetto.dev or chrome://tracing)"
                     + ("; recomputes on the 'recompute' track" if rc else ""))
    return "\n".join(lines)


def _what_to_do(r: Any) -> str:
    """The next step when the step does not fit, decided from the figures so that it ends
    somewhere: bytes the plan keeps live call for a smaller budget (never for another
    allocator), bytes an allocator adds on top for that allocator's remedy."""
    from vmm.units import format_size as fs

    device = r.hardware.device_bytes
    if r.peak_bytes > device:
        return (f"the plan itself keeps {fs(r.peak_bytes)} live, over the {fs(device)} device: "
                f"re-plan with `ooc plan TRACE --budget` below {fs(device)} (no allocator helps)")
    if r.allocator == "caching":
        return (f"the plan's {fs(r.peak_bytes)} live fit in {fs(device)}, the caching allocator's "
                f"segments do not (fragmentation): try --allocator vmm, or re-plan with a lower budget")
    return (f"the plan's {fs(r.peak_bytes)} live fit in {fs(device)}, rounded up to "
            f"{fs(r.chunk_bytes)} chunks they do not: try a smaller --chunk, or re-plan with a "
            f"lower budget")
