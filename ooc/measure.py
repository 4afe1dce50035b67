"""Measure training honestly: each case in a fresh process, memory from the kernel.

Why a subprocess per case: the process's peak resident set (VmHWM) is the only memory
figure that counts what PyTorch, the allocator, the page cache mappings and ooc's own pool
really took, and it only ever grows. A fresh process per case, with the peak reset (``echo
5 > /proc/self/clear_refs``) once model, optimizer and data are built, gives "the memory
training needs" as ``peak_rise_bytes``; ``peak_total_bytes`` is the whole process beside it.

Methods: ``incore`` (plain PyTorch), ``ooc`` (``OutOfCore`` under ``budget``),
``checkpoint`` (``torch.utils.checkpoint`` around every block) and ``checkpoint2`` (every
other block). Every case trains the same batches from the same seed, so final parameters
can be compared bit for bit (``params_out``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Callable

METHODS = ("incore", "ooc", "checkpoint", "checkpoint2")


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    method: str
    steps: int = 5
    budget: int | None = None
    manage: tuple[str, ...] = ("activations",)
    optimizer: str = "sgd"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    storage: str | None = None
    chunk: int = 2 << 20
    threads: int = 2
    params_out: str | None = None
    seed: int = 0
    policy: str = "window"
    recompute: str = "auto"   # OutOfCore's: "never" swaps only
    update_in_backward: bool = False   # each parameter's update in its grad hook (``update_in_backward``)
    hook_steps: bool = True   # ``Options.hook_steps``: False keeps every planned step per op
    budget_covers: str = "managed"   # ``Options.budget_covers``: "step" bounds every tensor of the step
    # The peak is also read from this step on (``steady_peak_rise_bytes``; 0: not apart): the
    # steps before it record and plan, which a budget for the whole step does not bound.
    steady_from: int = 0


@dataclass(frozen=True)
class CaseResult:
    case: Case
    step_s: tuple[float, ...]
    baseline_rss_bytes: int
    peak_rise_bytes: int
    peak_total_bytes: int
    losses: tuple[float, ...]
    stats: dict[str, Any] | None   # ooc engine stats, for method "ooc"
    # What the engine counted in each step (``COUNTED``), for method "ooc": a settled plan may
    # run anchored (swapping what its per-op form recomputes where no template reruns it), so
    # the plan's bytes (``stats``' ``plan.*``) need not be what the steps moved.
    counted: tuple[dict[str, int], ...] = ()
    steady_peak_rise_bytes: int | None = None   # from step ``Case.steady_from`` on, where asked
    # File-backed pages the steps paged in before step ``Case.steady_from`` (the libraries'
    # code that training runs for the first time: ~21 MiB of libtorch_cpu.so for a small CNN,
    # in core as in ooc). VmHWM counts them; they are clean and reclaimable, and no budget of
    # tensors bounds them. None: not asked, or /proc says no RssFile.
    steady_code_rise_bytes: int | None = None

    @property
    def median_step_s(self) -> float:
        """Median over ``steady_steps``: warm-up steps would count ooc's recording and planning."""
        steps = steady_steps(len(self.step_s))
        return median(self.step_s[steps.start:steps.stop])

    def median_counted(self, *keys: str) -> float | None:
        """The median over ``steady_steps`` of the sum of ``keys`` counted per step (None
        without counts: no engine)."""
        steps = steady_steps(len(self.counted))
        sums = [sum(c[k] for k in keys) for c in self.counted[steps.start:steps.stop]]
        return median(sums) if sums else None


#: Every engine ``engine_for`` makes checksums its swapped bytes (``bench_cpu``'s verify rows).
VERIFY = False

#: The engine's counters (``OutOfCore.stats()``) a measuring child reads after each step.
COUNTED = ("bytes_in", "bytes_out", "bytes_recomputed", "steps.anchored", "steps.plain")


class StepCounts:
    """What the engine counted in each step (``COUNTED``): ``record(engine)`` after each step
    turns the engine's running totals into that step's own figures, in ``steps``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._totals = dict.fromkeys(COUNTED, 0)

    def record(self, engine: Any) -> None:
        now = engine.stats()
        self.steps.append({k: now[k] - self._totals[k] for k in COUNTED})
        self._totals = {k: now[k] for k in COUNTED}


def steady_steps(n: int) -> range:
    """Which of ``n`` steps (0-based) a step time is the median of: the first four (warm-up:
    ooc's recording, its one re-plan for lazily created optimizer state, and on a CPU the
    plan's first two runs, after each of which it is priced again on the fastest op times so
    far) are left out when at least four remain; else the first three when three remain,
    else the first two when two remain, else the first only, else none (what a report must
    say it did)."""
    if n > 7:
        return range(4, n)
    if n > 5:
        return range(3, n)
    if n > 3:
        return range(2, n)
    return range(1, n) if n > 1 else range(n)


def child_env() -> dict[str, str]:
    """The environment of every measuring child: the caller's, untouched.

    Each method runs as its users run it: in-core training and checkpointing with PyTorch's
    and glibc's defaults, ooc with what ``OutOfCore`` sets up inside its own process (its
    recycling CPU allocator, or glibc's mmap threshold where that cannot be built). An
    earlier harness fixed glibc's mmap threshold at 1 MiB for every method "for fairness";
    on the measuring machine that made plain PyTorch ~30% slower (every large tensor on
    fresh, kernel-zeroed pages) and flattered ooc's step-time ratios.
    """
    return dict(os.environ)


def run_case(case: Case, *, on_step: Callable[[int], None] | None = None,
             timeout: float = 1800) -> CaseResult:
    """Run ``case`` in a fresh Python process and return what it measured."""
    if case.method not in METHODS:
        raise ValueError(f"method {case.method!r} is not one of {METHODS}")
    cmd = [sys.executable, "-m", "ooc.measure", json.dumps(asdict(case))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    result = None
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("OOC-STEP ") and on_step is not None:
            on_step(int(line.split()[1]))
        elif line.startswith("OOC-RESULT "):
            result = json.loads(line[len("OOC-RESULT "):])
        if time.monotonic() > deadline:
            proc.kill()
            break
    err = proc.stderr.read() if proc.stderr else ""
    code = proc.wait()
    if code != 0 or result is None:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {code}"
        from ooc.errors import OOCError

        raise OOCError(f"{case.method} case of {case.model} (batch {case.batch}) failed: {last}")
    return case_result(case, result)


def case_result(case: Case, result: dict[str, Any]) -> CaseResult:
    """The ``CaseResult`` of a measuring child's ``OOC-RESULT`` line (parsed)."""
    return CaseResult(case=case, step_s=tuple(result["step_s"]),
                      baseline_rss_bytes=result["baseline_rss"], peak_rise_bytes=result["peak_rise"],
                      peak_total_bytes=result["peak_total"], losses=tuple(result["losses"]),
                      stats=result.get("stats"), counted=tuple(result.get("counted", ())),
                      steady_peak_rise_bytes=result.get("steady_peak_rise"),
                      steady_code_rise_bytes=result.get("steady_code_rise"))


# -- the child process ---------------------------------------------------------------------


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmHWM:", "VmRSS:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def train_step(model, optimizer, engine, loss_fn, x, y, *, in_backward: bool = False):
    """One training step, in plain PyTorch or under ``engine``: the same ops either way, so
    the two can be compared bit for bit. ``in_backward``: the updates run inside the
    backward (``update_in_backward`` set them up), so there is no step after it. Returns
    the loss."""
    if engine is None:
        loss = loss_fn(model(x), y)
        loss.backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        with engine.step():
            loss = loss_fn(model(x), y)
            loss.backward()
            if not in_backward:
                engine.optimizer_step()
    return loss


def update_in_backward(model, optimizer) -> None:
    """PyTorch's recipe for the update inside the backward: each parameter's update runs in
    its post-accumulate-grad hook (``step()`` updates only the parameters that have a
    gradient, and the hook then drops it), so no parameter's gradient waits for the others.
    Parameters come out bitwise as from ``step()`` after the backward when the optimizer's
    per-tensor arithmetic does not depend on its batch of tensors (SGD and Adam here)."""
    def update(p) -> None:
        optimizer.step()
        p.grad = None

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(update)


def engine_for(case: Case, model, optimizer, **extra: Any):
    """The case's engine (None unless its method is ``ooc``; ``extra``: more ``OutOfCore``
    options), and after it, when the case asks, the update inside the backward: its hooks
    must run after the engine's own gradient hooks. Shared by every measuring child."""
    import ooc

    engine = None
    if case.method == "ooc":
        options = {k: extra.pop(k) for k in list(extra) if k in ooc.Options.__dataclass_fields__}
        if VERIFY:
            options["verify"] = True
        if not case.hook_steps:
            options["hook_steps"] = False
        if case.budget_covers != "managed":
            options["budget_covers"] = case.budget_covers
        engine = ooc.OutOfCore(model, optimizer, budget=case.budget, manage=case.manage,
                               storage=case.storage, recompute=case.recompute,
                               options=ooc.Options(chunk=case.chunk, threads=case.threads, **options), **extra)
        if case.policy != "window":   # a research planner (benchmarks' baselines): not the API's
            engine._planner.policy = case.policy
    if case.update_in_backward:
        update_in_backward(model, optimizer)
    return engine


def checkpoint_blocks(model, every: int = 1) -> int:
    """Wrap every ``every``-th block of a zoo model in ``torch.utils.checkpoint``.

    A block is a residual/dense/transformer unit (the modules whose class name says so);
    for VGG, each conv-ReLU(-pool) run of ``features``. Returns how many were wrapped.
    """
    import functools

    import torch.utils.checkpoint as cp
    from torch import nn

    names = ("Bottleneck", "_DenseLayer", "Block", "ConvBlock", "DoubleConv")
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks and hasattr(model, "features") and isinstance(model.features, nn.Sequential):
        blocks = _vgg_runs(model.features)
    chosen = blocks[::every]
    for m in chosen:
        m.forward = functools.partial(cp.checkpoint, m.forward, use_reentrant=False)
    return len(chosen)


def _vgg_runs(features):
    """Group a VGG ``features`` Sequential into conv+activation(+pool) modules in place."""
    from torch import nn

    groups, current = [], []
    for layer in features:
        if isinstance(layer, nn.Conv2d) and current:
            groups.append(current)
            current = []
        current.append(layer)
    if current:
        groups.append(current)
    runs = [nn.Sequential(*g) for g in groups]
    features._modules.clear()
    for k, run in enumerate(runs):
        features.add_module(str(k), run)
    return runs


def build(case: Case) -> tuple[Any, Any, Any, Any, Callable]:
    """The case's model, optimizer, batch and loss, from its seed: every measuring child
    (this module's and bench_nntrainer's) trains exactly the same thing, so results compare
    bit for bit. Returns ``(model, optimizer, x, y, loss_fn)``."""
    import torch

    from ooc import models

    torch.manual_seed(case.seed)
    model = models.get(case.model, **case.model_kwargs)
    if case.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = models.example_batch(case.model, case.batch, "cpu", seed=case.seed, **case.model_kwargs)
    return model, opt, x, y, models.loss_fn(case.model)


def _child(spec: dict[str, Any]) -> None:
    import torch

    case = Case(**{**spec, "manage": tuple(spec["manage"])})
    model, opt, x, y, loss_fn = build(case)
    if case.method.startswith("checkpoint"):
        checkpoint_blocks(model, every=2 if case.method == "checkpoint2" else 1)
    engine = engine_for(case, model, opt)
    before = _status()
    exact = _reset_peak()
    after_reset = _status()
    baseline = after_reset["VmRSS"] if exact else before["VmHWM"]
    times, losses = [], []
    counts = StepCounts()
    earlier = None   # the peak of the steps before ``steady_from``
    code = None      # the file-backed pages those steps paged in
    for step in range(case.steps):
        if exact and case.steady_from and step == case.steady_from:
            now = _status()
            earlier = now["VmHWM"]
            if "RssFile" in now and "RssFile" in after_reset:
                code = now["RssFile"] - after_reset["RssFile"]
            _reset_peak()
        torch.manual_seed(case.seed + 1 + step)
        t0 = time.perf_counter()
        loss = train_step(model, opt, engine, loss_fn, x, y, in_backward=case.update_in_backward)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if engine is not None:
            counts.record(engine)
        print(f"OOC-STEP {step}", flush=True)
    steady = peak = _status()["VmHWM"]
    peak = max(peak, earlier or 0)
    stats = engine.stats() if engine is not None else None
    if engine is not None:
        engine.close()
    if case.params_out:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, case.params_out)
    print("OOC-RESULT " + json.dumps({
        "step_s": times, "baseline_rss": baseline, "peak_rise": peak - baseline,
        "peak_total": peak, "losses": losses, "stats": stats, "counted": counts.steps,
        "steady_peak_rise": steady - baseline if earlier is not None else None,
        "steady_code_rise": code}, default=str),
        flush=True)


def same_parameters(path_a: str, path_b: str) -> bool:
    """Bitwise comparison of two saved state dicts (loaded with ``weights_only``)."""
    import torch

    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


if __name__ == "__main__":  # the child side of run_case
    _child(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)


def managed_peak(model: str, batch: int, *, manage: tuple[str, ...] = ("activations",),
                 optimizer: str = "sgd", chunk: int = 2 << 20, min_bytes: int | None = None,
                 model_kwargs: dict[str, Any] | None = None) -> int:
    """In-core peak of the tensors ``OutOfCore`` would manage, from a trace on ``meta``.

    Same rules as the engine: tensors below ``min_bytes`` (default chunk / 2) stay with
    PyTorch, and activations are counted in whole chunks (they come back into pool ranges).
    """
    import torch

    from ooc import models
    from ooc.trace import trace
    from scheduler.managed import kinds_of, managed_view

    kw = model_kwargs or {}
    with torch.device("meta"):
        net = models.get(model, **kw)
    x, y = models.example_batch(model, batch, "meta", **kw)
    seq = trace(net, x, targets=y, loss_fn=models.loss_fn(model), optimizer=optimizer, device="meta")
    floor = chunk // 2 if min_bytes is None else min_bytes
    return managed_view(seq, kinds_of(manage), min_bytes=floor, chunk=chunk).in_core_peak_bytes
