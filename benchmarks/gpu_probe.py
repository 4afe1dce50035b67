"""A diagnostic run of the template form on a GPU: why a hook-driven step's signature check
failed (each mismatch printed in full: the tensor now and at the capture, both signatures),
where an anchored step's host time goes (cProfile of each row's last timed step, in core's
too, and in core under saved-tensor hooks that do nothing: what the hooks alone cost), and
what holds the device's memory at a step's peak (``--memory``).

    python benchmarks/gpu_probe.py [--quick] [--cases llama,resnet50] [--fractions 0.5,0.25]
                                   [--relaxed 0.5] [--profiles DIR] [--methods M,...] [--memory | --clocks]

``--memory``: the last timed step of each ooc row under PyTorch's allocator history
(``torch.cuda.memory._record_memory_history``, Python frames): the blocks live at the step's
peak of allocated bytes, summed by the innermost frame of ooc, the benchmark or the model that
allocated them (the H200 run at 6915be1: ResNet-50's anchored steps at 1/4 peaked 2.5 GiB over
the per-op steps at the same budget, every step, which no model of the plan shows).

``--clocks``: the last timed step of each ooc row under clocks (no profiler): the host's time
inside ooc, in its replays and driver calls, and per kind of plan action, each action's calls
and mean host time (what a host lane per action would charge; the Llama at 6915be1 was
host-bound, and the simulator's host lane per op missed its rows by +31% to +64%).

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
from collections.abc import Callable
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


def _on_last_step(one: Any, total: int, measured: Callable[[Callable[[], None], tuple], None]) -> None:
    """Make gpu_methods' loop run ``one`` (its step), and the last of every ``total`` steps as
    ``measured(run, args)`` (``run`` runs that step; ``args``, the step's arguments)."""
    import gpu_methods

    n = [0]

    def step(*args: Any, **kw: Any) -> None:
        n[0] += 1
        if n[0] % total:
            return one(*args, **kw)
        measured(lambda: one(*args, **kw), args)

    gpu_methods._one_step = step


def _profile_last_step(one: Any, total: int, to: Path | None = None) -> None:
    """Profile the last of every ``total`` steps of gpu_methods' loop (``one``: its step):
    the 25 functions with the most own time printed; with ``to``, written there in full too,
    by own and by cumulative time (what the H200 run's 25 lines could not attribute)."""

    def profiled(run: Callable[[], None], args: tuple) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            run()
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

    _on_last_step(one, total, profiled)


def _memory_at_last_step(one: Any, total: int, label: str) -> None:
    """Run the last of every ``total`` steps under the allocator's history and print what is
    live at its peak, by the frame that allocated it (``--memory``)."""
    import torch

    from ooc.runtime.slots import Slot

    def recorded(run: Callable[[], None], args: tuple) -> None:
        names: list[tuple[int, int, str]] = []   # (address, allocations so far, the slot's name)
        made_again, swap_in = Slot.made_again, Slot.start_swap_in
        allocs = lambda: torch.cuda.memory_stats()["allocation.all.allocated"]  # noqa: E731

        def made(self, storage, *a, **k):
            names.append((storage.data_ptr(), allocs() - first, f"recomputed {self.name}"))
            return made_again(self, storage, *a, **k)

        def swapped(self, *a, **k):
            swap_in(self, *a, **k)
            if self.pending:
                names.append((self.pending[0].data_ptr(), allocs() - first, f"swapped in {self.name}"))

        start, first = torch.cuda.memory_allocated(), allocs()
        Slot.made_again, Slot.start_swap_in = made, swapped
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            run()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            Slot.made_again, Slot.start_swap_in = made_again, swap_in
        print(peak_lines(snap["device_traces"][torch.cuda.current_device()], start, label, names=names), flush=True)

    _on_last_step(one, total, recorded)


def _clocked_last_step(one: Any, total: int, label: str) -> None:
    """Clock the last of every ``total`` steps where its host time goes (``--clocks``): inside
    ooc's hooks and the engine's calls, the replays and the driver calls in them, the
    collector's pauses (bench_hook_host.py's ``Meter``: a clock around each, no profiler, whose
    own cost per call inflated the Python two to three times), and each kind of plan action's
    calls and host time (its transfers started, waits, frees, discards, recomputes). What the
    simulator's host lane would charge per action, measured on the GPU's host."""
    import time
    from collections import Counter

    from bench_hook_host import Meter
    from ooc.runtime.anchored_step import AnchoredStep

    def clocked(run: Callable[[], None], args: tuple) -> None:
        spent: Counter = Counter()
        calls: Counter = Counter()
        apply = AnchoredStep._apply

        def timed_apply(self, a, slot, gap):
            t0 = time.perf_counter()
            try:
                return apply(self, a, slot, gap)
            finally:
                spent[a.op.value] += time.perf_counter() - t0
                calls[a.op.value] += 1

        meter = Meter()
        with meter.on():
            pack, unpack = AnchoredStep.pack, AnchoredStep.unpack   # the meter's, counted too

            def counted_pack(self, t):
                calls["pack"] += 1
                return pack(self, t)

            def counted_unpack(self, p):
                calls["unpack"] += 1
                return unpack(self, p)

            AnchoredStep.pack, AnchoredStep.unpack, AnchoredStep._apply = counted_pack, counted_unpack, timed_apply
            t0 = time.perf_counter()
            try:
                run()
            finally:
                wall = time.perf_counter() - t0
                AnchoredStep._apply, AnchoredStep.pack, AnchoredStep.unpack = apply, pack, unpack
        ms = {k: v * 1e3 for k, v in meter.s.items()}
        per = ", ".join(f"{op} {calls[op]} x {spent[op] / calls[op] * 1e6:.1f} us" for op in sorted(spent))
        print(f"clocked step ({label}): {wall * 1e3:.1f} ms until its code returned; inside ooc "
              f"{ms.get('ooc', 0.0):.1f} ms ({calls['pack']} packs, {calls['unpack']} unpacks), of which "
              f"replays {ms.get('replays', 0.0):.1f} ms and driver calls {ms.get('driver', 0.0):.1f} ms; "
              f"collector {ms.get('gc ooc', 0.0):.1f} ms; per action: {per or 'none'}", flush=True)

    _on_last_step(one, total, clocked)


def _where(frames: list[dict]) -> str:
    """The innermost frame of ooc, the benchmarks or a model's library (else the innermost;
    none where no Python frame made the block: the autograd engine's thread, the backward's
    gradients)."""
    if not frames:
        return "(no Python frame: the autograd engine's)"
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("/ooc/", "/benchmarks/", "transformers/", "torchvision/")):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    f = frames[0]
    return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"


def peak_lines(events: list[dict], start: int, label: str, top: int = 15,
               names: list[tuple[int, int, str]] = ()) -> str:
    """The blocks live at the peak of allocated bytes over ``events`` (an allocator trace that
    began with ``start`` bytes allocated), summed by where they were allocated; then, where
    ``names`` is given (the slots whose bytes a block held: address, the allocations the step
    had made by then, name; each names the last block allocated at that address by then),
    the live blocks split into a slot's (each named, the largest first) and the rest (a
    replayed chain's intermediate results, autograd's own). The frame of the allocation that
    made the peak closes the list."""
    cur = peak = start
    at = -1
    ordinal: list[int] = []   # per event: the allocations up to it
    allocated_at: dict[int, list[int]] = {}   # address -> the events that allocated there
    n = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            n += 1
            cur += e["size"]
            allocated_at.setdefault(e["addr"], []).append(i)
        elif e["action"] == "free_completed":
            cur -= e["size"]
        ordinal.append(n)
        if cur > peak:
            peak, at = cur, i
    named: dict[int, str] = {}   # event index of an alloc -> the slot its block held
    for addr, count, name in names:
        hits = [i for i in allocated_at.get(addr, ()) if ordinal[i] <= count]
        if hits:
            named[hits[-1]] = name
    live: dict[int, tuple[int, str, int]] = {}   # address -> (bytes, where, alloc event)
    before = start
    for i, e in enumerate(events[:at + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames") or []), i)
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                before -= e["size"]   # a block from before the step
    groups: dict[str, int] = {"(allocated before the step, still live)": before}
    for size, where, _ in live.values():
        groups[where] = groups.get(where, 0) + size
    lines = [f"MEMORY {label}: peak {peak / 2**30:.2f} GiB allocated (event {at} of {len(events)}; "
             f"{start / 2**30:.2f} GiB at the step's start)"]
    for where, size in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {size / 2**30:7.3f} GiB  {where}")
    if names:
        held = sorted(((size, named[i]) for size, _, i in live.values() if i in named), reverse=True)
        rest = sum(size for size, _, i in live.values() if i not in named)
        lines.append(f"  of which a slot's bytes: {sum(s for s, _ in held) / 2**30:.3f} GiB in {len(held)} blocks; "
                     f"the rest: {rest / 2**30:.3f} GiB")
        lines += [f"    {size / 2**30:7.3f} GiB  {name}" for size, name in held[:top]]
    if at >= 0:
        lines.append(f"  the peak's allocation: {events[at]['size'] / 2**20:.1f} MiB at "
                     f"{_where(events[at].get('frames') or [])}")
    return "\n".join(lines)


def _same(t: Any) -> Any:
    return t


def _hooked(one: Any) -> Any:
    """``one`` under saved-tensor hooks that do nothing: what a hook call alone costs."""
    import torch

    def step(*args: Any, **kw: Any) -> None:
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return one(*args, **kw)
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="llama,resnet50")
    ap.add_argument("--fractions", default="0.5,0.25")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--relaxed", default="", help="fractions to run again past every mismatch")
    ap.add_argument("--profiles", type=Path, default=None,
                    help="a folder for each row's last step's whole profile "
                         "(<case>-<method>-<fraction>.txt; in core's: <case>-in-core.txt)")
    ap.add_argument("--methods", default="ooc-one-arena", help="the ooc methods to run (gpu_methods')")
    last_step = ap.add_mutually_exclusive_group()   # each wraps the same last step
    last_step.add_argument("--memory", action="store_true", help="what is live at each ooc row's last step's peak")
    last_step.add_argument("--clocks", action="store_true",
                           help="where each ooc row's last step's host time goes, by clocks, per plan action")
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
        if args.profiles is not None:
            args.profiles.mkdir(parents=True, exist_ok=True)
        for label, base in (("in-core", one), ("in-core, saved-tensor hooks that do nothing", _hooked(one))):
            gpu_methods._one_step = base
            if args.profiles is not None and base is one:
                _profile_last_step(one, WARMUP + args.steps, args.profiles / f"{name}-in-core.txt")
            row = run(setup, "in-core")
            print(f"{case.label} {label} {row.step_ms:.1f} ms queued {row.queued_ms:.1f} ms", flush=True)
            gpu_methods._one_step = one
        runs = [(float(x), False, m) for m in args.methods.split(",") for x in args.fractions.split(",")]
        runs += [(float(x), True, "ooc-one-arena") for x in args.relaxed.split(",") if x]
        for f, relaxed[0], method in runs:
            to = None
            if args.profiles is not None:
                to = args.profiles / f"{name}-{method}-{f:g}{'-relaxed' if relaxed[0] else ''}.txt"
            if args.clocks:
                _clocked_last_step(one, WARMUP + args.steps, f"{case.label} {method} {f}")
            elif args.memory:
                _memory_at_last_step(one, WARMUP + args.steps, f"{case.label} {method} {f}")
            else:
                _profile_last_step(one, WARMUP + args.steps, to)
            row = run(setup, method, fraction=f)
            print(f"{case.label} {method} {f}{' relaxed' if relaxed[0] else ''}: {row.step_ms:.1f} ms "
                  f"queued {row.queued_ms:.1f} ms "
                  f"steps {row.steps_ms} forms {row.forms} recomputed {row.bytes_recomputed} "
                  f"moved {row.bytes_moved} peak {(row.peak_bytes or 0) / 2**30:.2f} GiB bitwise {row.bitwise} "
                  f"error {row.error!r}", flush=True)
            gpu_methods._one_step = one


if __name__ == "__main__":
    raise SystemExit(main())
