"""Issue 16, item 1: in-place writes to managed gradients through foreach and ``out=`` ops.

Between the backward and the optimizer step users rewrite gradients in place: gradient
clipping (``clip_grad_norm_`` and ``clip_grad_value_`` use foreach ops by default, which write
a ``Tensor(a!)[]`` list), ``torch._foreach_mul_`` and ``torch.mul(g, s, out=g)`` (the written
tensor is a keyword-only argument). With gradients managed, the engine must see each of those
writes: a gradient it believes unchanged since its last swap-out is dropped instead of
written, and the write is lost. Checked bitwise against in-core training, over planned steps
that swap gradients out and back in around the write.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc.engine import Options, OutOfCore
from scheduler.ir import Kind
from scheduler.schedule import Op
from test_reliability import CHUNK, _one_torch_thread, assert_same, state_of  # noqa: F401

STEPS = 4
GRADS = ("activations", "grads")
GRADS_STATE = ("activations", "grads", "optimizer_state")
# Budgets (KiB) at which the plan swaps gradients: with grads alone, during the backward (the
# 512 KiB gradient is born while the 512 KiB activation it needs is resident); with the
# optimizer state too, after the rewrite, to make room for the state of the update.
BUDGET_KIB = {(GRADS, "sgd"): 1100, (GRADS, "adam"): 1100,
              (GRADS_STATE, "sgd"): 1200, (GRADS_STATE, "adam"): 1600}


def fresh(opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose gradients dominate and whose rewrite fits the budget (a foreach op needs
    every gradient at once), while the backward and the update do not fit with all of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 512), nn.ReLU(),
                          nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    if opt == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)


def _rewrite_grads(model: nn.Module, form: str) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if form == "clip_grad_norm_":   # foreach=True by default: _foreach_mul_ on the list
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)   # below the norm: it scales
    elif form == "clip_grad_value_":   # foreach: _foreach_clamp_min_ / _foreach_clamp_max_
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    elif form == "_foreach_mul_":
        torch._foreach_mul_(grads, 0.5)
    else:   # out=: the written tensor arrives as a keyword argument
        for g in grads:
            torch.mul(g, 0.5, out=g)


def _train(opt_name: str, form: str, engine_kw: dict | None):
    model, opt = fresh(opt_name)
    engine = OutOfCore(model, opt, options=Options(chunk=CHUNK, min_bytes=4096), **engine_kw) if engine_kw else None
    for step in range(STEPS):
        x, y = batch(step)
        if engine is None:
            F.cross_entropy(model(x), y).backward()
            _rewrite_grads(model, form)
            opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        with engine.step():
            F.cross_entropy(model(x), y).backward()
            _rewrite_grads(model, form)
            engine.optimizer_step()
    return model, opt, engine


@pytest.mark.parametrize("manage", [GRADS, GRADS_STATE], ids=["grads", "grads+state"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("form", ["clip_grad_norm_", "clip_grad_value_", "_foreach_mul_", "mul_out"])
def test_in_place_grad_writes_through_lists_and_out_are_kept(form: str, opt: str, manage) -> None:
    ref_model, ref_opt, _ = _train(opt, form, None)
    budget = BUDGET_KIB[manage, opt] << 10
    model, o, engine = _train(opt, form, {"budget": budget, "manage": manage})
    stats = engine.stats()
    # Step 0 records; the optimizer's first update differs from later ones (SGD creates its
    # momentum buffers by clone, Adam its state): at most one re-plan, then planned steps.
    assert stats["last_planned"] == 1 and stats["plans"] <= 2, stats
    seq = engine._plans.schedule.sequence
    rewrite = min(i for i, f in enumerate(seq.functions)
                  if f.name.startswith(("aten._foreach", "aten.mul.out")))
    grad_ins = [i for i, acts in enumerate(engine._plans.schedule.before) for a in acts
                if a.op is Op.SWAP_IN and seq.variables[a.var].kind is Kind.GRAD]
    assert grad_ins, "the plan must move gradients for this test to mean anything"
    if manage == GRADS_STATE:
        assert max(grad_ins) > rewrite, "a gradient must come back from the tier after its rewrite"
    got = state_of(model, o, engine)
    engine.close()
    assert_same(state_of(ref_model, ref_opt), got, f"{form}, {opt}")
