"""Whether the planner's choice is what keeps the host-bound Llama slower than checkpointing:
every plan it weighs, priced with the host's time per action as an H200 measured it.

    python benchmarks/bench_host_actions.py [--quick] [--out PATH]

On the H200 the Llama's hook-driven step at 1/2 of its peak ran 163.7 ms against in core's
117.0 ms, and checkpointing every 2nd block 132.7 ms at more peak (gpu-h200-db63edf.md). Its
clocked step (gpu-probe-h200-db63edf.md, ``gpu_probe.py --clocks``) spent 77.5 ms inside ooc's
hooks: each swap ~100 us of the host's time, each recompute 136 us, each free 11 us
(``CLOCKED``), the rest the hooks themselves. The planner prices none of that: it chooses among
its candidates (``scheduler.recompute``: swap only, and the swap-or-recompute rule at each
exposure) by ``simulate``'s device lane alone.

Here each candidate of the H200 profiles is priced on both lanes: the device's (``simulate``,
the profile's op times and link) and the host's, the step's ops at in core's host time per op
(``h0``: its step over its ops where in core is host-bound, else the H100's measured 30.4 us,
as ``bench_hook_bound.py`` takes it) plus every action of the plan at its clocked cost plus the
hooks (``HOOK_US`` a call, what the clocked step spent inside ooc outside its actions, per pack
and unpack). A candidate's step is the slower lane. If the fastest candidate so priced were
much faster than the one the planner chose, pricing the host would be the lever; the table
says by how much it is. The actions are the per-op plan's; the anchored form's (what ran)
moves a little more. The clocks' own cost is in those prices (the clocked step took 217.1 ms, the
same step unclocked 163.7 ms): each host lane here is high by up to that, alike for every
candidate; their order is the point. Predicted, not measured.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import scheduler  # noqa: E402
from bench_hook_bound import H0_US  # noqa: E402
from scheduler.ir import VariableSequence  # noqa: E402
from scheduler.managed import managed_view  # noqa: E402
from scheduler.pins import Pins  # noqa: E402
from scheduler.recompute import _candidate, candidate_grid, default_hardware  # noqa: E402
from scheduler.schedule import Op  # noqa: E402
from scheduler.window import default_window  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles"
# The Llama's clocked step at 1/2 on the H200 (gpu-probe-h200-db63edf.md): per action, us.
CLOCKED = {Op.SWAP_IN: 103.0, Op.SWAP_OUT: 99.6, Op.WAIT_IN: 14.4, Op.WAIT_OUT: 17.9,
           Op.FREE: 10.9, Op.DISCARD: 12.3, Op.RECOMPUTE: 135.8}
COUNTS = {Op.SWAP_IN: 111, Op.SWAP_OUT: 111, Op.WAIT_IN: 111, Op.WAIT_OUT: 111,
          Op.FREE: 485, Op.DISCARD: 107, Op.RECOMPUTE: 107}
INSIDE_MS, HOOK_CALLS = 77.5, 813 + 813   # inside ooc's hooks, and its packs and unpacks
HOOK_US = (INSIDE_MS * 1e3 - sum(CLOCKED[op] * n for op, n in COUNTS.items())) / HOOK_CALLS
# The same run's Llama rows (gpu-h200-db63edf.md): in core, checkpointing every 2nd block.
IN_CORE_MS, EVERY_2ND_MS = 117.0, 132.7
FRACTIONS = (0.75, 0.5, 0.25)


def host_actions_us(schedule: scheduler.Schedule) -> tuple[float, Counter]:
    """The host's time the plan's actions cost at their clocked prices, and their counts."""
    n: Counter = Counter(a.op for actions in (*schedule.before, *schedule.after) for a in actions)
    return sum(CLOCKED.get(op, 0.0) * k for op, k in n.items()), n


def candidates(seq: VariableSequence, budget: int, hw: scheduler.Hardware) -> list[tuple[str, scheduler.Schedule]]:
    """The plans ``plan_swap_or_recompute`` weighs on a GPU at the default window, by name."""
    out = []
    for exposure, through in candidate_grid(beside=True):
        plan = _candidate(seq, budget, default_window(budget), Pins(), hw, exposure, through)
        if plan is not None:
            name = "swap only" if exposure is None else f"exposure {exposure:g}{', through' if through is True else ''}"
            out.append((name, plan))
    return out


def rows_for(path: Path, fraction: float, saved: int) -> list[tuple[list[str], float]]:
    """Each plan's table row and its step (the slower lane, ms): the planner's choice first."""
    seq = managed_view(VariableSequence.from_json(path))
    hw = default_hardware(seq)
    ops = len(seq.functions)
    in_core_s = sum(f.cost.seconds or 0.0 for f in seq.functions)
    h0 = min(H0_US, in_core_s / ops * 1e6)
    budget = int(seq.in_core_peak_bytes * fraction)
    chosen = scheduler.plan(seq, budget=budget, hardware=hw)
    hooks = 2 * saved * HOOK_US
    rows = []
    for name, plan in [("chosen", chosen), *candidates(seq, budget, hw)]:
        device = scheduler.simulate(plan, hw, timeline=False).total_s * 1e3
        actions, n = host_actions_us(plan)
        host = (ops * h0 + actions + hooks) / 1e3
        rows.append(([path.stem, f"{fraction:g}", name, f"{device:.1f} ms", f"{host:.1f} ms",
                      f"{(actions + hooks) / 1e3:.1f} ms", f"{n[Op.SWAP_OUT]} / {n[Op.RECOMPUTE]}",
                      f"{max(device, host):.1f} ms"], max(device, host)))
    return rows


def main() -> int:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = ap.parse_args()
    from bench_hook_bound import saved_per_step

    names = ("llama",) if args.quick else ("llama", "gpt2", "resnet50")
    fractions = (0.5,) if args.quick else FRACTIONS
    rows: list[list[str]] = []
    verdicts: list[str] = []
    for name in names:
        saved = saved_per_step(name)
        for fraction in fractions:
            got = rows_for(PROFILES / f"{name}.json", fraction, saved)
            rows += [row for row, _ in got]
            step = {row[2]: ms for row, ms in got}
            best = min(step, key=step.get)
            verdicts.append(f"- {name} at {fraction:g}: the planner's choice {step['chosen']:.1f} ms with the host "
                            f"priced; the fastest candidate so priced ({best}) {step[best]:.1f} ms "
                            f"({(step[best] / step['chosen'] - 1) * 100:+.1f}%)")
    lines = common.header("The planner's candidates priced with the host's time per action (predicted)",
                          quick=args.quick, notes=[
        f"command: `python benchmarks/bench_host_actions.py{' --quick' if args.quick else ''}`",
        "per action (us, the H200's clocked Llama step at 1/2): "
        + ", ".join(f"{op.value} {us:g}" for op, us in CLOCKED.items())
        + f"; the hooks {HOOK_US:.1f} us a call (inside ooc {INSIDE_MS} ms, less its actions, over "
        f"{HOOK_CALLS} packs and unpacks); h0 as bench_hook_bound.py takes it"])
    lines += common.md_table(["profile", "budget", "plan", "device lane", "host lane", "ooc's host time",
                              "swaps / recomputes", "step (slower lane)"], rows)
    added = EVERY_2ND_MS - IN_CORE_MS
    lines += ["", *verdicts, "",
              f"Checkpointing every 2nd block added {added:.1f} ms to the Llama's in core step on the H200 "
              f"({EVERY_2ND_MS} against {IN_CORE_MS} ms, gpu-h200-db63edf.md); ooc's own host time at its peak "
              "or less must stay under that to be faster there. The column 'ooc's host time' is what each "
              "plan adds at the clocked prices."]
    common.write_report(common.result_path("host-actions", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
