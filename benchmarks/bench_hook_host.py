"""The host's cost of a hook-driven step that recomputes, on this CPU: the Llama's, in miniature.

    python benchmarks/bench_hook_host.py [--quick] [--rounds N] [--out PATH]

On an H200 the Llama's anchored steps (chains rerun from templates at autograd's hooks) queued
100-170 ms more than in core's 86-118 ms, and the GPU waited for the host
(benchmarks/results/gpu-probe-h200.md). What of that excess is ooc's Python on the host, a CPU can
measure: the same decoder (Hugging Face's LlamaForCausalLM, 20 layers: 773 saved tensors a step, as
the H200's), narrow (64 wide, batch 2 x 256) so that its ops cost little, trained in core and
by ooc over the FAKE CUDA driver (``ooc.testing.fake_cuda``: the CUDA path's tier, copy streams
and one arena, with host bytes for device memory). The plan is the GPU's in shape: chains
recomputed and the rest swapped over a link priced at 2 GB/s, the template form kept
(``ooc.testing.forced_forms.templates_forced``: this CPU's own prices would swap less and
recompute nothing). What it measures: each settled step's wall time, in core and ooc, in the
same process, interleaved over rounds; the excess per step and per saved tensor; the driver
calls a step makes; where the excess goes, by clocks in the step (``Meter``: inside ooc's hooks
and calls, the replays and the driver calls within, the collector's pauses; a profiler's own
cost per call inflated ooc's share threefold), and cProfile's view of what calls what. The
fake driver's work (its copies are host memcpy) and the replays' compute count in the excess
where a GPU's would run apart: ooc's own Python and PyTorch calls are the part a GPU's host pays.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import pstats
import statistics
import sys
from collections import Counter
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import common  # noqa: E402
import gpu_cases  # noqa: E402

FULL = dict(layers=20, width=64, seq_len=256, vocab=1024)
QUICK = dict(layers=2, width=64, seq_len=256, vocab=1024)
FRACTION = 0.3     # of the bytes a step saves
WARM = 12          # recording, re-recording, priced runs, the form and its trial
LINK = 2e9         # bytes/s each way: a link dear enough that the plan recomputes as the GPU's


def _case(quick: bool) -> Any:
    return gpu_cases.GpuCase("llama", "Llama proxy", 2, "adamw", None, QUICK if quick else FULL, sdpa="math")


def _saved(model: torch.nn.Module, x: Any, y: Any, loss_fn: Any) -> tuple[int, int]:
    """(tensors, bytes) one step saves."""
    n, total = [0], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += 1
        total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return n[0], total[0]


class Trainer:
    """One model and optimizer, stepped in core or by an engine."""

    def __init__(self, case: Any, model: torch.nn.Module, x: Any, y: Any, loss_fn: Any,
                 engine_budget: int | None = None) -> None:
        from ooc.engine import OutOfCore, Options

        self.case, self.x, self.y, self.loss_fn = case, x, y, loss_fn
        self.model = copy.deepcopy(model)
        self.opt = case.optimizer_for(self.model.parameters())
        self.engine = None if engine_budget is None else OutOfCore(
            self.model, self.opt, budget=engine_budget, device="cuda", recompute="auto",
            options=Options(arena="pytorch"))

    def step(self) -> float:
        t0 = time.perf_counter()
        with self.case.attention(), self.engine.step() if self.engine is not None else contextlib.nullcontext():
            self.loss_fn(self.model(self.x), self.y).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


class Meter:
    """Where an ooc step's host time goes, measured in the step itself (no profiler, whose own
    cost per Python call inflated ooc's share three times over): the wall time inside the
    hooks and the engine's calls (pack, unpack, the update's and the step's bounds), inside
    that the replays (their ops' Python and compute) and the driver calls (the fake's work),
    and the garbage collector's pauses anywhere in the step. Each by wrapping the function
    with a clock: ~0.5 us a call, ~2,000 calls a step."""

    ENTRIES = ("pack", "unpack", "update_starts", "wait_for_transfers", "finish")

    def __init__(self) -> None:
        self.s = Counter()   # what -> seconds
        self.who = "ooc"     # whose step runs: the collector's pauses are counted per trainer
        self._depth = 0
        self._gc_t0 = 0.0

    def _timed(self, fn: Any, what: str, outer: bool) -> Any:
        meter = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if outer and meter._depth:   # an entry inside another (none expected): counted once
                return fn(*args, **kwargs)
            meter._depth += outer
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                meter.s[what] += time.perf_counter() - t0
                meter._depth -= outer
        return wrapper

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.s[f"gc {self.who}"] += time.perf_counter() - self._gc_t0
            self.s[f"full passes {self.who}"] += info["generation"] == 2

    @contextlib.contextmanager
    def on(self) -> Any:
        """The wrappers in place (class attributes: every engine of the process)."""
        import gc

        from ooc.engine import OutOfCore
        from ooc.runtime.anchored_step import AnchoredStep
        from ooc.runtime.bound_templates import BoundTemplates
        from ooc.testing.fake_cuda_contexts import FakeContexts
        from vmm.cuda_driver import CudaDriver

        patched = [(AnchoredStep, name, "ooc", True) for name in self.ENTRIES]
        patched += [(OutOfCore, "step", "ooc", False), (BoundTemplates, "replay", "replays", False),
                    (CudaDriver, "raw", "driver", False)]
        # the context calls go to the driver's module directly, not through ``CudaDriver.raw``
        patched += [(FakeContexts, name, "driver", False) for name in ("cuCtxGetCurrent", "cuCtxSetCurrent")]
        saved = [(cls, name, cls.__dict__[name]) for cls, name, _, _ in patched]
        for cls, name, what, outer in patched:
            fn = cls.__dict__[name]
            if name == "step":   # a context manager: its entry and exit, not the user's block
                setattr(cls, name, self._bounds(fn))
            else:
                setattr(cls, name, self._timed(fn, what, outer))
        gc.callbacks.append(self._gc)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._gc)
            for cls, name, fn in saved:
                setattr(cls, name, fn)

    def _bounds(self, step: Any) -> Any:
        meter = self

        @contextlib.contextmanager
        def timed_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
            cm = step(engine, *args, **kwargs)
            meter._timed(cm.__enter__, "ooc", True)()   # the entries it calls counted in it
            try:
                yield
            except BaseException as e:
                if not cm.__exit__(type(e), e, e.__traceback__):
                    raise
            else:
                meter._timed(cm.__exit__, "ooc", True)(None, None, None)
        return timed_step


def _metered(ref: Trainer, ooc: Trainer, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """In core and ooc stepped in turn under the clocks: per step, ms inside ooc (hooks and
    bounds), of which replays and driver calls, and the collector's pauses of each; and each
    side's mean step time (a full pass of the collector comes every ~100 steps: a median hides
    it). The same steps give the excess the split is of: the machine's speed drifts between
    rounds."""
    meter = Meter()
    walls: dict[str, list[float]] = {"in core": [], "ooc": []}
    with meter.on():
        for _ in range(steps):
            for who, trainer in (("in core", ref), ("ooc", ooc)):
                meter.who = who
                walls[who].append(trainer.step())
    return {k: v / steps for k, v in meter.s.items()}, {k: statistics.mean(v) for k, v in walls.items()}


def _profile(trainer: Trainer, top: int) -> list[str]:
    """One step under cProfile: ooc's functions by cumulative time (what calls what; its own
    cost per Python call inflates them: ``Meter`` says how long they take)."""
    prof = cProfile.Profile()
    prof.enable()
    trainer.step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(r"ooc/(runtime|storage|engine)|vmm/", top)
    return [line for line in out.getvalue().splitlines() if line.strip()]


def _range(seconds: list[float]) -> str:
    return f"{min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f}"


def _where_lines(where: dict[str, float], means: dict[str, float], steps: int) -> list[str]:
    """What ``Meter`` measured over the last round's extra steps, in words."""
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    excess = means["ooc"] - means["in core"]
    inside = where.get("ooc", 0.0)
    own = inside - where.get("replays", 0.0) - where.get("driver", 0.0)
    return [f"- where the excess goes (clocks in the step, not a profiler; {steps} more steps of each, in "
            f"turn: in core {ms(means['in core'])}, ooc {ms(means['ooc'])} on average, {ms(excess)} apart): "
            f"inside ooc's hooks and the engine's calls {ms(inside)} a step, of which the replays "
            f"{ms(where.get('replays', 0.0))} (their ops' Python and compute; a GPU's kernels run apart), the "
            f"driver calls {ms(where.get('driver', 0.0))} (the fake's work: a GPU's driver does this "
            f"elsewhere), ooc's own Python and PyTorch calls {ms(own)}; outside ooc {ms(excess - inside)} "
            "(autograd calling the hooks, the model's ops, which run slower beside ooc's work on this CPU)",
            f"- the garbage collector's pauses, a step on average over those steps: in core "
            f"{ms(where.get('gc in core', 0.0))}, ooc {ms(where.get('gc ooc', 0.0))}, with "
            f"{where.get('full passes in core', 0.0) * steps:.0f} and "
            f"{where.get('full passes ooc', 0.0) * steps:.0f} full pass(es) of the whole heap among them "
            "(rare and long: the mean step time holds them, the median does not)"]


def main() -> None:
    ap = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--rounds", type=int, help="rounds of interleaved in-core / ooc runs (default 5; quick 1)")
    args = ap.parse_args()
    from ooc.testing import fake_cuda
    from ooc.testing.forced_forms import templates_forced

    rounds = max(1, args.rounds or (1 if args.quick else 5))
    timed = 3 if args.quick else 8
    case = _case(args.quick)
    model, x, y, loss_fn = case.build()
    saves, nbytes = _saved(model, x, y, loss_fn)
    templates_forced(setattr, h2d_bandwidth=LINK, d2h_bandwidth=LINK)   # a process of its own
    incore_s: list[float] = []
    ooc_s: list[float] = []
    counted: dict[str, float] = {}
    calls: dict[str, int] = {}
    profile: list[str] = []
    where: dict[str, float] = {}
    means: dict[str, float] = {}
    bitwise = True
    with fake_cuda(memory_bytes=4 << 30, granularity=64 << 10) as driver:
        for k in range(rounds):
            ref = Trainer(case, model, x, y, loss_fn)
            ooc = Trainer(case, model, x, y, loss_fn, engine_budget=int(nbytes * FRACTION))
            for _ in range(WARM):
                ref.step()
                ooc.step()
            r = [ref.step() for _ in range(timed)]
            first, stats0 = len(driver.calls), ooc.engine.stats()   # the fake lists every call
            o = [ooc.step() for _ in range(timed)]
            stats1 = ooc.engine.stats()
            incore_s.append(statistics.median(r))
            ooc_s.append(statistics.median(o))
            calls = {name: n // timed for name, n in Counter(driver.calls[first:]).items()}
            counted = {key: (stats1[key] - stats0[key]) / timed for key in
                       ("bytes_in", "bytes_out", "bytes_recomputed", "steps.anchored")}
            bitwise = bitwise and all(torch.equal(a, b) for a, b in
                                      zip(ref.model.parameters(), ooc.model.parameters()))
            print(f"round {k + 1}: in core {incore_s[-1]:.3f} s, ooc {ooc_s[-1]:.3f} s, "
                  f"anchored {counted['steps.anchored']:.0%} of timed steps", flush=True)
            if k == rounds - 1:   # after the timed steps: the clocks and the profiler cost a little
                where, means = _metered(ref, ooc, timed)
                profile = _profile(ooc, 30)
            ooc.engine.close()
        assert driver.violations == [], driver.violations
    inc, oc = statistics.median(incore_s), statistics.median(ooc_s)
    excess = oc - inc
    kw = QUICK if args.quick else FULL
    lines = common.header("The host's cost of a hook-driven step that recomputes (CPU, fake CUDA driver)",
                          quick=args.quick, notes=[
        f"command: `python benchmarks/bench_hook_host.py{' --quick' if args.quick else ''}`; Llama "
        f"{kw['layers']} x {kw['width']}, batch 2 x {kw['seq_len']}, fp32, math attention; budget "
        f"{FRACTION} of the {nbytes / 2**20:.1f} MiB a step saves; link priced at {LINK / 1e9:.0f} GB/s; "
        f"{rounds} round(s), each {WARM} warm steps then {timed} timed, in core and ooc interleaved "
        "by round; step time the median of the timed steps, the median over rounds",
        f"load average (1 min): {common.load_average()}"])
    rows = [["in core", f"{inc * 1e3:.1f} ({_range(incore_s)})", "", "", "", "", "", ""],
            ["ooc, anchored from templates", f"{oc * 1e3:.1f} ({_range(ooc_s)})", f"{excess * 1e3:+.1f}",
             f"{excess / saves * 1e6:.1f}", f"{sum(calls.values())}",
             f"{(counted['bytes_in'] + counted['bytes_out']) / 2**20:.1f}",
             f"{counted['bytes_recomputed'] / 2**20:.1f}", f"{counted['steps.anchored']:.0%}"]]
    lines += common.md_table(["run", "step ms (rounds' range)", "excess ms", "excess us a saved tensor",
                              "driver calls a step", "MiB moved a step", "MiB recomputed a step",
                              "timed steps anchored"], rows)
    lines += ["", f"- saved tensors a step: {saves}; parameters bitwise in core and ooc after every round: "
              f"{'yes' if bitwise else 'NO'}",
              "- driver calls a step: " + ", ".join(f"{k} {v}" for k, v in
                                                    sorted(calls.items(), key=lambda kv: -kv[1])),
              *_where_lines(where, means, timed),
              "", "The ooc step under cProfile, ooc's functions by cumulative time (the profiler's own cost per "
              "call inflates them about three times: the lines above are the step's own clocks):", "", "```",
              *profile, "```"]
    common.write_report(common.result_path("hook-host", args.quick, out=args.out), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
