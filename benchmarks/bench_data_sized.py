"""Activations whose sizes depend on the data: tokens routed to experts by a learned router.

    python benchmarks/bench_data_sized.py [--quick] [--steps N] [--warmup N] [--threads N] [--out PATH]

A mixture of experts (``ooc.models.routed_experts``, larger than the tests'): each token goes
to one expert, so each expert's batch is the tokens routed to it, which changes with the data
and drifts as the router learns; every step runs the same ops. Adam, each case in a fresh
process:

- ``in-core``: plain PyTorch;
- ``checkpoint``: each expert's MLP under ``torch.utils.checkpoint`` (non-reentrant);
- ``ooc``: ``OutOfCore`` at the budget below: plans hold each activation at the largest size
  its op made (``scheduler/widening.py``);
- ``ooc, exact plans``: the same with the widening turned off (``scheduler.step_plans.widened``
  returns the step's own sizes): each plan holds one step's sizes, what every plan did before;
- ``ooc, budget fits``: ``OutOfCore`` at 4 GiB, which the plans fit whole: they move nothing,
  and a step that keeps to one runs plain (no op intercepted, each save checked against its
  variable's room: ``HookTrace.bounded``);
- ``ooc, budget fits, per op``: the same with the hook-driven forms off
  (``Options(hook_steps=False)``): every step through the per-op path, as a plan whose sizes
  vary always ran before.

Per case: the median step time after ``--warmup`` steps, the steps that ran planned (all and
after the warm-up), the peak memory (VmHWM's rise above the footprint once model, optimizer and
data are built, with the total beside it), and whether the parameters at the end are bitwise
those of in-core.

``--quick``: a smaller model, 2,048 tokens, 8 steps. Writes benchmarks/results/data-sized.md
(``--quick``: data-sized-quick.md).
"""

from __future__ import annotations

import argparse
import functools
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

FULL = {"width": 256, "experts": 8, "tokens": 8192, "budget": 48 << 20, "steps": 32, "warmup": 12}
QUICK = {"width": 64, "experts": 4, "tokens": 2048, "budget": 4 << 20, "steps": 8, "warmup": 4}
CASES = ("in-core", "checkpoint", "ooc", "ooc, exact plans", "ooc, budget fits", "ooc, budget fits, per op")
FITS = 4 << 30   # a budget the widened plans fit whole: they move nothing


def _child(spec: dict[str, Any]) -> None:
    import torch
    import torch.nn.functional as F

    import ooc
    from ooc.measure import _reset_peak, _status
    from ooc.runtime.step_protocol import FORMS

    setting, case = spec["setting"], spec["case"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if case == "ooc, exact plans":
        import scheduler.step_plans
        scheduler.step_plans.widened = lambda seq, *a, **k: seq
    torch.manual_seed(0)
    model = ooc.models.routed_experts(setting["width"], setting["experts"], checkpointed=case == "checkpoint")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    budget = FITS if "fits" in case else setting["budget"]
    options = ooc.Options(hook_steps=False) if case.endswith("per op") else None
    engine = ooc.OutOfCore(model, opt, budget=budget, options=options) if case.startswith("ooc") else None
    batches = []
    for step in range(setting["steps"]):
        g = torch.Generator().manual_seed(step)
        batches.append((torch.randn(setting["tokens"], 16, generator=g),
                        torch.randint(0, 10, (setting["tokens"],), generator=g)))
    baseline = _status()["VmRSS"] if _reset_peak() else _status()["VmHWM"]
    rows = []
    for x, y in batches:
        t0 = time.perf_counter()
        with engine.step() if engine is not None else torch.enable_grad():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats() if engine is not None else {}
        rows.append({"s": time.perf_counter() - t0, "planned": bool(stats.get("last_planned")),
                     "plain": stats.get("last_form") == FORMS.index("plain")})
    status = _status()
    out: dict[str, Any] = {"rows": rows, "rise": status["VmHWM"] - baseline, "total": status["VmHWM"],
                           "threads": torch.get_num_threads()}
    if engine is not None:
        with engine.resident():
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, spec["params_out"])
        st = engine.stats()
        out.update(plans=st["plans"], moved=st["bytes_in"] + st["bytes_out"])
        engine.close()
    else:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, spec["params_out"])
    print("DATA-SIZED-RESULT " + json.dumps(out), flush=True)


def report(setting: dict, results: dict[str, dict], identical: dict[str, bool]) -> list[str]:
    warm = setting["warmup"]
    base = median(r["s"] for r in results["in-core"]["rows"][warm:])
    body = []
    for case in CASES:
        res = results[case]
        t = median(r["s"] for r in res["rows"][warm:])
        planned = [r["planned"] for r in res["rows"]]
        plain = [r.get("plain", False) for r in res["rows"]]
        body.append([case, f"{t:.3f}", f"{base / t:.2f}x",
                     "-" if case in ("in-core", "checkpoint") else f"{sum(planned)} of {len(planned)}",
                     "-" if case in ("in-core", "checkpoint") else f"{sum(planned[warm:])} of {len(planned) - warm}",
                     "-" if case in ("in-core", "checkpoint") else str(sum(plain[warm:])),
                     str(res.get("plans", "-")),
                     f"{format_size(res['rise'])} (total {format_size(res['total'])})",
                     "-" if case == "in-core" else ("yes" if identical[case] else "NO")])
    lines = [f"{setting['experts']} experts of width {setting['width']}, {setting['tokens']} tokens a step, "
             f"Adam, {setting['steps']} steps; ooc at {format_size(setting['budget'])} (the last two at "
             f"{format_size(FITS)}); medians over the "
             f"steps after the first {warm}.", ""]
    lines += common.md_table(["case", "step s (median)", "speed vs in-core", "planned steps",
                              "planned after warm-up", "of them plain", "plans made", "peak rise (VmHWM)",
                              "params bitwise = in-core"],
                             body)
    return lines


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    for flag, text in (("--steps", "training steps per case (default 32; quick 8)"),
                       ("--warmup", "steps left out of the medians (default 12; quick 4)"),
                       ("--threads", "torch threads in every case (default: torch's default)")):
        ap.add_argument(flag, type=int, help=text)
    args = common.parse_or_run_child(ap, _child)
    if args is None:
        return
    setting = dict(QUICK if args.quick else FULL)
    setting["steps"] = max(2, args.steps or setting["steps"])
    setting["warmup"] = min(setting["steps"] - 1, args.warmup if args.warmup is not None else setting["warmup"])
    log = functools.partial(print, flush=True)
    load0, t0 = common.load_average(), time.perf_counter()
    results, identical = common.run_cases(
        Path(__file__).resolve(), CASES, lambda case: {"setting": setting, "case": case, "threads": args.threads},
        "DATA-SIZED-RESULT", log)
    elapsed = time.perf_counter() - t0
    lines = common.header("Activations whose sizes depend on the data: routed experts", quick=args.quick, notes=[
        f"command: `python benchmarks/bench_data_sized.py{' --quick' if args.quick else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}`; each case in a fresh process, "
        f"{results['in-core']['threads']} torch thread(s)",
        "memory: VmHWM of a fresh process per case, rise above the footprint after model, optimizer "
        "and data are built (total beside it)",
        f"load average (1, 5, 15 min) before: {load0}; after: {common.load_average()} on "
        f"{os.cpu_count()} cores (other jobs share them: read ratios, not seconds); wall time "
        f"{elapsed / 60:.1f} min",
    ])
    lines += report(setting, results, identical)
    common.write_report(common.result_path("data-sized", args.quick, out=args.out), lines)


if __name__ == "__main__":
    main()
