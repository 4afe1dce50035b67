"""A diagnostic run of the template form on a GPU: why a hook-driven step's signature check
failed (each mismatch printed in full: the tensor now and at the capture, both signatures),
and where an anchored step's host time goes (cProfile of each ooc row's last timed step).

    python benchmarks/gpu_probe.py [--quick] [--cases llama,resnet50] [--fractions 0.5,0.25]
                                   [--relaxed 0.5] [--profiles DIR]

Prints only; the figures that count are bench_gpu.py's. ``--quick``: the quick cases (the dry
run, tests/test_bench_gpu_dry.py, runs it over the fake driver).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # as bench_gpu.py: bitwise needs it
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _watch_signatures() -> tuple[list[bool], Any]:
    """Patch the capture and the check to print every signature mismatch in full; returns a
    switch (``[True]`` lets a step go on past a mismatch: is it a false alarm? bitwise tells)
    and what undoes the patch."""
    from ooc.runtime import templates as T
    from ooc.runtime.bound_templates import BoundTemplates
    from ooc.runtime.made_by import signature

    first: dict[int, tuple] = {}
    relaxed = [False]
    saved, differs = T.TemplateCapture.saved, BoundTemplates.node_differs

    def describe(t: Any) -> tuple:
        return (tuple(t.shape), str(t.dtype), type(t.grad_fn).__name__ if t.grad_fn is not None else None,
                t._is_view(), t.requires_grad, t.untyped_storage().nbytes())

    def capture_saved(self, t, s, var, gap):
        if var is not None and var not in self.nodes:
            first[var] = (self.n, gap, *describe(t))
        return saved(self, t, s, var, gap)

    def checked(self, var, t):
        why = differs(self, var, t)
        if why and signature(t, self.templates.depth) != signature(t, self.templates.depth):
            print("SIGNATURE NOT STABLE: two walks of one tensor differ", flush=True)
        if why:
            print(f"MISMATCH {why}\n  now: save {self.n} {describe(t)}\n  capture: {first.get(var)}\n"
                  f"  got : {signature(t, self.templates.depth)}\n  want: {self.templates.nodes.get(var)}",
                  flush=True)
        return None if relaxed[0] else why

    T.TemplateCapture.saved, BoundTemplates.node_differs = capture_saved, checked

    def undo() -> None:
        T.TemplateCapture.saved, BoundTemplates.node_differs = saved, differs

    return relaxed, undo


def _profile_last_step(one: Any, total: int, to: Path | None = None) -> None:
    """Profile the last of every ``total`` steps of gpu_methods' loop (``one``: its step):
    the 25 functions with the most own time printed; with ``to``, written there in full too,
    by own and by cumulative time (what the H200 run's 25 lines could not attribute)."""
    import gpu_methods

    n = [0]

    def step(*args: Any, **kw: Any) -> None:
        n[0] += 1
        if n[0] % total:
            return one(*args, **kw)
        prof = cProfile.Profile()
        prof.enable()
        try:
            one(*args, **kw)
        finally:
            prof.disable()
            engine = args[6] if len(args) > 6 else None   # gpu_methods._one_step's
            if engine is not None:   # the host's waits in the step (the commit point's drain among them)
                print(f"profiled step: the host waited {engine.stats()['last_stall_s'] * 1e3:.1f} ms",
                      flush=True)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue()[:6000], flush=True)
            if to is not None:
                out = io.StringIO()
                stats = pstats.Stats(prof, stream=out)
                stats.sort_stats("tottime").print_stats(60)
                stats.sort_stats("cumulative").print_stats(80)
                stats.print_callers("anchored_step.py|cuda_tier.py|templates.py")
                to.write_text(out.getvalue())

    gpu_methods._one_step = step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="llama,resnet50")
    ap.add_argument("--fractions", default="0.5,0.25")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--relaxed", default="", help="fractions to run again past every mismatch")
    ap.add_argument("--profiles", type=Path, default=None,
                    help="a folder for each row's last step's whole profile (<case>-<fraction>.txt)")
    args = ap.parse_args(argv)
    import gpu_methods

    one = gpu_methods._one_step

    import torch

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)   # as bench_gpu.py
    relaxed, undo = _watch_signatures()
    try:
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False,
                                        deterministic=True):
            _probe(args, relaxed, one)
    finally:
        undo()
        gpu_methods._one_step = one
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    return 0


def _probe(args: argparse.Namespace, relaxed: list[bool], one: Any) -> None:
    import gpu_methods
    import scheduler
    from gpu_cases import FULL, QUICK
    from gpu_methods import WARMUP, Setup, run

    hw = scheduler.hardware("h100-80gb-pcie5")
    cases = {c.name: c for c in (QUICK if args.quick else FULL)}
    for name in args.cases.split(","):
        case = cases[name]
        setup = Setup(case, *case.build(), steps=args.steps, hardware=hw)
        row = run(setup, "in-core")
        print(f"{case.label} in-core {row.step_ms:.1f} ms queued {row.queued_ms:.1f} ms", flush=True)
        runs = [(float(x), False) for x in args.fractions.split(",")]
        runs += [(float(x), True) for x in args.relaxed.split(",") if x]
        for f, relaxed[0] in runs:
            to = None
            if args.profiles is not None:
                args.profiles.mkdir(parents=True, exist_ok=True)
                to = args.profiles / f"{name}-{f:g}{'-relaxed' if relaxed[0] else ''}.txt"
            _profile_last_step(one, WARMUP + args.steps, to)
            row = run(setup, "ooc-one-arena", fraction=f)
            print(f"{case.label} ooc-one-arena {f}{' relaxed' if relaxed[0] else ''}: {row.step_ms:.1f} ms "
                  f"queued {row.queued_ms:.1f} ms "
                  f"steps {row.steps_ms} forms {row.forms} recomputed {row.bytes_recomputed} "
                  f"moved {row.bytes_moved} peak {(row.peak_bytes or 0) / 2**30:.2f} GiB bitwise {row.bitwise} "
                  f"error {row.error!r}", flush=True)
            gpu_methods._one_step = one


if __name__ == "__main__":
    raise SystemExit(main())
