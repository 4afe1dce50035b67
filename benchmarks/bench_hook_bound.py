"""How fast could a hook-driven step that recomputes run on the H100's host? A bound, from the profiles.

    python benchmarks/bench_hook_bound.py [--quick] [--out PATH]

The Llama (5,872 ops a step, 113 ms in core on the H100) is host-bound under ooc's per-op
path: every op through a dispatch mode costs the host tens of microseconds. A hook-driven form
that recomputes (not built) would turn the mode on only around the ops its recompute chains
rerun: their *scopes* (the modules the ops ran in, from the profile's function names), in the
forward, where the chains' recipes are captured; the rest of the step would run as an anchored
step does, watched by autograd's saved-tensor hooks alone. This script bounds what that form
could reach, before anyone builds it.

For each H100 profile (``benchmarks/profiles/h100``) at 1/2 and 1/4 of its managed peak, three
forms of the plan the engine would make (``scheduler.plan`` on the profile's prices):

- ``per op`` (today's, for a plan that recomputes): every op through the dispatch mode, an op
  its plan gives no role (``quiet_functions``) at the engine's quiet cost, every other one and
  each op a replay reruns at its looked-at cost;
- ``anchored, swap only`` (today's hook-driven form): the swap-only plan at the same budget,
  no op intercepted, the saved-tensor hooks' cost per op (``HOOKS_US``);
- ``hook-driven, recomputing`` (not built): the hooks' cost, plus the mode over the forward ops
  inside a chain's scope (quiet cost; the chain ops looked at) and the replays (looked at).

Each form's bound is in core's step over the slower of its two lanes: the device's (its
predicted step with no host lane, ``scheduler.simulate``: op times, link) and the host's (every
op at in core's host time per op ``h0`` plus what the form adds, from the H100's host costs
measured in two runs: ``MEASURED``), at ``h0`` = the H100's in-core host time per op measured
for ResNet-50 (``H0_US``), or in core's step over its ops where that is less (in core exactly
host-bound: the Llama); and the largest ``h0`` at which the bound still reaches the issue's
0.85x at 1/2 (0.75x at 1/4).

A bound, not a prediction: the lanes overlap perfectly here, and nothing else slows the step.
Where even the bound misses the target, no such form reaches it; the measured forms (the
report's last lines) check the bound from above, and the next GPU run's in-core ``queued_ms``
(bench_gpu) gives the Llama's ``h0``.
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
from scheduler.schedule import Op, quiet_functions  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles" / "h100"
TARGETS = {0.5: 0.85, 0.25: 0.75}
# The H100's host, per op, from bench_gpu's "Host cost per op" (ResNet-50 b32, in core 29.5 and
# 31.2 us an op): what the engine's per-op path adds to a quiet op and to an op it looks at,
# in the fifth session's run (gpu.md: 75.8 / 89.2 us an op) and the seventh's
# (gpu-one-arena.md: 46.9 / 125.3 us).
MEASURED = {"gpu.md": (75.8 - 29.5, 89.2 - 29.5), "gpu-one-arena.md": (46.9 - 31.2, 125.3 - 31.2)}
H0_US = (29.5 + 31.2) / 2   # in core's host time per op on the H100, measured (ResNet-50 b32, two runs)
HOOKS_US = 4.7   # an anchored/plain step's host over in core's, per op (gpu.md's `ooc` row; 4.2 in the rerun)


def scope(name: str) -> str:
    """The module an op ran in: its function name's prefix (``"layers.3.mlp:aten.mul.Tensor"``)."""
    return name.rsplit(":", 1)[0] if ":" in name else ""


def lanes(schedule: scheduler.Schedule, form: str) -> dict[str, int]:
    """What ``form``'s host lane is made of: the step's ops, the ops the engine's mode sees at
    its quiet cost and at its looked-at cost, and the ops the replays rerun (looked at)."""
    seq = schedule.sequence
    functions = seq.functions
    chains = [a.chain for actions in schedule.before for a in actions if a.op is Op.RECOMPUTE]
    chained = {w for chain in chains for w in chain}
    replayed = sum(len(c) for c in chains)
    if form == "per op":
        quiet = len(quiet_functions(schedule))
        return {"ops": len(functions), "hooks": 0, "quiet": quiet, "looked": len(functions) - quiet,
                "replayed": replayed}
    if form == "anchored, swap only":
        return {"ops": len(functions), "hooks": 1, "quiet": 0, "looked": 0, "replayed": 0}
    end = int(seq.meta.get("loss_start", len(functions)))
    scopes = {scope(functions[w].name) for w in chained}
    in_scope = sum(1 for f in functions[:end] if scope(f.name) in scopes)
    return {"ops": len(functions), "hooks": 1, "quiet": in_scope - len(chained), "looked": len(chained),
            "replayed": replayed}


def host_s(counts: dict[str, int], h0_us: float, quiet_us: float, looked_us: float) -> float:
    """The host's lane of a form, in seconds (the module docstring's sum)."""
    us = (counts["ops"] * (h0_us + counts["hooks"] * HOOKS_US) + counts["quiet"] * quiet_us
          + counts["looked"] * looked_us + counts["replayed"] * (h0_us + looked_us))
    return us * 1e-6


def largest_h0(counts: dict[str, int], in_core_s: float, device_s: float, target: float,
               quiet_us: float, looked_us: float) -> float | None:
    """The largest in-core host time per op (us) at which the bound reaches ``target``; None if
    the form's other costs alone miss it."""
    room = in_core_s / target
    fixed = host_s(counts, 0.0, quiet_us, looked_us)
    if device_s > room or fixed > room:
        return None
    return (room - fixed) / (counts["ops"] + counts["replayed"]) * 1e6


FORMS = ("per op", "anchored, swap only", "hook-driven, recomputing")
# What the GPUs measured of these forms, to check the bounds from above.
MEASURED_FORMS = ["measured on the H100 (gpu.md, fcbc185), each at or under its bound: ResNet-50 per op 0.85x "
                  "at 1/2 and 0.75x at 1/4, GPT-2 per op 0.90x and 0.86x, the Llama anchored, swap only "
                  "0.53x and 0.35x; the Llama per op 0.19x at both on the H200 (gpu-h200.md, another host)"]


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
            budget = int(seq.in_core_peak_bytes * fraction)
            for form in FORMS:
                try:
                    schedule = scheduler.plan(seq, budget=budget, hardware=hw,
                                              recompute="never" if form.endswith("swap only") else "auto")
                except BudgetTooSmall:
                    rows.append([path.stem, f"{fraction:g}", form, "does not plan", *[""] * 4])
                    continue
                device_s = scheduler.simulate(schedule, hw, timeline=False).total_s
                counts = lanes(schedule, form)
                h0 = min(h0_worst, H0_US)
                bounds = [in_core_s / max(device_s, host_s(counts, h0, q, lk)) for q, lk in MEASURED.values()]
                h0s = [largest_h0(counts, in_core_s, device_s, target, q, lk) for q, lk in MEASURED.values()]
                rows.append([path.stem, f"{fraction:g}", form, f"{in_core_s / device_s:.2f}x",
                             f"{counts['quiet'] + counts['looked']:,} + {counts['replayed']:,}",
                             " / ".join(f"{b:.2f}x" for b in bounds),
                             f">= {target:.2f}x: {'met' if min(bounds) >= target else 'NOT met'}",
                             " / ".join("never" if h is None else f"{h:.1f} us" for h in h0s)])
    lines = common.header("Hook-driven forms on the H100's host: bounds from the profiles "
                          "(predicted, not measured)", quick=args.quick, notes=notes)
    lines += common.md_table(["profile", "budget", "form", "device lane alone", "ops the mode sees + replayed",
                              "bound at h0 (" + " / ".join(MEASURED) + " host costs)", "target",
                              "largest h0 that meets it"], rows)
    lines += ["", f"h0: in core's host time per op, here the H100's measured for ResNet-50 b32 ({H0_US:.1f} "
              "us, the mean of two runs: 29.5 and 31.2) or, where that is more than in core's step "
              "allows, in core exactly host-bound (its step over its ops: the Llama's 20.2 us). The "
              "Llama's own was never measured (bench_gpu's `queued_ms` of its in-core row tells it). "
              "Host costs added per op: quiet / looked at "
              + "; ".join(f"{k}: +{q:.1f} / +{lk:.1f} us" for k, (q, lk) in MEASURED.items())
              + f"; the hooks +{HOOKS_US} us.", "", *[f"- {m}" for m in MEASURED_FORMS]]
    common.write_report(common.result_path("hook-bound", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
