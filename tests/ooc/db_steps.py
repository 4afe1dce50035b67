"""One sample of PyTorch's own test databases, trained in core and under the engine.

``tests/ooc/test_module_db.py`` and ``tests/ooc/test_op_db.py`` run the samples of
``torch.testing._internal``'s ``module_db`` and ``op_db`` through ``compare``: the sample as
a module (an op's dense float inputs that require grad become its parameters), a loss that
weighs every differentiable float output with fixed weights (all ones would hide a wrong
gradient that sums to the right one), an SGD step with momentum, the global generator seeded
the same before each step (dropout, ``rrelu``, ``FractionalMaxPool``).

Why these steps. A first step in core makes the momentum buffers, so that the engine's steps
start with optimizer state to manage. Then two steps inside ``OutOfCore``: the first records
(on demand: each saved activation is written out at once and brought back at its use), the
second runs the plan (``stats()["last_planned"]``). The budget is the smallest that plans
(the engine names it: ``BudgetTooSmall.minimum``), with 4 KiB chunks and ``min_bytes=1``, so
that every tensor of these tiny samples is managed and as much as can move does. The plan's
choice is forced (``CONFIGS``): ``recompute="never"`` swaps only, ``"prefer"`` recomputes all it
can; with activations managed, or every kind.

After each step the loss, every gradient (inputs', then parameters', read before the update:
a gap of one ulp can round away in it), the parameters and the buffers must be bitwise those
of in-core training, or, for the few ops PyTorch computes another way whenever any
``TorchDispatchMode`` is active (GUARANTEES.md), those of in-core training under a no-op mode.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ooc import FORMS as FORMS_HOOKED
from ooc.engine import Options, OutOfCore
from scheduler.errors import BudgetTooSmall

ALL = ("activations", "params", "grads", "optimizer_state")
# (recompute, manage): the plan's choice forced each way, activations alone and every kind.
CONFIGS = {"swap": ("never", ("activations",)), "prefer": ("prefer", ("activations",)),
           "swap-all": ("never", ALL), "prefer-all": ("prefer", ALL)}
# A setting's "@step" suffix ("prefer@step"): under a budget for the whole step
# (``Options(budget_covers="step")``), the smallest the engine names, over every tensor of the step.
WHOLE_STEP = "prefer@step"
ENGINE_STEPS = 2
# The template form (ooc/runtime/templates.py): recompute="auto" with plans that recompute
# whatever the machine's load and every anchored form's trial kept (its verdict is a timing);
# enough steps for a plan to settle its prices, capture its templates and run at the hooks.
# At the smallest budget an anchored form, which holds bytes longer, often does not fit; a
# chunk above it the whole step often does: each setting -> the chunks above the smallest.
TEMPLATES = {"templates": 0, "templates+1": 1}
TEMPLATE_STEPS = 8
FULL = os.environ.get("OOC_DB_FULL") == "1"   # every sample under every setting (~10 minutes)
LR = 0.01
CHUNK = 4096


class Skip(Exception):
    """The sample does not train in core (or has nothing to train): skipped, with why."""


@dataclass
class Sample:
    """A module to train and how to call it: ``run(module, inputs)`` is the forward, on the
    inputs ``inputs()`` makes afresh for each run (leaf tensors, ``requires_grad`` as given)."""

    name: str
    module: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    run: Callable[[nn.Module, Any], Any]


def fresh(x: Any) -> Any:
    """A copy of every tensor in ``x``, as a new leaf with the same ``requires_grad``."""
    def copy_leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if c.is_floating_point() or c.is_complex() else c
    return tree_map(copy_leaf, x)


def _weights(t: torch.Tensor) -> torch.Tensor:
    """Fixed, distinct weights for an output (no generator: a replay must not move one)."""
    n = t.numel()
    return torch.cos(torch.arange(n, dtype=torch.float64) * 0.7 + 0.3).to(t.dtype).reshape(t.shape)


def loss_of(out: Any) -> torch.Tensor | None:
    """Every differentiable float output, weighed and summed; None if there is none."""
    total = None
    for t in tree_leaves(out):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())
        if not t.is_floating_point():
            continue
        term = (t * _weights(t)).sum()
        total = term if total is None else total + term
    return total


def _grads(inputs: Any) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.detach().clone()
            for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def _train_step(sample: Sample, module: nn.Module, opt: torch.optim.Optimizer, seed: int,
                engine: OutOfCore | None, mode: Callable[[], Any] | None = None) -> dict:
    inputs = fresh(sample.inputs())
    torch.manual_seed(seed)
    opt.zero_grad()   # before the step: each starts as the one the plan was recorded from
    with engine.step() if engine is not None else (mode or contextlib.nullcontext)():
        loss = loss_of(sample.run(module, inputs))
        if loss is None:
            raise Skip("no differentiable float output")
        loss.backward()
        grads = _grads(inputs) + _grads(list(module.parameters()))   # a tiny gap can round away in the update
        opt.step()
    return {"loss": loss.detach().clone(), "grads": grads, "state": _state(module)}


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:   # a module without parameters still steps (nothing to update)
        params = [nn.Parameter(torch.zeros(1))]
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _warm(sample: Sample) -> tuple[nn.Module, dict]:
    """The sample's module after one in-core step (momentum buffers made), and that step."""
    torch.manual_seed(0)
    module = sample.module()
    opt = _optimizer(module)
    first = _train_step(sample, module, opt, 10, None)
    return module, {"module": module, "opt": opt, "first": first}


def _train(sample: Sample, warm: dict, engine_kw: dict | None,
           mode: Callable[[], Any] | None = None, n: int = ENGINE_STEPS) -> tuple[list[dict], dict]:
    module = copy.deepcopy(warm["module"])
    opt = _optimizer(module)
    opt.load_state_dict(copy.deepcopy(warm["opt"].state_dict()))   # load_state_dict shares tensors
    kw = dict(engine_kw or {})
    options = Options(chunk=CHUNK, min_bytes=1, budget_covers=kw.pop("budget_covers", "managed"))
    engine = OutOfCore(module, opt, options=options, **kw) if engine_kw else None
    try:
        steps, recomputed = [], 0
        for k in range(n):
            steps.append(_train_step(sample, module, opt, 11 + k, engine, mode))
            if engine is not None:   # what the hook-driven steps recomputed (the template form)
                now = engine.stats()
                if FORMS_HOOKED[now["last_form"]] == "anchored":
                    recomputed += now["bytes_recomputed"] - before
                before = now["bytes_recomputed"]
            else:
                before = 0
        stats = {**engine.stats(), "anchored_recomputed": recomputed} if engine is not None else {}
    finally:
        if engine is not None:
            engine.close()
    return steps, stats


@contextlib.contextmanager
def _templates_forced() -> Any:
    """What ``TEMPLATES`` forces (``test_anchored_steps.templates_forced``): plans that
    recompute whatever the machine's load, every trial kept."""
    from unittest import mock

    from test_anchored_steps import templates_forced

    with contextlib.ExitStack() as stack:
        templates_forced(lambda obj, name, value: stack.enter_context(mock.patch.object(obj, name, value)))
        yield


def reference(sample: Sample, mode: Callable[[], Any] | None = None,
              n: int = ENGINE_STEPS) -> tuple[dict, list[dict]]:
    """The warm state and ``n`` in-core steps (each inside ``mode()`` if given); ``Skip`` if
    the sample fails in core."""
    try:
        _, warm = _warm(sample)
        steps, _ = _train(sample, warm, None, mode, n)
    except Skip:
        raise
    except Exception as exc:  # noqa: BLE001 - what PyTorch itself cannot train is skipped
        raise Skip(f"fails in core: {type(exc).__name__}: {str(exc)[:160]}") from exc
    return warm, steps


def smallest_budget_run(sample: Sample, warm: dict, engine_kw: dict, n: int = ENGINE_STEPS,
                        slack: int = 0) -> tuple[int, list[dict], dict]:
    """The ``n`` steps under the smallest budget the engine plans this sample under: from one
    chunk up, each time to the minimum the engine names (a smaller budget records another
    step, whose minimum may be larger); ``slack`` chunks above it."""
    budget = CHUNK * (1 + slack)
    for _ in range(8):
        try:
            steps, stats = _train(sample, warm, {**engine_kw, "budget": budget}, n=n)
        except BudgetTooSmall as err:
            budget = max(err.minimum + slack * CHUNK, budget + CHUNK)
            continue
        return budget, steps, stats
    raise AssertionError(f"{sample.name}: no budget up to {budget} B plans")


class _NoOp(TorchDispatchMode):
    """A dispatch mode that only runs each op: what PyTorch computes under any mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def compare(sample: Sample, config: str) -> dict:
    """Train ``sample`` in core and under the engine (``CONFIGS[config]``); raise
    ``AssertionError`` naming the first difference, ``Skip`` if it fails in core. Returns the
    engine's stats, and ``"under_a_mode"``: 1 if the engine matched in-core training run
    under a no-op dispatch mode instead (GUARANTEES.md: PyTorch computes a few ops another way
    whenever any ``TorchDispatchMode`` is active, and the engine's steps run under one)."""
    base, _, covers = config.partition("@")   # "templates@step": a setting under a budget for the whole step
    n = TEMPLATE_STEPS if base in TEMPLATES else ENGINE_STEPS
    warm, ref = reference(sample, n=n)
    recompute, manage = CONFIGS.get(base, ("auto", ("activations",)))
    kw = {"recompute": recompute, "manage": manage, **({"budget_covers": "step"} if covers == "step" else {})}
    with _templates_forced() if base in TEMPLATES else contextlib.nullcontext():
        budget, got, stats = smallest_budget_run(sample, warm, kw, n, slack=TEMPLATES.get(base, 0))
    where = f"{sample.name} [{config}, budget {budget} B]"
    gap = _difference(ref, got, where)
    if gap is None:
        return {**stats, "under_a_mode": 0}
    _, moded = reference(sample, _NoOp, n)
    if _difference(ref, moded, where) is None:   # PyTorch gives the same under a mode: ooc's gap
        raise AssertionError(gap)
    also = _difference(moded, got, where + " (against in core under a no-op dispatch mode)")
    assert also is None, also
    return {**stats, "under_a_mode": 1}


def run_chosen(pairs: list[tuple[Sample, str]]) -> list[dict]:
    """Compare each pair; every difference and crash is collected and reported together, a
    sample that fails in core is skipped (all of them skipped: the test is, with why).
    Returns the stats of each pair that ran."""
    problems, skipped, ran = [], [], []
    for sample, setting in pairs:
        try:
            stats = compare(sample, setting)
        except Skip as why:
            skipped.append(f"{sample.name}: {why}")
            continue
        except AssertionError as e:
            problems.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a crash under the engine is a finding too
            problems.append(f"{sample.name} [{setting}]: {type(e).__name__}: {e}")
            continue
        ran.append({**stats, "sample": sample.name.split("#")[0]})
        if stats["last_planned"] != 1:   # the last step must run the plan: the path is forced
            problems.append(f"{sample.name} [{setting}]: the last step did not run its plan")
    assert not problems, "\n".join(problems)
    if not ran:
        pytest.skip("; ".join(skipped))
    return ran


def _difference(ref: list[dict], got: list[dict], where: str) -> str | None:
    """The first difference between two runs' steps, said in words; None if bitwise equal."""
    for k, (a, b) in enumerate(zip(ref, got)):
        at = f"{where} step {k + 1}"
        if not _same(a["loss"], b["loss"]):
            return f"{at}: loss {a['loss'].item()} vs {b['loss'].item()}"
        for j, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            if not _same(ga, gb):
                return f"{at}: gradient {j} (inputs, then parameters) differs{_gap(ga, gb)}"
        for name, v in a["state"].items():
            if not _same(v, b["state"][name]):
                return f"{at}: {name} differs{_gap(v, b['state'][name])}"
    return None


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.layout != torch.strided or b.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():   # NaN where in core has NaN: the same bits
        return torch.equal(a, b) or bool(
            ((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _gap(a: Any, b: Any) -> str:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return ""
    try:
        d = (a.to_dense() - b.to_dense()).abs().max().item()
    except Exception:  # noqa: BLE001 - a message helper
        return ""
    return "" if math.isnan(d) else f" (max gap {d:.3g})"


class _Param:
    """Where an op sample's k-th differentiable input goes: the module's k-th parameter."""

    def __init__(self, k: int) -> None:
        self.k = k


def op_sample(name: str, op: Any, sample: Any) -> Sample:
    """An OpInfo sample as a module: its dense float inputs that require grad become the
    module's parameters (the optimizer updates them, ``manage`` may move them), the other
    inputs (indices, sparse tensors, tensors without grad) are passed to it at each step."""
    leaves = []

    def lift(t: Any) -> Any:
        if (isinstance(t, torch.Tensor) and t.requires_grad and t.layout == torch.strided
                and t.is_floating_point()):
            leaves.append(t)
            return _Param(len(leaves) - 1)
        return t

    call = tree_map(lift, (sample.input, sample.args, sample.kwargs))
    process = sample.output_process_fn_grad or (lambda out: out)

    def module() -> nn.Module:
        m = nn.Module()
        m.params = nn.ParameterList([nn.Parameter(t.detach().clone()) for t in leaves])
        return m

    def run(m: nn.Module, inputs: Any) -> Any:
        x, args, kwargs = tree_map(lambda a: m.params[a.k] if isinstance(a, _Param) else a, inputs)
        return process(op.gradcheck_wrapper(op.op, x, *args, **kwargs))

    return Sample(name, module, lambda: call, run)
