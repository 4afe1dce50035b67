"""Where recomputing pays: one recorded step, planned for slower and faster swap devices.

    python benchmarks/bench_pricing.py [--quick] [--rounds N] [--out PATH]

The default planner swaps or recomputes each tensor the budget forces out, whichever
``scheduler.simulate`` prices lower on the hardware it is given (``scheduler.recompute``). A
CPU engine prices transfers at what its own swap file measured (``ooc.engine.host_pricing``),
so the same step gets a different plan on a different machine: on a fast swap file swapping
is the cheaper lever, on slow flash recomputing is. This benchmark shows where the balance
turns, for one step recorded on this machine.

It trains ResNet-50, batch 8, at 1/4 of its managed peak for 5 steps (the recording step, then
planned steps; the engine re-prices its plan on the fastest op times of the first two), and
takes the step the engine planned last: its functions at their measured seconds. That step is
then planned, and its time predicted, on

- this machine's swap file, as the engine priced it (the plan the engine ran), and
- the ``cpu-edge`` preset (the edge board ooc is for) with its flash read and written at
  0.25-4 GB/s, every other figure the preset's (0.1 ns of compute per moved byte).

For each: bytes moved per step (in + out) and recomputed by the default plan, and its
predicted step beside the swap-only plan's. Those are predictions of the simulator.

Then it measures two of those points: the engine trains again (in-core, default, swap only;
12 steps each, the median of the last 4; 3 rounds) with its swap file slowed to a flash rate.
The emulation does the real copy, then holds each transfer until a device of that bandwidth,
serving one transfer at a time in both directions, would have finished it; the copies' CPU
work is real, the device's waiting is a sleep. The engine prices that file as it would a real
one, from what its transfers took. Bytes moved and recomputed are what the engine counted in
the steady steps, beside the plan's own: a settled plan may run anchored (at autograd's
saved-tensor hooks), swapping what the per-op plan recomputes, where the engine measures that
form faster. Parameters after the last step are compared bit for bit.

``--quick``: small_cnn, batch 16, 4 steps, one measured point (the smoke test). Writes
benchmarks/results/pricing.md and pricing.png (``--quick``: pricing-quick.*).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from typing import Any, Iterator

import torch

import common
import ooc.storage.swap_transfer as swap_transfer
from ooc.engine.host_pricing import priced_hardware
from ooc.measure import COUNTED, Case, StepCounts, build, engine_for, managed_peak, train_step
from scheduler import plan, simulate
from scheduler.hardware import Hardware, hardware
from scheduler.recompute import default_hardware

MiB = 1 << 20
GB = 1e9
FLASH_GBPS = (0.25, 0.35, 0.45, 0.6, 0.8, 1.0, 1.4, 2.0, 3.0, 4.0)
QUICK_GBPS = (0.45, 1.0, 4.0)
MEASURED_GBPS = (0.45, 1.0)
MEASURED_STEPS = 12
SETTLED_STEPS = 4   # the last steps, after the trial of the anchored form (steps 4-7)
# What the engine counts (``ooc.measure.COUNTED``), read after each step: what a step really
# moved and recomputed. A settled plan may run anchored, at autograd's saved-tensor hooks,
# where what the per-op plan recomputes is swapped instead; the engine keeps that form where
# it is faster, so the plan's own figures can differ from what the settled steps did.


@contextlib.contextmanager
def flash(bandwidth: float) -> Iterator[None]:
    """Every swap-file transfer of the engines made inside takes at least what a device of
    ``bandwidth`` B/s would (see the module docstring): the real copy, then a sleep until the
    device, serving transfers one at a time in both directions, would be done with it."""
    real = swap_transfer.transfer_key
    lock = threading.Lock()
    free_at = [0.0]

    def slowed(file, op, key, rec, view, *rest):
        t0 = time.perf_counter()
        real(file, op, key, rec, view, *rest)
        with lock:
            free_at[0] = max(t0, free_at[0]) + len(view) / bandwidth
            done = free_at[0]
        time.sleep(max(0.0, done - time.perf_counter()))

    swap_transfer.transfer_key = slowed
    try:
        yield
    finally:
        swap_transfer.transfer_key = real


def measured(case: Case) -> dict[str, Any]:
    """Train ``case`` in this process: the median steady step, the plan the engine ran last
    (for the state a step starts in once the optimizer has its state) with the sequence it
    last priced it on and its swap file's counters, and the parameters after the last step."""
    net, opt, x, y, loss_fn = build(case)
    engine = engine_for(case, net, opt)
    times = []
    counts = StepCounts()
    ran: dict[str, Any] = {"schedule": None}
    try:
        for step in range(case.steps):
            torch.manual_seed(case.seed + 1 + step)
            t0 = time.perf_counter()
            train_step(net, opt, engine, loss_fn, x, y)
            times.append(time.perf_counter() - t0)
            if engine is not None:
                counts.record(engine)
            print(f"step {step + 1}/{case.steps}: {times[-1]:.3f} s", flush=True)
        if engine is not None:
            key, (schedule, _) = list(engine._plans.plans.items())[-1]
            ran = {"schedule": schedule, "seq": engine._plans.repriced.get(key, (0, schedule.sequence))[1],
                   "tier": engine._mem.tier.stats()}
    finally:
        if engine is not None:
            engine.close()
    # The settled steps: after the recording steps, the two re-priced runs and the trial in
    # which the engine times the anchored and the per-op form in turn (see above COUNTED).
    steady = range(max(0, len(times) - SETTLED_STEPS), len(times))
    per_step = counts.steps[steady.start:steady.stop] or [dict.fromkeys(COUNTED, 0)]
    schedule = ran["schedule"]
    return {**ran, "step_s": statistics.median(times[steady.start:steady.stop]),
            "planned_moved": schedule.bytes_in + schedule.bytes_out if schedule else 0,
            "planned_recomputed": schedule.bytes_recomputed if schedule else 0,
            "moved": statistics.median(c["bytes_in"] + c["bytes_out"] for c in per_step),
            "recomputed": statistics.median(c["bytes_recomputed"] for c in per_step),
            "anchored": sum(c["steps.anchored"] for c in per_step), "steady": len(per_step),
            "params": [p.detach().clone() for p in net.parameters()]}


def recorded_step(model: str, batch: int, fraction: int, steps: int) -> tuple[Any, int, Hardware, dict]:
    """Train ``steps`` steps at 1/``fraction`` of the managed peak; the planned step's sequence
    (as the engine last priced it), the budget, the hardware the engine priced it on, and the
    plan it ran (bytes)."""
    budget = managed_peak(model, batch) // fraction
    r = measured(Case(model, batch, "ooc", budget=budget, steps=steps))
    return r["seq"], budget, priced_hardware(r["seq"], r["tier"]), r


def planned(seq: Any, budget: int, hw: Hardware) -> dict[str, float]:
    """The default plan and the swap-only plan on ``hw``: bytes and predicted step."""
    out: dict[str, float] = {}
    for mode in ("auto", "never"):
        s = plan(seq, budget=budget, hardware=hw, recompute=mode)
        out[f"{mode}_moved"] = s.bytes_in + s.bytes_out
        out[f"{mode}_recomputed"] = s.bytes_recomputed
        out[f"{mode}_s"] = simulate(s, hw, timeline=False).total_s
    return out


def row(label: str, hw: Hardware, r: dict[str, float]) -> list[str]:
    fewer = 1 - r["auto_moved"] / r["never_moved"] if r["never_moved"] else 0.0
    return [label, f"{hw.h2d_bandwidth / GB:.2f} / {hw.d2h_bandwidth / GB:.2f}",
            f"{r['auto_moved'] / MiB:,.0f} MiB", f"{r['auto_recomputed'] / MiB:,.0f} MiB",
            f"{r['auto_s']:.3f} s", f"{r['never_moved'] / MiB:,.0f} MiB", f"{r['never_s']:.3f} s",
            f"{fewer:.0%}", f"{r['never_s'] / r['auto_s']:.2f}x"]


def plot(sweep: list[tuple[float, dict[str, float]]], points: list[tuple[float, str, float]],
         here: Hardware, title: str, path) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [g for g, _ in sweep]
    left.plot(xs, [r["auto_moved"] / MiB for _, r in sweep], "o-", label="moved (default plan)")
    left.plot(xs, [r["auto_recomputed"] / MiB for _, r in sweep], "s-", label="recomputed (default plan)")
    left.plot(xs, [r["never_moved"] / MiB for _, r in sweep], "k--", label="moved (swap only)")
    left.set_ylabel("MiB per step")
    right.plot(xs, [r["auto_s"] for _, r in sweep], "o-", label="default (swap or recompute)")
    right.plot(xs, [r["never_s"] for _, r in sweep], "k--", label="swap only")
    for label, style in (("default", "C0X"), ("swap only", "kP")):
        mine = [(g, t) for g, case, t in points if case == label]
        right.plot([g for g, _ in mine], [t for _, t in mine], style, ms=9, ls="none",
                   label=f"{label}, measured (swap file slowed to that rate)")
    right.set_ylabel("step (s): predicted, and measured where marked")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{g:g}" for g in xs], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("flash bandwidth, each way (GB/s; cpu-edge preset)")
        ax.axvline(here.h2d_bandwidth / GB, color="gray", lw=1, ls=":")
        ax.annotate(f"this machine's swap file\n({here.h2d_bandwidth / GB:.2f} GB/s read)",
                    (here.h2d_bandwidth / GB, 0.5), xycoords=("data", "axes fraction"),
                    textcoords="offset points", xytext=(4, 0), ha="left", fontsize=7, color="gray")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    common.save_plot(fig, path)


def measured_rows(model: str, batch: int, budget: int, quick: bool,
                  rounds: int) -> tuple[list[list[str]], list[tuple[float, str, float]]]:
    """Rounds of: in-core, then the default plan and swap only at each emulated flash rate.
    Each case's step is the median over rounds of its median steady step. Returns the table's
    rows and the (GB/s, case, step) points for the plot."""
    steps = 4 if quick else MEASURED_STEPS
    cases = [("-", "in-core", Case(model, batch, "incore", steps=steps))]
    for gbps in MEASURED_GBPS[:1] if quick else MEASURED_GBPS:
        for label, recompute in (("default", True), ("swap only", False)):
            cases.append((f"{gbps:g}", label, Case(model, batch, "ooc", steps=steps, budget=budget,
                                                   recompute=recompute)))
    results: dict[int, list[dict[str, Any]]] = {k: [] for k in range(len(cases))}
    reference: list[torch.Tensor] = []
    for rnd in range(rounds):
        for k, (gbps, label, case) in enumerate(cases):
            with flash(float(gbps) * GB) if gbps != "-" else contextlib.nullcontext():
                r = measured(case)
            reference = reference if k or rnd else r["params"]   # in-core's, first round
            r["same"] = all(torch.equal(a, b) for a, b in zip(r.pop("params"), reference))
            results[k].append(r)
            print(f"round {rnd + 1}/{rounds}: {label} at {gbps} GB/s: {results[k][-1]['step_s']:.3f} s", flush=True)
    incore = statistics.median(r["step_s"] for r in results[0])
    rows, points = [], []
    for k, (gbps, label, _) in enumerate(cases):
        runs = results[k]
        step = statistics.median(r["step_s"] for r in runs)
        if k:
            points.append((float(gbps), label, step))
        same = all(r["same"] for r in runs)
        mib = lambda key: f"{statistics.median(r[key] for r in runs) / MiB:,.0f} MiB"  # noqa: E731
        rows.append([gbps, label, f"{step:.3f} s", f"{step / incore:.2f}x",
                     " / ".join(f"{r['step_s']:.2f}" for r in runs)]
                    + (["-"] * 5 if k == 0 else [
                        mib("moved"), mib("recomputed"),
                        f"{sum(r['anchored'] for r in runs)} of {sum(r['steady'] for r in runs)}",
                        f"{mib('planned_moved')} + {mib('planned_recomputed')}",
                        "yes" if same else "**no**"]))
    return rows, points


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--rounds", type=int, help="rounds of the measured cases (default 3; quick 1)")
    args = ap.parse_args()
    model, batch, steps = ("small_cnn", 16, 4) if args.quick else ("resnet50", 8, 5)
    label = {"small_cnn": "small_cnn", "resnet50": "ResNet-50"}[model]
    t0 = time.perf_counter()
    seq, budget, here, ran = recorded_step(model, batch, 4, steps)
    rows = [row("this machine (as the engine priced it)", here, planned(seq, budget, here))]
    sweep = []
    for gbps in QUICK_GBPS if args.quick else FLASH_GBPS:
        hw = hardware(default_hardware(seq), storage_bandwidth=gbps * GB)
        r = planned(seq, budget, hw)
        sweep.append((gbps, r))
        rows.append(row(f"cpu-edge, flash {gbps:g} GB/s", hw, r))
        print(f"planned for {gbps:g} GB/s", flush=True)
    name = f"{label} batch {batch} at 1/4 of its managed peak ({budget / MiB:,.0f} MiB)"
    lines = common.header("Where recomputing pays: one recorded step, planned for other swap devices",
                          quick=args.quick, notes=[
        f"command: `python benchmarks/bench_pricing.py{' --quick' if args.quick else ''}`; {name}, "
        f"{len(seq.functions)} functions at the seconds this machine measured; {time.perf_counter() - t0:.0f} s.",
        f"The plan the engine ran here moved {ran['moved'] / MiB:,.0f} MiB and recomputed "
        f"{ran['recomputed'] / MiB:,.0f} MiB per step; the first row plans the same step again on the "
        "same prices. Every other figure is a prediction of `scheduler.simulate`.",
        "Swap device: read / write GB/s (for this machine, one I/O thread's rate as its swap file "
        "measured it). 'fewer bytes': moved by the default plan against the swap-only plan. "
        "'swap only / default': the predicted step of the swap-only plan over the default's."])
    lines += common.md_table(["hardware", "swap device (GB/s)", "default: moved", "recomputed", "predicted step",
                              "swap only: moved", "predicted step", "fewer bytes", "swap only / default"], rows)
    rounds = max(1, args.rounds or (1 if args.quick else 3))
    lines += ["", "## Measured on this machine, its swap file slowed to flash rates", "",
              f"{4 if args.quick else MEASURED_STEPS} steps per case, {rounds} round(s) of the cases in "
              f"this order; a case's step is the median over rounds of the median of its last "
              f"{SETTLED_STEPS} steps (settled: after recording, re-pricing and the trial of the anchored "
              "form), each round's beside it. 'vs in-core': over in-core's step. "
              "Moved and recomputed per step: what the engine counted, the median over those steps "
              "(then over rounds). Anchored steps: those of them that ran the plan at autograd's saved-tensor "
              "hooks, where what the per-op plan recomputes is swapped instead (the engine times both forms "
              "in turn and keeps the faster). Its plan: the per-op plan's bytes.", ""]
    rows, points = measured_rows(model, batch, budget, args.quick, rounds)
    lines += common.md_table(["flash (GB/s)", "case", "step", "vs in-core", "rounds (s)", "moved per step",
                              "recomputed per step", "anchored steps", "its plan: moved + recomputed",
                              "bitwise = in-core"], rows)
    png = common.result_path("pricing", args.quick, ".png", out=args.out)
    plot(sweep, points, here, f"{name}: the default plan as the swap device slows", png)
    lines += ["", f"![bytes and predicted step against flash bandwidth]({png.name})"]
    common.write_report(common.result_path("pricing", args.quick, out=args.out), lines)


if __name__ == "__main__":
    main()
