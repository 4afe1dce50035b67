"""How fast could a hook-driven step that recomputes run on the H100's host? A bound, from the profiles.

    python benchmarks/bench_hook_bound.py [--quick] [--out PATH]

The Llama (5,872 ops a step, 113 ms in core on the H100) is host-bound under ooc's per-op
path: every op through a dispatch mode costs the host tens of microseconds. A hook-driven form
that recomputes (not built) would turn the mode on only around the ops its recompute chains
rerun: their *scopes* (the modules the ops ran in, from the profile's function names), in the
forward, where the chains' recipes are captured; the rest of the step would run as an anchored
step does, watched by autograd's saved-tensor hooks alone. This script bounds what that form
could reach, before anyone builds it.

For each H100 profile (``benchmarks/profiles/h100``) at 1/2 and 1/4 of its managed peak, the
plan the engine would make (``scheduler.plan`` on the profile's prices) and:

- ``device``: its predicted step with no host lane (``scheduler.simulate``: op times, link);
- the host's lane of the form: every op at in core's host time per op ``h0``, plus the hooks'
  cost per op an anchored step measured (``HOOKS_US``), plus, for each forward op inside a
  chain's scope, what the engine's per-op path adds to a quiet op, and for each chain op and
  each op a replay reruns, what it adds to an op it looks at (both measured on the H100, two
  runs: ``MEASURED``);
- the bound: in core's step over the slower of the two lanes, at ``h0`` = in core's step over
  its ops (in core exactly host-bound: the worst case), and the largest ``h0`` at which the
  bound still reaches the issue's 0.85x at 1/2 (0.75x at 1/4).

A bound, not a prediction: the lanes overlap perfectly here, and nothing else slows the step.
Where even the bound misses the target, no hook-driven form that intercepts the chains' ops
reaches it; the next GPU run's in-core ``queued_ms`` (bench_gpu) gives ``h0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import scheduler  # noqa: E402
from scheduler.errors import BudgetTooSmall  # noqa: E402
from scheduler.ir import VariableSequence  # noqa: E402
from scheduler.managed import managed_view  # noqa: E402
from scheduler.recompute import default_hardware  # noqa: E402
from scheduler.schedule import Op  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles" / "h100"
TARGETS = {0.5: 0.85, 0.25: 0.75}
# The H100's host, per op, from bench_gpu's "Host cost per op" (ResNet-50 b32, in core 29.5 and
# 31.2 us an op): what the engine's per-op path adds to a quiet op and to an op it looks at,
# in the fifth session's run (gpu.md: 75.8 / 89.2 us an op) and the seventh's
# (gpu-one-arena.md: 46.9 / 125.3 us).
MEASURED = {"gpu.md": (75.8 - 29.5, 89.2 - 29.5), "gpu-one-arena.md": (46.9 - 31.2, 125.3 - 31.2)}
HOOKS_US = 4.7   # an anchored/plain step's host over in core's, per op (gpu.md's `ooc` row; 4.2 in the rerun)


def scope(name: str) -> str:
    """The module an op ran in: its function name's prefix (``"layers.3.mlp:aten.mul.Tensor"``)."""
    return name.rsplit(":", 1)[0] if ":" in name else ""


def lanes(schedule: scheduler.Schedule) -> dict[str, int]:
    """The counts the host lane is made of: the step's ops, the forward ops in the chains'
    scopes (the mode on), the chain ops themselves, and the ops the replays rerun."""
    seq = schedule.sequence
    functions = seq.functions
    end = int(seq.meta.get("loss_start", len(functions)))
    chains = [a.chain for actions in schedule.before for a in actions if a.op is Op.RECOMPUTE]
    chained = {w for chain in chains for w in chain}
    scopes = {scope(functions[w].name) for w in chained}
    in_scope = sum(1 for f in functions[:end] if scope(f.name) in scopes)
    return {"ops": len(functions), "in_scope": in_scope, "chained": len(chained),
            "replayed": sum(len(c) for c in chains)}


def host_s(counts: dict[str, int], h0_us: float, quiet_us: float, looked_us: float) -> float:
    """The host's lane of the form, in seconds (the module docstring's sum)."""
    us = (counts["ops"] * (h0_us + HOOKS_US) + (counts["in_scope"] - counts["chained"]) * quiet_us
          + counts["chained"] * looked_us + counts["replayed"] * (h0_us + looked_us))
    return us * 1e-6


def largest_h0(counts: dict[str, int], in_core_s: float, device_s: float, target: float,
               quiet_us: float, looked_us: float) -> float | None:
    """The largest in-core host time per op (us) at which the bound reaches ``target``; None if
    the device lane alone misses it."""
    room = in_core_s / target
    if device_s > room:
        return None
    fixed = host_s(counts, 0.0, quiet_us, looked_us)
    return max(0.0, (room - fixed) / (counts["ops"] + counts["replayed"]) * 1e6)


def main() -> int:
    p = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = p.parse_args()
    rows, notes = [], []
    paths = sorted(PROFILES.glob("*.json"))
    for path in paths[:1] if args.quick else paths:
        seq = managed_view(VariableSequence.from_json(path))
        hw = default_hardware(seq)
        in_core_s = sum(f.cost.seconds or 0.0 for f in seq.functions)
        h0_worst = in_core_s / len(seq.functions) * 1e6
        notes.append(f"`{path.name}`: {len(seq.functions):,} ops, in core {in_core_s * 1e3:.1f} ms of ops "
                     f"(in core host-bound at {h0_worst:.1f} us an op)")
        for fraction, target in TARGETS.items():
            try:
                schedule = scheduler.plan(seq, budget=int(seq.in_core_peak_bytes * fraction), hardware=hw)
            except BudgetTooSmall:
                rows.append([path.stem, f"{fraction:g}", "does not plan", *[""] * 6])
                continue
            device_s = scheduler.simulate(schedule, hw, timeline=False).total_s
            counts = lanes(schedule)
            for run, (quiet_us, looked_us) in MEASURED.items():
                bound = in_core_s / max(device_s, host_s(counts, h0_worst, quiet_us, looked_us))
                h0 = largest_h0(counts, in_core_s, device_s, target, quiet_us, looked_us)
                rows.append([path.stem, f"{fraction:g}", f"{in_core_s / device_s:.2f}x",
                             f"{counts['ops']:,} / {counts['in_scope']:,} / {counts['chained']:,} / "
                             f"{counts['replayed']:,}", run, f"+{quiet_us:.1f} / +{looked_us:.1f}",
                             f"{bound:.2f}x", f">= {target:.2f}x: {'met' if bound >= target else 'NOT met'}",
                             "never (device lane)" if h0 is None else f"{h0:.1f} us"])
    lines = common.header("A hook-driven form that recomputes: its bound on the H100's host "
                          "(predicted, not measured)", quick=args.quick, notes=notes)
    lines += common.md_table(["profile", "budget", "device lane alone", "ops / forward ops in chain scopes / "
                              "chain ops / replayed", "host figures", "us added (quiet / looked at)",
                              "bound at worst h0", "target", "largest h0 that meets it"], rows)
    lines += ["", "h0: in core's host time per op. 'worst': in core exactly host-bound (its step over "
              "its ops). The H100's in-core host time per op measured for ResNet-50 b32: 29.5 and "
              "31.2 us (two runs); the Llama's was never measured (bench_gpu's `queued_ms` of its "
              "in-core row tells it)."]
    common.write_report(common.result_path("hook-bound", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
