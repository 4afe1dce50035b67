"""Steps of varying shapes: a GPT trained on sequence lengths in turn (dynamic padding).

    python benchmarks/bench_shapes.py [--quick] [--cycles N] [--warmup N] [--threads N] [--out PATH]

GPT ``gpt2(depth=6, width=256, heads=4, seq_len=256, vocab=8192)`` at batch 8, trained with
AdamW on token batches whose length cycles through 256, 128, 192, 64, 224, 160 (what dynamic
padding gives a loader that groups by length), three ways, each in a fresh process:

- ``in-core``: plain PyTorch;
- ``ooc``: ``OutOfCore`` at a 96 MiB budget (a quarter of the longest shape's managed peak,
  about): plans kept per shape (``engine._plans.max_plans``, 16 by default);
- ``ooc, 1 plan kept``: the same with ``engine._plans.max_plans = 1``: every step whose shape differs
  from the last one's is recorded and re-planned, what every step cost before plans were kept
  per shape (then it also left the last plan at its first differing op).

Per shape: the median step time over the cycles after ``--warmup`` (each shape's plan is
recorded once, then re-priced on two planned runs and its anchored form tried against it,
two steps each, so a shape settles by its seventh step), and the time of its recording step.
Per case: plans made, planned steps, steps run plain or anchored, plans kept at the end and
what they hold (Python objects reachable from the plans and their forms, shared ones counted
once per plan), and whether losses at every step and parameters at the end are bitwise those
of in-core.

``--quick``: a 2-block GPT of width 64 at batch 2, lengths 64 down to 16, 3 cycles.
Writes benchmarks/results/shapes.md (``--quick``: shapes-quick.md).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402

from vmm.units import format_size  # noqa: E402

FULL = {"model": dict(depth=6, width=256, heads=4, seq_len=256, vocab=8192), "batch": 8,
        "lengths": [256, 128, 192, 64, 224, 160], "budget": 96 << 20, "chunk": None}
QUICK = {"model": dict(depth=2, width=64, heads=2, seq_len=64, vocab=512), "batch": 2,
         "lengths": [64, 32, 48, 16, 56, 40], "budget": 256 << 10, "chunk": 16 << 10}
CASES = ("in-core", "ooc", "ooc, 1 plan kept")


# -- the child: one case in a fresh process ------------------------------------------------------


def _deep_bytes(roots: list[Any]) -> int:
    """Bytes of the Python objects reachable from ``roots`` (each object once; classes,
    functions and modules left out: they are code, not the plan's)."""
    import types

    seen, stack, total = set(), list(roots), 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _child(spec: dict[str, Any]) -> None:
    import torch

    import ooc

    setting, case = spec["setting"], spec["case"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = ooc.models.gpt2(**setting["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = None
    if case != "in-core":
        engine = ooc.OutOfCore(model, opt, budget=setting["budget"], options=ooc.Options(chunk=setting["chunk"]))
        if case == "ooc, 1 plan kept":
            engine._plans.max_plans = 1
    lengths, vocab = setting["lengths"], setting["model"]["vocab"]
    rows, before = [], engine.stats() if engine is not None else {}
    for step in range(spec["cycles"] * len(lengths)):
        length = lengths[step % len(lengths)]
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, vocab, (setting["batch"], length + 1), generator=g)
        torch.manual_seed(step)   # dropout
        t0 = time.perf_counter()
        with engine.step() if engine is not None else torch.enable_grad():
            loss = ooc.models.lm_loss(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        row = {"length": length, "s": time.perf_counter() - t0, "loss": loss.item()}
        if engine is not None:
            st = engine.stats()
            form = ("plain" if st["steps.plain"] > before["steps.plain"] else "anchored"
                    if st["steps.anchored"] > before["steps.anchored"] else "per op" if st["last_planned"]
                    else "on demand")
            row.update(planned=st["last_planned"], plans=st["plans"], form=form,
                       fresh=st["cpu_allocator.fresh_bytes"] - before["cpu_allocator.fresh_bytes"])
            before = st
        rows.append(row)
    out: dict[str, Any] = {"rows": rows, "threads": torch.get_num_threads()}
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, spec["params_out"])
    if engine is not None:
        st = engine.stats()
        keys = list(engine._plans.plans)
        forms = [[engine._plans.plans[k], engine._plans.hooked.get(k), engine._plans.repriced.get(k)]
                 for k in keys]
        out.update(plans=st["plans"], plans_kept=st["plans_kept"], plain_steps=st["steps.plain"],
                   anchored_steps=st["steps.anchored"], chunk=engine._mem.chunk,
                   plan_bytes=[_deep_bytes([f]) for f in forms],
                   functions=[engine._plans.plans[k][0].summary()["functions"] for k in keys],
                   moved=st["plan.bytes_in"] + st["plan.bytes_out"])
        engine.close()
    print("SHAPES-RESULT " + json.dumps(out), flush=True)


# -- the parent: cases, table ---------------------------------------------------------------------


def _per_shape(res: dict[str, Any], length: int, warm_steps: int) -> tuple[float, float, list[dict]]:
    """A shape's median step time after the warm-up, its first step's time, its late rows."""
    rows = [r for r in res["rows"] if r["length"] == length]
    late = [r for k, r in enumerate(res["rows"]) if r["length"] == length and k >= warm_steps] or rows
    return median(r["s"] for r in late), rows[0]["s"], late


def report(setting: dict, results: dict[str, dict], identical: dict[str, bool], warm: int,
           cycles: int) -> list[str]:
    lengths = setting["lengths"]
    warm_steps = warm * len(lengths)
    inc = results["in-core"]
    body = []
    for length in lengths:
        base, _, _ = _per_shape(inc, length, warm_steps)
        row = [str(length), f"{base:.3f}"]
        for case in CASES[1:]:
            t, first, late = _per_shape(results[case], length, warm_steps)
            row += [f"{t:.3f}", f"{t / base:.2f}x"]
            if case == "ooc":
                forms = [r["form"] for r in late]
                row += [f"{first:.3f} ({first / t:.1f}x)", max(set(forms), key=forms.count),
                        f"{median(r['fresh'] for r in late) / 2**20:.0f}"]
        body.append(row)
    lines = [f"GPT {setting['model']} at batch {setting['batch']}; budget {format_size(setting['budget'])}; "
             f"{cycles} cycles of {len(lengths)} lengths ({cycles * len(lengths)} steps), medians over "
             f"the {cycles - warm} cycles after the first {warm}.", ""]
    lines += common.md_table(["tokens", "in-core s", "ooc s", "ooc vs in-core", "ooc recording step s "
                              "(x its planned median)", "ooc form after warm-up",
                              "ooc MiB faulted in fresh/step", "ooc, 1 plan kept s", "1 plan kept vs in-core"],
                             body)
    lines += [""]
    summary = []
    for case in CASES[1:]:
        res = results[case]
        rows = res["rows"]
        late = rows[warm_steps:]
        sizes = res["plan_bytes"]
        summary.append([case, str(res["plans"]), f"{sum(r['planned'] for r in rows)} of {len(rows)}",
                        f"{sum(r['planned'] for r in late)} of {len(late)}", str(res["plain_steps"]),
                        str(res["anchored_steps"]), str(res["plans_kept"]),
                        f"{format_size(int(median(sizes)))} ({max(res['functions'])} ops)" if sizes else "-",
                        "yes" if identical[case] else "NO"])
    lines += common.md_table(["case", "plans made", "planned steps", "planned after warm-up", "plain steps",
                              "anchored steps", "plans kept", "Python objects per plan (median; ops, most)",
                              "losses and params bitwise = in-core"], summary)
    return lines


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    for flag, text in (("--cycles", "cycles through the lengths (default 12; quick 3)"),
                       ("--warmup", "cycles left out of the medians (default 8; quick 2)"),
                       ("--threads", "torch threads in every case (default: torch's default)")):
        ap.add_argument(flag, type=int, help=text)
    args = common.parse_or_run_child(ap, _child)
    if args is None:
        return
    setting = QUICK if args.quick else FULL
    cycles = max(2, args.cycles or (3 if args.quick else 12))
    warm = min(cycles - 1, args.warmup if args.warmup is not None else (2 if args.quick else 8))
    log = functools.partial(print, flush=True)
    load0, t0 = common.load_average(), time.perf_counter()
    results, same = common.run_cases(
        Path(__file__).resolve(), CASES,
        lambda case: {"setting": setting, "case": case, "cycles": cycles, "threads": args.threads},
        "SHAPES-RESULT", log)
    identical = {case: same[case] and
                 [r["loss"] for r in results[case]["rows"]] == [r["loss"] for r in results["in-core"]["rows"]]
                 for case in CASES[1:]}
    elapsed = time.perf_counter() - t0
    lines = common.header("Steps of varying shapes: a plan per shape", quick=args.quick, notes=[
        f"command: `python benchmarks/bench_shapes.py{' --quick' if args.quick else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}`; each case in a fresh process, "
        f"{results['in-core']['threads']} torch thread(s)",
        "AdamW; activations managed (the default); dropout seeded per step alike in every case",
        f"load average (1, 5, 15 min) before: {load0}; after: {common.load_average()} on "
        f"{os.cpu_count()} cores (other jobs share them: read ratios, not seconds); wall time "
        f"{elapsed / 60:.1f} min",
    ])
    lines += report(setting, results, identical, warm, cycles)
    lines += ANALYSIS
    common.write_report(common.result_path("shapes", args.quick, out=args.out), lines)


ANALYSIS = [
    "",
    "## Reading the figures",
    "",
    "- A plan is keyed by the step's start (persistent tensors, which parameters have a gradient, "
    "the caller's kind) and its shape: the shapes and dtypes of the tensors the model's forward is "
    "called with. The step begins with the plan of the shape its start's last step had; the model's "
    "forward pre-hook shows its own shape before any op ran, and the step switches to that shape's "
    "plan, in its form (per op, plain or anchored), or runs on demand and is recorded if the shape "
    "has none. So a new shape costs one recording step (the column above), and none of its later "
    "steps diverge.",
    "- `ooc, 1 plan kept` is the behaviour before plans were kept per shape: every step whose shape "
    "differs from the last step's is recorded and planned again.",
    "- After the warm-up, each shape runs its settled plan: re-priced on two planned runs, then per "
    "op or anchored, whichever ran faster in a trial of two steps each (a shape whose plan moves "
    "nothing runs plain).",
    "- 'faulted in fresh': memory the step mapped anew, pages the kernel zeroes. The CPU allocator "
    "keeps freed blocks only up to the live peak of this step or the one before (GUARANTEES.md), so "
    "a long step after a short one (224 tokens after 64 in this order) maps again what the short "
    "step let go; in-core training keeps glibc's heap instead.",
]


if __name__ == "__main__":
    main()
