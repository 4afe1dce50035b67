"""Two source trees side by side: does a change keep ooc's CPU step time?

A refactor that should change nothing (issue 39: the runtime redesigned, behaviour unchanged)
must be checked against the code before it on the same machine at the same time: this
machine's step times move by 10-20% with its load, so numbers from another hour say nothing.
Each round runs, for each model, in-core training once and ooc at 1/4 of the managed peak with
each tree, every case in a fresh process whose ``ooc`` is imported from that tree, in an order
rotated each round; ratios are taken within a round (ooc / in-core of the same round) and the
report gives their medians over rounds, with each tree's parameters checked bitwise against
in-core's.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_compare.py --before /tmp/before [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from bench_cpu import GPT_FULL  # noqa: E402
from ooc.measure import managed_peak, steady_steps  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
MiB = 1 << 20
# (label, model, batch, kwargs): bench_cpu's ResNet-50 and GPT, the two cases.
MODELS = (("ResNet-50", "resnet50", 8, {}), ("GPT", "gpt2", 8, GPT_FULL))
# --quick (the smoke test): a tiny GPT, this tree against itself unless --before is given.
QUICK = (("GPT", "gpt2", 2, dict(depth=2, width=64, heads=2, seq_len=128, vocab=512)),)


@dataclass
class Cell:
    """One (model, method, tree): each round's median step time and ratio to in-core."""

    steps: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    bitwise: bool | None = None


def run(tree: Path, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """``spec`` (a ``ooc.measure.Case``'s fields, the ones both trees know) run by ``tree``'s
    ``ooc.measure`` in a fresh process; the child's result."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-m", "ooc.measure", json.dumps(spec)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OOC-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(f"{tree}: {spec['model']} {spec['method']} failed: {err[-1] if err else proc.returncode}")
    return json.loads(line[len("OOC-RESULT "):])


def step_s(result: dict[str, Any]) -> float:
    times = result["step_s"]
    steps = steady_steps(len(times))
    return median(times[steps.start:steps.stop])


def same(a: str, b: str) -> bool:
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the tree before the change (required unless --quick)")
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, one round of 3 steps (a smoke run)")
    ap.add_argument("--after", type=Path, default=HERE, help="the tree after it (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", default="ResNet-50,GPT", help="comma-separated labels (default: both)")
    ap.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results" / "compare.md")
    args = ap.parse_args()
    if args.before is None and not args.quick:
        ap.error("--before is required (the tree to compare with)")
    if args.quick:
        args.before, args.rounds, args.steps = args.before or HERE, 1, 3
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for k, t in trees.items()}
    lines = common.header("Before and after a change: ooc's CPU step time, side by side", quick=args.quick, notes=[
        f"before: {trees['before']} at {commits['before']}; after: {trees['after']} at {commits['after']}",
        f"command: `python benchmarks/bench_compare.py --before ... --rounds {args.rounds} --steps {args.steps}`;"
        " each case in a fresh process importing its tree's ooc; order rotated each round"])
    models = list(QUICK) if args.quick else [m for m in MODELS if m[0] in args.models.split(",")]
    chunk = 256 << 10 if args.quick else 2 * MiB
    peaks = {label: managed_peak(model, batch, chunk=chunk, model_kwargs=kw) for label, model, batch, kw in models}
    cells: dict[tuple[str, str], Cell] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, model, batch, kw in models:
                peak = peaks[label]
                base = dict(model=model, batch=batch, steps=args.steps, model_kwargs=kw, chunk=chunk,
                            manage=["activations"])
                cases = [("in-core", "after", dict(base, method="incore")),
                         *((f"ooc 1/4 {k}", k, dict(base, method="ooc", budget=peak // 4)) for k in trees)]
                cases = cases[r % 3:] + cases[:r % 3]
                got = {}
                for name, tree, spec in cases:
                    out = f"{tmp}/{label}-{name.replace(' ', '_').replace('/', 'of')}.pt"
                    res = run(trees[tree], dict(spec, params_out=out if r == 0 else None))
                    got[name] = (step_s(res), out)
                    print(f"round {r + 1} {label} {name}: {got[name][0]:.3f} s", flush=True)
                incore = got["in-core"][0]
                for name, (s, out) in got.items():
                    cell = cells.setdefault((label, name), Cell())
                    cell.steps.append(s)
                    cell.ratios.append(s / incore)
                    if r == 0 and name != "in-core":
                        cell.bitwise = same(out, got["in-core"][1])
    rows = []
    for (label, name), c in cells.items():
        rows.append([label, name, f"{median(c.steps):.3f}", f"{median(c.ratios):.2f}x",
                     f"{min(c.ratios):.2f}-{max(c.ratios):.2f}x",
                     "" if c.bitwise is None else ("yes" if c.bitwise else "NO")])
    lines += ["", *common.md_table(["model", "method", "step s (median)", "vs in-core (median)",
                                    "range over rounds", "params bitwise = in-core"], rows), ""]
    for label, *_ in models:
        b, a = cells[(label, "ooc 1/4 before")], cells[(label, "ooc 1/4 after")]
        lines.append(f"- {label}: after / before = {median(a.ratios) / median(b.ratios):.3f} "
                     f"(per round: {', '.join(f'{x / y:.3f}' for x, y in zip(a.ratios, b.ratios))})")
    lines.append(f"- load average after: {common.load_average()}")
    common.write_report(args.out, lines)


if __name__ == "__main__":
    main()
