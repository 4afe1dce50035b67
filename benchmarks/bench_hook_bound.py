"""How fast could a hook-driven step that recomputes run on the H100's host? A bound, from the profiles.

    python benchmarks/bench_hook_bound.py [--quick] [--out PATH]

The Llama (5,872 ops a step, 113 ms in core on the H100) is host-bound under ooc's per-op
path: every op through a dispatch mode costs the host tens of microseconds. A hook-driven form
that recomputes runs the step as an anchored step does, watched by autograd's saved-tensor hooks
alone, and reruns the plan's chains at the hooks. This script bounds what such forms can reach
on the H100's host (it was written before the template form was built, to choose which to
build; the template form's replay cost is now its runtime's own, measured on this CPU).

For each H100 profile (``benchmarks/profiles/h100``) at 1/2 and 1/4 of its managed peak, four
forms of the plan the engine would make (``scheduler.plan`` on the profile's prices):

- ``per op`` (today's, for a plan that recomputes): every op through the dispatch mode, an op
  its plan gives no role (``quiet_functions``) at the engine's quiet cost, every other one and
  each op a replay reruns at its looked-at cost;
- ``anchored, swap only`` (today's hook-driven form): the swap-only plan at the same budget,
  no op intercepted, the hooks' cost per saved tensor;
- ``hook-driven, mode in scopes`` (not built): the hooks, plus the mode over the forward ops
  inside a chain's *scope* (the module the op ran in, from the profile's function names: where
  the chains' recipes would be captured; quiet cost, the chain ops looked at) and the replays
  (looked at);
- ``hook-driven, templates`` (built: ``ooc/runtime/templates.py``): the hooks alone in the
  forward; each chain rerun from a template that a per-op step captured once (each argument a
  parameter, a saved tensor the hooks see, or a result of the chain: ``templatable`` checks it
  on the profile), each replayed op at in core's cost plus the runtime's replay cost
  (``template_us``). Its device lane is the
  plan's anchored form with its chains (``anchor_within_budget(recompute=True)`` at the hooks
  ``estimated_anchors`` places on the profile), proven within the budget.

Each form's bound is in core's step over the slower of its two lanes: the device's (its
predicted step with no host lane, ``scheduler.simulate``: op times, link) and the host's (every
op at in core's host time per op ``h0`` plus what the form adds, from the H100's host costs
measured in two runs: ``MEASURED``), at ``h0`` = the H100's in-core host time per op measured
for ResNet-50 (``H0_US``), or in core's step over its ops where that is less (in core exactly
host-bound: the Llama); and the largest ``h0`` at which the bound still reaches the issue's
0.85x at 1/2 (0.75x at 1/4).

The hooks cost per saved tensor, not per op (one pack and one unpack call each): the H100
measured a plain step's cost per op on ResNet-50 b32 (``MEASURED``'s third figure, over its
709 ops), which is priced here per saved tensor of ResNet-50 and charged to each case for the
tensors its step saves, counted on this CPU by running the case's model (same layers,
narrower and shorter: the count does not depend on width or length) under counting hooks
(``saved_per_step``). The Llama saves 773 tensors in 5,872 ops, ResNet-50 481 in 846.

A bound, not a prediction: the lanes overlap perfectly here, and nothing else slows the step.
Where even the bound misses the target, no such form reaches it; the measured forms (the
report's last lines) check the bound from above, and the next GPU run's in-core ``queued_ms``
(bench_gpu) gives the Llama's ``h0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import scheduler  # noqa: E402
from scheduler.anchoring import anchor_within_budget  # noqa: E402
from scheduler.anchors import estimated_anchors  # noqa: E402
from scheduler.errors import BudgetTooSmall  # noqa: E402
from scheduler.ir import Kind, VariableSequence  # noqa: E402
from scheduler.managed import managed_view  # noqa: E402
from scheduler.recompute import default_hardware  # noqa: E402
from scheduler.replay import chain_inputs  # noqa: E402
from scheduler.schedule import Op, quiet_functions  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles" / "h100"
TARGETS = {0.5: 0.85, 0.25: 0.75}
# The H100's host, per op, from bench_gpu's "Host cost per op" (ResNet-50 b32, 709 ops a step,
# in core 29.5 and 31.2 us an op): what the engine's per-op path adds to a quiet op and to an op
# it looks at, and what a plain step (the hooks alone) adds per op, in the fifth session's run
# (gpu.md: 75.8 / 89.2 us an op, +4.7) and the seventh's (gpu-one-arena.md: 46.9 / 125.3, +4.2).
MEASURED = {"gpu.md": (75.8 - 29.5, 89.2 - 29.5, 4.7), "gpu-one-arena.md": (46.9 - 31.2, 125.3 - 31.2, 4.2)}
HOST_COST_OPS = 709   # ResNet-50 b32's ops a step in those runs
H0_US = (29.5 + 31.2) / 2   # in core's host time per op on the H100, measured (ResNet-50 b32, two runs)
CHUNK = 2 << 20   # the engine's chunk on a GPU, as ``managed_view`` rounds
# Each case's model as bench_gpu builds it, made small enough to run here: the saved tensors a
# step packs depend on its layers, not on their width, the batch or the sequence length.
SMALL = {"resnet50": dict(batch=2, image_size=64), "gpt2": dict(batch=1, model_kw=dict(seq_len=64)),
         "llama": dict(batch=1, model_kw=dict(layers=20, width=128, seq_len=64, vocab=512))}


def saved_per_step(case: str) -> int:
    """The tensors one training step of ``case`` (bench_gpu's model, ``SMALL``'s sizes) hands
    autograd's saved-tensor hooks, on this CPU: the calls a hook-driven step pays for."""
    import dataclasses

    import torch

    import gpu_cases

    gpu_cases.DEVICE = "cpu"
    full = next(c for c in gpu_cases.FULL if c.name == case)
    small = dict(SMALL[case])
    small["model_kw"] = {**full.model_kw, **small.get("model_kw", {})}
    c = dataclasses.replace(full, **small)
    model, x, y, loss_fn = c.build()
    packs = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packs
        packs += 1
        return t

    with c.attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with c.autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
    return packs


def template_us(rounds: int = 7, calls: int = 500) -> float:
    """What rerunning an op from a template adds to calling it in eager code, on this CPU (us):
    the runtime's own replay (``ooc.runtime.bound_templates.BoundTemplates.replay``: each argument
    rebuilt from its slot, the chain below autograd with autocast off) of an RMSNorm-and-MLP
    chain against the same aten calls made eagerly, tiny tensors so that only the host's cost
    is timed; the median of ``rounds``."""
    import statistics
    import time
    from types import SimpleNamespace

    import torch

    from ooc.runtime.bound_templates import BoundTemplates
    from ooc.runtime.recipes import Made
    from ooc.runtime.templates import PackArg, Template, Templates
    from ooc.runtime.views import View

    aten = torch.ops.aten
    a, b, w = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)

    def saved(k: int, t: torch.Tensor) -> PackArg:
        return PackArg.of(k, t, t.untyped_storage(), 0, t)

    def made(op: int, like: torch.Tensor) -> Made:
        return Made(op, 0, View(like.dtype, like.size(), like.stride(), 0))

    by_op = {0: Template.make(aten.mul.Tensor, (saved(0, a), saved(1, b)), {}),
             1: Template.make(aten._to_copy.default, (made(0, a),), {"dtype": torch.bfloat16}),
             2: Template.make(aten.mm.default, (saved(0, a), saved(2, w)), {}),
             3: Template.make(aten.silu.default, (made(2, a),), {})}
    bound = BoundTemplates(Templates(by_op, {0: (3, 0)}, {}, {}, ()))
    bound.packs = {k: (t, t._version) for k, t in enumerate((a, b, w))}
    slot = SimpleNamespace(var=0, nbytes=a.untyped_storage().nbytes(), name="silu")
    chain = (0, 1, 2, 3)

    def eager() -> None:
        torch.mul(a, b).to(torch.bfloat16)
        torch.nn.functional.silu(torch.mm(a, w))

    def replay() -> None:
        bound.replay(slot, chain, {}, lambda s: None)

    def per_op(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls / len(chain) * 1e6

    return statistics.median(per_op(replay) - per_op(eager) for _ in range(rounds))


def scope(name: str) -> str:
    """The module an op ran in: its function name's prefix (``"layers.3.mlp:aten.mul.Tensor"``)."""
    return name.rsplit(":", 1)[0] if ":" in name else ""


def templatable(raw: VariableSequence, chain: tuple[int, ...]) -> bool:
    """Whether a chain could rerun from a template: every variable it reads and does not make
    is one the hooks see (an activation autograd saved), a parameter or the step's input."""
    variables = raw.variables
    return all(variables[x].live_in or variables[x].kind in (Kind.ACTIVATION, Kind.PARAM, Kind.INPUT)
               for x in chain_inputs(raw, chain))


def lanes(schedule: scheduler.Schedule, form: str, raw: VariableSequence, saved: int) -> dict[str, int]:
    """What ``form``'s host lane is made of: the step's ops, the saved tensors its hooks see,
    the ops the engine's mode sees at its quiet cost and at its looked-at cost, and the ops the
    replays rerun, through the mode or from templates."""
    seq = schedule.sequence
    functions = seq.functions
    chains = [a.chain for actions in schedule.before for a in actions if a.op is Op.RECOMPUTE]
    replayed = sum(len(c) for c in chains)
    counts = {"ops": len(functions), "saved": saved, "quiet": 0, "looked": 0, "replayed": replayed, "templated": 0}
    if form == "per op":
        quiet = len(quiet_functions(schedule))
        return {**counts, "saved": 0, "quiet": quiet, "looked": len(functions) - quiet}
    if form == "anchored, swap only":
        return counts
    if form == "hook-driven, templates":
        kept = [templatable(raw, c) for c in chains]
        counts["templated"] = sum(len(c) for c, k in zip(chains, kept) if k)
        chains = [c for c, k in zip(chains, kept) if not k]   # these keep the mode in their scopes
        counts["replayed"] -= counts["templated"]
    chained = {w for chain in chains for w in chain}
    end = int(seq.meta.get("loss_start", len(functions)))
    scopes = {scope(functions[w].name) for w in chained}
    in_scope = sum(1 for f in functions[:end] if scope(f.name) in scopes)
    return {**counts, "quiet": in_scope - len(chained), "looked": len(chained)}


def host_s(counts: dict[str, int], h0_us: float, cost: tuple[float, float, float], per_saved_us: float,
           tmpl_us: float) -> float:
    """The host's lane of a form, in seconds (the module docstring's sum)."""
    quiet_us, looked_us, _ = cost
    us = (counts["ops"] * h0_us + counts["saved"] * per_saved_us + counts["quiet"] * quiet_us
          + counts["looked"] * looked_us + counts["replayed"] * (h0_us + looked_us)
          + counts["templated"] * (h0_us + tmpl_us))
    return us * 1e-6


def largest_h0(counts: dict[str, int], in_core_s: float, device_s: float, target: float,
               cost: tuple[float, float, float], per_saved_us: float, tmpl_us: float) -> float | None:
    """The largest in-core host time per op (us) at which the bound reaches ``target``; None if
    the form's other costs alone miss it."""
    room = in_core_s / target
    fixed = host_s(counts, 0.0, cost, per_saved_us, tmpl_us)
    if device_s > room or fixed > room:
        return None
    return (room - fixed) / (counts["ops"] + counts["replayed"] + counts["templated"]) * 1e6


FORMS = ("per op", "anchored, swap only", "hook-driven, mode in scopes", "hook-driven, templates")
# What the GPUs measured of these forms, to check the bounds from above.
MEASURED_FORMS = ["measured on the H100 (gpu.md, fcbc185), each at or under its bound: ResNet-50 per op 0.85x "
                  "at 1/2 and 0.75x at 1/4, GPT-2 per op 0.90x and 0.86x, the Llama anchored, swap only "
                  "0.53x and 0.35x; the Llama per op 0.19x at both on the H200 (gpu-h200.md, another host)"]


def main() -> int:
    p = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = p.parse_args()
    rows, notes = [], []
    host_bound: dict[str, float] = {}   # profile -> in core's step over its ops, where under H0_US
    paths = sorted(PROFILES.glob("*.json"))
    paths = paths[:1] if args.quick else paths
    saved = {path.stem: saved_per_step(path.stem) for path in paths}
    resnet_saved = saved["resnet50"] if "resnet50" in saved else saved_per_step("resnet50")
    # the hooks' cost per saved tensor, from each run's plain-step cost per op of ResNet-50 b32
    per_saved = [plain * HOST_COST_OPS / resnet_saved for _, _, plain in MEASURED.values()]
    tmpl_us = max(0.0, template_us(rounds=3, calls=200) if args.quick else template_us())
    for path in paths:
        raw = VariableSequence.from_json(path)
        seq = managed_view(raw)
        hw = default_hardware(seq)
        anchors = estimated_anchors(seq)
        in_core_s = sum(f.cost.seconds or 0.0 for f in seq.functions)
        h0_worst = in_core_s / len(seq.functions) * 1e6
        if h0_worst < H0_US:
            host_bound[path.stem] = h0_worst
        notes.append(f"`{path.name}`: {len(seq.functions):,} ops, {saved[path.stem]:,} saved tensors a step, "
                     f"in core {in_core_s * 1e3:.1f} ms of ops (in core host-bound at {h0_worst:.1f} us an op)")
        for fraction, target in TARGETS.items():
            budget = int(seq.in_core_peak_bytes * fraction)
            for form in FORMS:
                try:
                    schedule = scheduler.plan(seq, budget=budget, hardware=hw,
                                              recompute="never" if form.endswith("swap only") else "auto")
                except BudgetTooSmall:
                    rows.append([path.stem, f"{fraction:g}", form, "does not plan", *[""] * 4])
                    continue
                if form == "hook-driven, templates":   # its actions at the hooks, within the budget
                    schedule = anchor_within_budget(schedule, *anchors, budget=budget, chunk=CHUNK, window=None,
                                                    policy="window", hardware=hw, recompute=True)
                    if schedule is None:
                        rows.append([path.stem, f"{fraction:g}", form, "no anchored form", *[""] * 4])
                        continue
                device_s = scheduler.simulate(schedule, hw, timeline=False).total_s
                counts = lanes(schedule, form, raw, saved[path.stem])
                h0 = min(h0_worst, H0_US)
                runs = list(zip(MEASURED.values(), per_saved))
                bounds = [in_core_s / max(device_s, host_s(counts, h0, cost, ps, tmpl_us)) for cost, ps in runs]
                h0s = [largest_h0(counts, in_core_s, device_s, target, cost, ps, tmpl_us) for cost, ps in runs]
                mode = f"{counts['quiet'] + counts['looked']:,} + {counts['replayed']:,}"
                rows.append([path.stem, f"{fraction:g}", form, f"{in_core_s / device_s:.2f}x",
                             mode + (f" (+ {counts['templated']:,} from templates)" if counts["templated"] else ""),
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
              "allows, in core exactly host-bound (its step over its ops"
              + "".join(f"; {k}: {v:.1f} us" for k, v in host_bound.items()) + "). The "
              "Llama's own was never measured (bench_gpu's `queued_ms` of its in-core row tells it). "
              "Host costs added per op: quiet / looked at "
              + "; ".join(f"{k}: +{q:.1f} / +{lk:.1f} us" for k, (q, lk, _) in MEASURED.items())
              + "; the hooks per saved tensor " + " / ".join(f"{ps:.1f} us" for ps in per_saved)
              + f" (a plain step's +{' / +'.join(f'{pl}' for _, _, pl in MEASURED.values())} us per op of "
              f"ResNet-50 b32's {HOST_COST_OPS} over its {resnet_saved} saved tensors); a replayed op "
              f"from a template +{tmpl_us:.1f} us (the runtime's replay over eager calls, on this CPU).",
              "", *[f"- {m}" for m in MEASURED_FORMS]]
    common.write_report(common.result_path("hook-bound", args.quick, out=args.out), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
