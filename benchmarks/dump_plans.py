"""Dump every decision the engine makes about its plans on the zoo, at fixed op times.

Why: moving a decision from the engine to ``scheduler/`` (issue 39) must leave every plan as it
was. The engine's plans depend on measured op times (the recording step's, then the planned
runs' for re-pricing), on the swap file's measured bandwidth and on a timed trial; this script
fixes all three (op k takes ``1e-4 * (1 + 7919 k mod 13)`` s when recorded, half that for every
third op in a planned run; the tier priced at 1 GB/s each way; every trial keeps the anchored
form after one step each), trains the zoo's cases for a few steps, and prints one line per
plan the engine keeps: its case, key number, each action (op index, action, variable name),
its hook-driven form (none, plain, or the anchored plan's actions) and the chunk, as digests.
Run it before and after a change and diff the output; ``--full`` prints the actions too.

    python benchmarks/dump_plans.py > before.txt   # (on the old commit)
    python benchmarks/dump_plans.py > after.txt && diff before.txt after.txt

Works against the engine before and after issue 39's API change (``ooc.Options``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import ooc  # noqa: E402
import ooc.engine.planning as planning  # noqa: E402
from ooc import models  # noqa: E402

NEW = hasattr(ooc, "Options")
STEPS = 7
KiB = 1 << 10
CASES = (   # (label, zoo name, batch, model kwargs, chunk, manage)
    ("CNN", "small_cnn", 4, dict(width=16, blocks=4), 256 * KiB, ("activations",)),
    ("GPT", "gpt2", 2, dict(depth=2, width=64, heads=2, seq_len=128, vocab=512), 256 * KiB, ("activations",)),
    ("MLP-all", "small_cnn", 4, dict(width=16, blocks=2), 64 * KiB,
     ("activations", "params", "grads", "optimizer_state")),
)
FRACTIONS = (2, 4)   # budgets: 1/2 and 1/4 of the in-core managed peak


def _recorded_seconds(n: int) -> list[float]:
    return [1e-4 * (1 + (k * 7919) % 13) for k in range(n)]


def _patch() -> None:
    """Fixed op times, a fixed tier bandwidth, trials that keep the anchored form."""
    real_hw = planning.priced_hardware
    planning.priced_hardware = lambda seq, stats: real_hw(seq, {"bytes_read": 1 << 30, "read_s": 1.0,
                                                                 "bytes_written": 1 << 30, "write_s": 1.0})
    # (the old engine called _reprice after every kept per-op step, before _note_anchored;
    # the new one asks the scheduler once, with the same op times: both patched alike)
    def recorded(st) -> None:
        st.rec.seconds[:] = _recorded_seconds(len(st.rec.seconds))

    def planned(st) -> None:
        st.rec.seconds[:] = [t * (0.5 if k % 3 == 0 else 1.0)
                             for k, t in enumerate(_recorded_seconds(len(st.rec.seconds)))]
    if NEW:   # the engine asks the scheduler once per step, with the step's facts
        from ooc.runtime.stepper import Stepper
        real_facts = planning.Planner._facts

        def facts(self, st, report):
            if isinstance(st, Stepper):
                (planned if report.kept_plan else recorded)(st)
            return real_facts(self, st, report)
        planning.Planner._facts = facts
    else:
        real_replan, real_reprice = planning.Planning._replan, planning.Planning._reprice

        def replan(self, st):
            recorded(st)
            return real_replan(self, st)

        def reprice(self, st):
            if st.planned and st.diverged_at is None:
                planned(st)
            return real_reprice(self, st)
        planning.Planning._replan, planning.Planning._reprice = replan, reprice
    if NEW:
        from ooc.engine.hook_forms import HookPlan as Trial
    else:
        from ooc.engine.anchored_steps import Anchored as Trial

    def judge(self) -> bool:
        if self.kept or self.rejected or min(len(self.trial), len(self.per_op)) < 1:
            return False
        self.kept = True
        return True
    Trial.judge = judge


def _engine(model, opt, budget: int, chunk: int, manage, recompute: bool):
    if NEW:
        return ooc.OutOfCore(model, opt, budget=budget, manage=manage, recompute="auto" if recompute else "never",
                             options=ooc.Options(chunk=chunk))
    return ooc.OutOfCore(model, opt, budget=budget, manage=manage, recompute=recompute, chunk=chunk)


def _actions(schedule) -> list[tuple[int, str, str, str]]:
    names = {v: x.name for v, x in schedule.sequence.variables.items()}
    out = []
    for i, (before, after) in enumerate(zip(schedule.before, schedule.after)):
        out += [(i, "before", a.op.value, names[a.var]) for a in before]
        out += [(i, "after", a.op.value, names[a.var]) for a in after]
    return out


def _digest(x) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:12]


def _forms(engine, key) -> str:
    if NEW:
        entry = engine._plans.hooked.get(key)
        if entry is None:
            return "none"
        if entry.moved is entry.plan:
            return "plain"
        return "anchored:" + ("none" if entry.moved is None else _digest(_actions(entry.moved)))
    if key in engine._plain:
        return "plain"
    entry = engine._anchored.get(key)
    if entry is None:
        return "none"
    return "anchored:" + ("none" if entry.moved is None else _digest(_actions(entry.moved)))


def _run(name: str, batch: int, kwargs: dict, chunk: int, manage, budget: int | None, recompute: bool,
         full: bool, label: str) -> int:
    torch.manual_seed(0)
    model = models.get(name, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = models.example_batch(name, batch, "cpu", **kwargs)
    loss_fn = models.loss_fn(name)
    engine = _engine(model, opt, budget or (1 << 30), chunk, manage, recompute)
    for _ in range(STEPS):
        with engine.step():
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    plans = engine._plans.plans if NEW else engine.plans
    chunk_now = engine._mem.chunk if NEW else engine.chunk
    peak = 0
    for n, (key, (schedule, _)) in enumerate(plans.items()):
        peak = schedule.sequence.in_core_peak_bytes
        acts = _actions(schedule)
        print(f"{label} plan {n}: chunk {chunk_now} functions {len(schedule.sequence.functions)} "
              f"in {schedule.bytes_in} out {schedule.bytes_out} recomputed {schedule.bytes_recomputed} "
              f"actions {_digest(acts)} form {_forms(engine, key)}")
        if full:
            for a in acts:
                print("   ", a)
    engine.close()
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="print every action, not only digests")
    args = p.parse_args()
    _patch()
    torch.set_num_threads(1)
    for label, name, batch, kwargs, chunk, manage in CASES:
        peak = _run(name, batch, kwargs, chunk, manage, None, True, args.full, f"{label} in-core")
        for fraction in FRACTIONS:
            for recompute in (True, False):
                _run(name, batch, kwargs, chunk, manage, peak // fraction, recompute, args.full,
                     f"{label} 1/{fraction} {'auto' if recompute else 'never'}")


if __name__ == "__main__":
    main()
