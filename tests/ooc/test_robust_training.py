"""Steps that run the model several times: sharpness-aware minimization (SAM: a forward and
backward, the weights moved along the gradient in place, a second forward and backward, the
weights moved back, then the update) and PGD adversarial training (three forwards, each with
``torch.autograd.grad`` of the loss by the input's perturbation, then a clean and an
adversarial loss backward together). Both are how outside users write them (no ooc API); each
trains a residual CNN with BatchNorm and dropout in core and under the engine, bitwise, with
activations managed and with every kind, the planner free to recompute.

What it found, fixed: the engine held what the first backward's last node unpacked until the
update, through SAM's whole second forward, where each of its working sets counted it (the
least budget 2 MiB where one forward and backward needs 1.5).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from scheduler.errors import BudgetTooSmall
from test_reliability import assert_same, state_of
from test_second_backward import ALL, BUDGET, OPTIMIZERS, _model

STEPS = 4


def _sam(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()
        moved = {}
        for p in model.parameters():
            if p.grad is not None:
                moved[p] = p.grad * (0.05 / (norm + 1e-12))
                p.add_(moved[p])
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p, e in moved.items():
            p.sub_(e)


def _pgd(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    delta = torch.zeros_like(x).uniform_(-0.03, 0.03).requires_grad_(True)
    for _ in range(3):
        g, = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
        delta = (delta + 0.01 * g.sign()).clamp(-0.03, 0.03).detach().requires_grad_(True)
    (F.cross_entropy(model(x + delta.detach()), y) + 0.5 * F.cross_entropy(model(x), y)).backward()


LOOPS = {"sam": _sam, "pgd": _pgd}


def _train(model: nn.Module, opt: torch.optim.Optimizer, loop, engine: ooc.OutOfCore | None) -> None:
    g = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        torch.manual_seed(100 + i)   # dropout's masks and PGD's start, the same in both runs
        with engine.step() if engine is not None else contextlib.nullcontext():
            loop(model, opt, x, y)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("manage", [("activations",), ALL], ids=["activations", "all"])
@pytest.mark.parametrize("loop,optimizer", [("sam", "sgd"), ("pgd", "adam")])
def test_steps_that_run_the_model_several_times_train_bitwise(loop: str, optimizer: str,
                                                              manage: tuple[str, ...]) -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    _train(ref, ref_opt, LOOPS[loop], None)
    engine = ooc.OutOfCore(model, opt, budget=BUDGET, manage=manage)
    _train(model, opt, LOOPS[loop], engine)
    stats = engine.stats()
    engine.close()
    assert stats["steps.planned"] >= 1, stats["steps.planned"]
    assert stats["plan.bytes_out"] + stats["bytes_recomputed"] > 0, "the budget must make the plan act"
    assert_same(state_of(ref, ref_opt), state_of(model, opt), f"{loop} {'+'.join(manage)}")


def _one_pass(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def _least_budget(loop) -> int:
    """The least budget the engine names for ``loop``'s steps, activations managed."""
    model = _model()
    opt = OPTIMIZERS["sgd"](model.parameters())
    engine = ooc.OutOfCore(model, opt, budget="4KiB", manage=("activations",))
    try:
        with pytest.raises(BudgetTooSmall) as refused:
            _train(model, opt, loop, engine)
    finally:
        engine.close()
    return refused.value.minimum


def test_a_second_forward_needs_no_more_budget_than_the_first() -> None:
    """The first backward is over when an op runs outside every autograd node: what its last
    node unpacked is free from there, not held through SAM's second forward to the update.
    At the least budget of one forward and backward, SAM trains bitwise."""
    least = _least_budget(_one_pass)
    assert _least_budget(_sam) == least
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS["sgd"](ref.parameters()), OPTIMIZERS["sgd"](model.parameters())
    _train(ref, ref_opt, _sam, None)
    engine = ooc.OutOfCore(model, opt, budget=least, manage=("activations",))
    _train(model, opt, _sam, engine)
    engine.close()
    assert_same(state_of(ref, ref_opt), state_of(model, opt), "sam at the least budget")
