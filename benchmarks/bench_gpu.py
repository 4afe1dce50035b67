"""ooc on a real GPU, side by side with what a GPU user already has (issue 38).

    python benchmarks/bench_gpu.py [--quick] [--out PATH] [--steps N] [--deadline S]
                                   [--profiles DIR] [--no-compile] [--no-sanitizer] [--vmm]
                                   [--pytest]

One command for a GPU machine, in the order of what matters most, so that a run cut short by
its time limit (``--deadline``: seconds from the start after which no new section begins)
still leaves the most important figures; the report is rewritten after every row.

1. **The link**: one large pinned copy each way; the simulator prices swaps with it
   (``h100-80gb-pcie5`` preset with the measured bandwidths). **Host cost per op**
   (``gpu_host_cost.py``): ResNet-50 b32 in core, under a dispatch mode that only calls each
   op, under ooc per op (with and without quiet ops) and plain, nothing to move; the host's
   time to queue an op the engine looks at and a quiet one, which the simulator's host lane
   charges (``Hardware.host_op_s``); a profile of one per-op step.
2. **Per case** (ResNet-50 b256 SGD, GPT-2 small b8 x 1024 AdamW, a ~320 M Llama b4 x 2048 in
   bf16; ``gpu_cases.py``): in-core, in-core again (are the kernels deterministic?), a GPU
   profile (``gpu_profiles.py``: the step recorded with CUDA-event op times, written to
   ``--profiles``), checkpoint every block and every 2nd block, ``save_on_cpu``, ooc at 1/2
   and 1/4 of the in-core step's own peak, the same with one arena (``ooc-one-arena``: the
   swap-ins in PyTorch's allocator, ``Options(arena="pytorch")``), ooc swap-only at 1/4,
   ooc matched to each alternative's peak, per arena (``gpu_methods.py``), and where
   ``--methods`` names it, one arena with its plans priced on the recording step alone
   (``ooc-one-arena-priced-once``: what pricing again on warm runs buys). Per row: step,
   samples/s, peak device memory (PyTorch's peak + ooc's VMM pool; PyTorch's alone with one
   arena), bytes moved and recomputed per step, bitwise vs in-core, the simulator's prediction.
3. **nnabla's headline** (``gpu_headline.py``): ResNet-50 at 4x the largest batch that fits
   a 16 GiB cap, against the best in-core images/s (unless ``--no-headline``).
4. **Step forms**: each way the engine runs a step, on a small model, bitwise against the
   same loop in core (recompute with dropout, swap only, bf16, fp16 + GradScaler, every kind
   managed, a budget with nothing to move).
5. ``--pytest``: the real-GPU tests (``pytest -m gpu``).
6. ``torch.compile`` with ``activation_memory_budget`` 0.5 and 0.25 (unless ``--no-compile``).
7. compute-sanitizer memcheck (unless ``--no-sanitizer``), VMM call costs (``--vmm``).

cuDNN and cuBLAS run deterministically in every run. Writes benchmarks/results/gpu.md and
gpu.json (``--quick``: gpu-quick.*). Without CUDA it writes a report saying that nothing was
validated, and exits 0.
"""

from __future__ import annotations

import os

# Before torch initializes CUDA: cuBLAS is deterministic only with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import gpu_report  # noqa: E402
from gpu_aim import AIM, MATCH_TRIES, matched_budget, tries_again  # noqa: E402

HERE = Path(__file__).resolve()
# "ooc-one-arena": the same engine with its swap-ins in PyTorch's allocator (Options(arena="pytorch"));
# "ooc-one-arena-priced-once": and its plans priced on the recording step's op times alone, as
# before a GPU's plans were priced again on warm runs (an A/B of that change in one run)
OOC_FRACTIONS = ((0.5, "ooc"), (0.25, "ooc"), (0.5, "ooc-one-arena"), (0.25, "ooc-one-arena"),
                 (0.5, "ooc-one-arena-priced-once"), (0.25, "ooc-one-arena-priced-once"),
                 (0.25, "ooc-swap-only"))
OPT_IN = frozenset({"ooc-one-arena-priced-once", "ooc-matched-bounded"})   # run only where --methods names them
BEFORE_OOC = ("in-core", "in-core-repeat", "checkpoint-every-block", "checkpoint-every-2nd",
              "save_on_cpu")


def main() -> int:
    p = common.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5; quick 2)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="seconds from the start after which no new section begins")
    p.add_argument("--profiles", type=Path, default=None, metavar="DIR",
                   help="write GPU profiles here (default benchmarks/profiles; quick: none)")
    p.add_argument("--recordings", type=Path, default=None, metavar="DIR",
                   help="write each ooc run's recorded step (the engine's own) here")
    p.add_argument("--cases", default=None, help="comma-separated subset: resnet50,gpt2,llama")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of the per-case methods (in-core always runs)")
    p.add_argument("--no-forms", action="store_true", help="skip the step-form checks")
    p.add_argument("--no-headline", action="store_true", help="skip the 16 GiB headline (gpu_headline.py)")
    p.add_argument("--headline-last", action="store_true", help="the headline after the compile rows")
    p.add_argument("--no-host-cost", action="store_true", help="skip the host-cost section")
    p.add_argument("--no-profiles", action="store_true", help="record no GPU profile")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--no-sanitizer", action="store_true", help="skip compute-sanitizer")
    p.add_argument("--vmm", action="store_true", help="also time the driver's VMM calls")
    p.add_argument("--pytest", action="store_true", help="also run the real-GPU tests (pytest -m gpu)")
    p.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every row (in core too)")
    p.add_argument("--sanitize-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sanitize_child:
        from gpu_sanitizer import sanitize_child

        return sanitize_child()
    if args.expandable_segments:   # read when PyTorch's allocator starts: before any CUDA work
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    import torch

    out = common.result_path("gpu", args.quick, out=args.out)
    if not torch.cuda.is_available():
        common.write_report(out, common.header("ooc on a GPU", quick=args.quick, notes=[
            f"no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
            "nothing was validated; run this on a machine with a GPU"]))
        return 0
    # what follows changes for the whole process, and a caller in it (the tests' dry runs) goes
    # on after: each is put back at the end (left on, deterministic mode filled every later
    # torch.empty of the suite's process with 255s, and slowed each)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    clock = _Clock(args.deadline)
    report = gpu_report.Report(out, args.quick)
    profiles = args.profiles or (None if args.quick or args.no_profiles else HERE.parent / "profiles")
    # cuDNN's flags through its context manager: assigning them raises once something has
    # called torch.backends.disable_global_flags() (torch.testing._internal does, on import)
    # a run stopped from outside (`timeout`, a lease's end: SIGTERM) still writes what it measured
    handler = signal.signal(signal.SIGTERM, _interrupted)
    try:
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False,
                                        deterministic=True):
            _sections(args, report, clock, profiles)
    except KeyboardInterrupt:
        report.skipped("the run was stopped from outside here: the sections after this were not run")
    finally:
        signal.signal(signal.SIGTERM, handler)
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        report.write()
    return 1 if report.failures() else 0


def _interrupted(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class _Clock:
    def __init__(self, deadline: float | None) -> None:
        self.t0, self.deadline = time.perf_counter(), deadline

    def left(self) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - (time.perf_counter() - self.t0)


def _sections(args: argparse.Namespace, report: gpu_report.Report, clock: _Clock,
              profiles: Path | None) -> None:
    import scheduler
    from gpu_cases import FORMS, FULL, QUICK, QUICK_FORMS
    from gpu_link import bandwidth, vmm_costs
    from gpu_methods import Setup, run

    table, rates = bandwidth(args.quick)
    report.section("Pinned host memory bandwidth", table)
    report.link = rates
    hw = scheduler.hardware("h100-80gb-pcie5", h2d_bandwidth=rates["h2d"], d2h_bandwidth=rates["d2h"])
    hook_host_s = 0.0
    if clock.left() > 60 and not args.no_host_cost:   # the host's time per op: the simulator's host lane for every 'sim' below
        from gpu_host_cost import host_cost

        got = _guarded(host_cost, args.quick)
        lines, host = got if isinstance(got, tuple) else (got, {})
        report.section("Host cost per op", lines)
        hook_host_s = host.pop("hook_host_s", 0.0)
        hw = scheduler.hardware(hw, **host)
    steps = args.steps or (2 if args.quick else 5)
    cases = QUICK if args.quick else FULL
    if args.cases:
        cases = [c for c in cases if c.name in args.cases.split(",")]
    references = {}   # in-core parameters per case, for the compile rows
    for case in cases:
        if clock.left() < 60:
            report.skipped(f"{case.label}: not run, the run's time limit")
            continue
        model, x, y, loss_fn = case.build()
        setup = Setup(case, model, x, y, loss_fn, steps, hardware=hw, hook_host_s=hook_host_s)
        for method in BEFORE_OOC:
            if method != "in-core" and not _chosen(args, method):
                continue
            slow = method == "save_on_cpu"   # 10-16x in-core: fewer timed steps say as much
            # (as many steps in all as in-core's, whose parameters it is compared with)
            report.add(run(setup, method, warmup=max(1, setup.reference_steps - 3), steps=3) if slow
                       else run(setup, method))
            if method == "in-core" and profiles is not None:
                _profile(case, profiles, report, rates)
        for fraction, method in OOC_FRACTIONS:
            if not _chosen(args, method):
                continue
            report.add(run(setup, method, fraction=fraction, recordings=args.recordings))
        matched = [m for m in ("ooc-matched", "ooc-matched-one-arena", "ooc-matched-bounded") if _chosen(args, m)]
        if matched and clock.left() > 60:
            _matched(setup, report, [r for r in report.rows if r.case == case.name], matched)
        references[case.name] = setup.reference, setup.reference_steps
        del model, x, y, setup
    if not args.headline_last:
        _headline(args, report, clock, hw, steps, cases)
    for case, engine_kw, fraction in [] if args.no_forms else QUICK_FORMS if args.quick else FORMS:
        if clock.left() < 30:
            report.skipped(f"step form {case.label} {engine_kw}: not run, the run's time limit")
            continue
        setup = Setup(case, *case.build(), steps=2, hardware=hw, hook_host_s=hook_host_s)
        report.add(run(setup, "in-core"), form=True)
        report.add(run(setup, "ooc", fraction=fraction, engine_kw=engine_kw), form=True)
    if args.pytest:
        report.section("Real-GPU tests (pytest -m gpu)", _pytest(clock.left()))
    if not args.no_compile:   # the budgets first, then the cases (compiling takes a while)
        for budget, case in [(b, c) for b in ("0.5", "0.25") for c in cases]:
            if clock.left() < 90:
                report.skipped(f"{case.label} compile-budget-{budget}: not run, the run's time limit")
                continue
            model, x, y, loss_fn = case.build()
            setup = Setup(case, model, x, y, loss_fn, steps, hardware=hw)
            setup.reference, setup.reference_steps = references.get(case.name, (None, 0))
            report.add(run(setup, f"compile-budget-{budget}"))
    if args.headline_last:
        _headline(args, report, clock, hw, steps, cases)
    if not args.no_sanitizer and clock.left() > 60:
        from gpu_sanitizer import sanitizer

        report.section("compute-sanitizer memcheck", _guarded(sanitizer, args.quick, str(HERE)))
    if args.vmm and clock.left() > 60:
        report.section("VMM cost per chunk", _guarded(vmm_costs, args.quick))


def _headline(args: argparse.Namespace, report: gpu_report.Report, clock: _Clock, hw, steps: int,
              cases: list) -> None:
    if args.no_headline or "resnet50" not in [c.name for c in cases]:
        return
    if clock.left() < 120:
        report.skipped("the 16 GiB headline: not run, the run's time limit")
        return
    from gpu_headline import headline

    got = _guarded(headline, hw, steps, args.quick, clock.left)
    lines, report.extra["headline"] = got if isinstance(got, tuple) else (got, [])
    report.section("nnabla's headline: ResNet-50 at 4x the largest batch under a 16 GiB cap", lines)


def _matched(setup, report: gpu_report.Report, rows: list, methods: list[str]) -> None:
    """ooc at each alternative's peak (issue 38: ooc at no more peak memory than each
    alternative is faster than it): the budget read off the ooc rows' own budgets and peaks,
    and in core's (its own peak as a budget: a plan that moves nothing), aimed 3% under the
    alternative's peak; for each arena whose rows ran; a second try where the first is over
    the peak, or slower and well under it (``tries_again``). Without in core's point an alternative
    above the ooc rows' peaks was aimed at on the line through them alone: on the H200 at
    6915be1 ResNet-50's 1/2 and 1/4 rows peaked at 10.64 and 10.17 GiB, and that line put
    checkpointing every 2nd block's 14.72 GiB at a budget of 49 GiB, over in core's. A try over the peak
    is kept (it is a measurement) and tried once more between its point and the ones below.
    Where the case has a GPU profile the first try aims on its device-peak curve instead
    (``gpu_aim``: the peak is not monotone in the budget, and a line cannot aim at it)."""
    from gpu_methods import run

    if not setup.activation_peak:   # in core failed: nothing to take fractions of
        return
    for source, method in (("ooc", "ooc-matched"), ("ooc-one-arena", "ooc-matched-one-arena"),
                           ("ooc-one-arena", "ooc-matched-bounded")):
        if method not in methods:
            continue
        points = [(r.budget_bytes, r.peak_bytes) for r in rows
                  if r.method == source and not r.error and r.budget_bytes and r.peak_bytes]
        if not points:
            continue
        in_core = next((r for r in rows if r.method == "in-core" and r.peak_bytes), None)
        if in_core is not None:   # a budget of in core's own peak moves nothing: in core's peak
            points.append((setup.activation_peak, in_core.peak_bytes))
        aim = _aim(setup, points, "pool" if method == "ooc-matched" else "pytorch")
        for alt in [r for r in rows if r.method.startswith(("checkpoint", "save_on_cpu")) and r.peak_bytes]:
            tried = list(points)
            aimed = _aimed(aim, alt.peak_bytes)
            if method == "ooc-matched-bounded":   # a budget for the whole step: the peak less the model's miss
                aimed = alt.peak_bytes - (aim.missed if aim is not None else alt.peak_bytes // 16)
            for attempt in range(1 if method == "ooc-matched-bounded" else MATCH_TRIES):
                budget = (aimed if attempt == 0 and aimed is not None
                          else matched_budget(tried, int(alt.peak_bytes * AIM)))
                if budget is None or any(b == budget for b, _ in tried):
                    report.skipped(f"{setup.case.label} {method} to {alt.method}'s peak "
                                   f"({alt.peak_bytes / 2**30:.2f} GiB): no budget reaches it on the "
                                   f"line through the {source} rows' budgets and peaks")
                    break
                row = run(setup, method, fraction=budget / setup.activation_peak, budget_bytes=budget)
                how = (f", a budget for the whole step, {(alt.peak_bytes - budget) / 2**30:.2f} GiB under it"
                       if method == "ooc-matched-bounded" else
                       f", aimed on the profile's curve (the model missed {aim.missed / 2**30:.2f} GiB)"
                       if attempt == 0 and aimed is not None else "")
                row.note = "; ".join(x for x in (f"matched to {alt.method}'s peak"
                                                 + (f", try {attempt + 1}" if attempt else how), row.note) if x)
                if method == "ooc-matched-bounded" and row.error.startswith("BudgetTooSmall"):
                    report.skipped(f"{setup.case.label} {method} to {alt.method}'s peak: refused, {row.error}")
                    break   # the step holds more than that peak beside any plan: an answer, not a failure
                report.add(row)
                if row.error or not row.peak_bytes or not tries_again(row.peak_bytes, row.step_ms, alt.peak_bytes,
                                                                       alt.step_ms):
                    break
                tried.append((budget, row.peak_bytes))


def _aim(setup, points: list[tuple[int, int]], arena: str):
    """``gpu_aim.Aim`` for the case from its ooc rows' points (in core's, which moves nothing,
    left out), or None (no profile of it; a failure is printed: the line still aims)."""
    from gpu_aim import Aim

    if setup.hardware is None:
        return None
    try:
        return Aim.of(setup.case.label, setup.hardware, [p for p in points if p[0] < setup.activation_peak], arena)
    except Exception:
        traceback.print_exc()
        return None


def _aimed(aim, peak: int) -> int | None:
    """``aim``'s budget for ``peak``, or None (no aim; a failure is printed: the line aims)."""
    if aim is None:
        return None
    try:
        return aim.budget_for(peak)
    except Exception:
        traceback.print_exc()
        return None


def _chosen(args: argparse.Namespace, method: str) -> bool:
    if args.methods is None:
        return method not in OPT_IN
    return method in args.methods.split(",")


def _profile(case, profiles: Path, report: gpu_report.Report, rates: dict[str, float]) -> None:
    from gpu_profiles import record

    try:
        in_core = report.rows[-1]
        path = record(case, profiles, {"link_bytes_per_s": rates,
                                       "in_core_step_ms": in_core.step_ms})
        report.profiles.append(str(path))
    except Exception:
        traceback.print_exc()
        report.skipped(f"{case.label}: profile FAILED: {traceback.format_exc().strip().splitlines()[-1]}")


def _pytest(left: float) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "--deselect", "tests/ooc/test_cuda_gpu.py::test_gpu_validation_command_runs_quick",
           "tests/ooc/test_cuda_gpu.py", "tests/vmm/test_cuda.py", "tests/ooc/test_amp.py",
           "tests/ooc/test_second_backward.py", "tests/ooc/test_partial_backward.py",
           "tests/ooc/test_model_copies.py", "tests/ooc/test_data_sized.py", "tests/ooc/test_budget_covers_step.py"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent.parent,
                              timeout=max(30, min(300, left - 60)))
    except subprocess.TimeoutExpired:
        return ["did not finish within its time limit (not a verdict)"]
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    return [f"`{' '.join(cmd[3:6])} ...`: exit {proc.returncode}", "", "```", *tail, "```"]


def _guarded(fn, *a) -> list[str]:
    try:
        return fn(*a)
    except Exception:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        return [f"FAILED: `{tb.strip().splitlines()[-1]}`"]


if __name__ == "__main__":
    sys.exit(main())
