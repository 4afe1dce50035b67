"""How much a GPU plan loses when the op times it was made from are noisy, on any machine.

    python benchmarks/bench_plan_noise.py [--quick] [--out PATH] [--profiles DIR]

Why: on the H100 two runs of the same commit (benchmarks/results/gpu-one-arena.md and
gpu-one-arena-rerun.md) timed in core and checkpointing within 0.3% of each other, but ooc's
rows from 4% faster to 28% slower, with different plans: the engine plans on the op times its
recording step measured (CUDA events), one step's worth. This asks whether that noise alone
can explain it. Each H100 profile (benchmarks/profiles/h100/) is planned as the engine plans
it (``managed_view``, the profile's link) at 1/2 and 1/4 of its managed peak twice over:

- on its own op times (the reference plan), and
- on op times each multiplied by ``exp(N(0, sigma))`` (a fixed seed, several draws per sigma),

and every plan is simulated on the profile's own times (``dataclasses.replace`` of the plan's
sequence: the same ops and tensors, only the times differ). A second table biases the times
the way a recording step can, systematically: a cold caching allocator (``cudaMalloc`` inside
each op that makes a tensor: ``+c`` us on each, ``COLD_US``) and a slow host (every op 10%
longer): what planning on warm times (re-pricing on the planned runs) can win back. A plan made from noisy times that
runs slower on the true ones is what the noise costs; the spread over draws is the run-to-run
spread it alone would cause. Simulated, not measured: the simulator was 2-17% off the
measured rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import scheduler  # noqa: E402
from scheduler.ir import VariableSequence  # noqa: E402
from scheduler.managed import managed_view  # noqa: E402
from scheduler.recompute import default_hardware  # noqa: E402

HERE = Path(__file__).resolve().parent
FRACTIONS = (0.5, 0.25)
SIGMAS = (0.02, 0.05, 0.10)   # CUDA-event op times: a few percent per op is typical; 10% is a noisy host
COLD_US = (20, 50, 100)   # cudaMalloc's cost inside an op that makes a tensor, cold allocator


def retimed(seq: VariableSequence, time_of: Callable[[int, float], float]) -> VariableSequence:
    """``seq`` with each measured op time ``t`` of function ``i`` made ``time_of(i, t)``; all else kept."""
    fns = tuple(dataclasses.replace(f, cost=dataclasses.replace(f.cost, seconds=time_of(i, f.cost.seconds)))
                if f.cost.seconds is not None else f for i, f in enumerate(seq.functions))
    return VariableSequence(fns, seq.variables, dict(seq.meta))


def noisy(seq: VariableSequence, sigma: float, rng: random.Random) -> VariableSequence:
    """``seq`` with each measured op time multiplied by ``exp(N(0, sigma))``; all else kept."""
    return retimed(seq, lambda i, t: t * rng.lognormvariate(0, sigma))


def biased(seq: VariableSequence, *, cold_s: float = 0.0, scale: float = 1.0) -> VariableSequence:
    """``seq`` with each measured op time multiplied by ``scale``, and ``cold_s`` more on each
    op that makes a tensor (its first write of a variable)."""
    makers = set(seq.producer.values())
    return retimed(seq, lambda i, t: t * scale + (cold_s if i in makers else 0.0))


def bias_rows(path: Path) -> list[list[str]]:
    """Plans made from systematically biased times (``biased``), simulated on the true ones."""
    seq = managed_view(VariableSequence.from_json(path))
    hw = default_hardware(seq)
    rows = []
    for fraction in FRACTIONS:
        budget = int(seq.in_core_peak_bytes * fraction)
        own = scheduler.plan(seq, budget=budget, hardware=hw)
        ref = step_on(own, seq, hw)
        biases = [(f"+{c} us an op that makes a tensor", {"cold_s": c * 1e-6}) for c in COLD_US]
        biases.append(("every op +10%", {"scale": 1.1}))
        for what, kw in biases:
            plan = scheduler.plan(biased(seq, **kw), budget=budget, hardware=hw)
            got = step_on(plan, seq, hw)
            rows.append([path.stem, f"{fraction:g}", what, f"{ref * 1e3:.1f} ms", f"{got * 1e3:.1f} ms",
                         f"{got / ref - 1:+.1%}",
                         f"{(own.bytes_in + own.bytes_out) / 2**30:.2f} / {own.bytes_recomputed / 2**30:.2f} GiB",
                         f"{(plan.bytes_in + plan.bytes_out) / 2**30:.2f} / {plan.bytes_recomputed / 2**30:.2f} GiB"])
    return rows


def step_on(plan: scheduler.Schedule, true: VariableSequence, hw) -> float:
    """The simulated step of ``plan`` on ``true``'s op times."""
    return scheduler.simulate(dataclasses.replace(plan, sequence=true), hw, timeline=False).total_s


def case_rows(path: Path, draws: int) -> list[list[str]]:
    full = VariableSequence.from_json(path)
    seq = managed_view(full)
    hw = default_hardware(seq)
    rows = []
    for fraction in FRACTIONS:
        budget = int(seq.in_core_peak_bytes * fraction)
        ref = step_on(scheduler.plan(seq, budget=budget, hardware=hw), seq, hw)
        for sigma in SIGMAS:
            rng = random.Random(f"{path.stem}-{fraction}-{sigma}")
            got = [step_on(scheduler.plan(noisy(seq, sigma, rng), budget=budget, hardware=hw), seq, hw)
                   for _ in range(draws)]
            rows.append([path.stem, f"{fraction:g}", f"{sigma:.0%}", f"{ref * 1e3:.1f} ms",
                         f"{statistics.median(got) * 1e3:.1f} ms", f"{min(got) * 1e3:.1f} ms",
                         f"{max(got) * 1e3:.1f} ms", f"{(max(got) - min(got)) / ref:.1%}",
                         f"{statistics.median(got) / ref - 1:+.1%}"])
    return rows


def main() -> int:
    p = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--profiles", type=Path, default=HERE / "profiles" / "h100")
    args = p.parse_args()
    draws = 2 if args.quick else 8
    cases = ("resnet50",) if args.quick else ("resnet50", "gpt2")
    rows = [r for c in cases for r in case_rows(args.profiles / f"{c}.json", draws)]
    lines = common.header("GPU plans made from noisy op times, simulated on the true ones", quick=args.quick) + [
        "", f"{draws} draws per sigma; profiles: {args.profiles.resolve().relative_to(HERE.parent)}. "
        "'on own times': the plan made from the profile's times; the rest: plans made from noisy "
        "times, each simulated on the profile's times.", "",
        *common.md_table(["case", "budget", "sigma", "on own times", "noisy plans, median", "best", "worst",
                          "spread", "median vs own"], rows)]
    bias = [r for c in cases for r in bias_rows(args.profiles / f"{c}.json")]
    lines += ["", "## Biased, not noisy: a cold allocator, a slow host", "",
              "Each plan made from times biased as said (no noise), simulated on the profile's times; "
              "moved (in + out) / recomputed per step of the plan on its own times and of the biased one.", "",
              *common.md_table(["case", "budget", "bias", "on own times", "biased plan", "vs own",
                                "own: moved / recomputed", "biased: moved / recomputed"], bias)]
    common.write_report(common.result_path("plan-noise", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
