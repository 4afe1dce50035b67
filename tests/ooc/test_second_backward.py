"""Loops whose step runs backward twice over one graph: ``retain_graph=True`` with two losses,
and a gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then ``backward``).

Each saved activation is read by both backward passes, so a tensor recomputed for its use in
the first can still be resident when the second needs another that the planner chose to
recompute through it. The planner fixes a chain where it discards the variable; ``check``
refused such a chain (through an input that was back by the use) and every plan of the step
that held one was lost, with a warning per plan ("a window+recompute candidate is unsafe,
ignored"). Now it is proven as it is (``scheduler/actions.py``, ``_require_chain``). Each case
trains a residual CNN with BatchNorm and dropout in core and under the engine, bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc

STEPS = 4
BUDGET = 6 << 20   # of ~11 MiB of saved activations a step (batch 8, 16 x 32 x 32 each)
# on a GPU, the default options: 2 MiB chunks, tensors from 1 MiB managed; batch 8's 64-256 KiB
# activations stayed outside the budget and the plan moved nothing (the H200, 2026-11-28)
GPU_BATCH, GPU_BUDGET = 64, 24 << 20   # of ~88 MiB saved, each activation 4 MiB
ALL = ("activations", "params", "grads", "optimizer_state")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[_Block() for _ in range(8)], nn.Dropout(0.2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _retain_graph(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()


def _gradient_penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    g, = torch.autograd.grad(loss, x, create_graph=True)
    (loss + 0.1 * g.pow(2).sum()).backward()


LOOPS = {"retain_graph": _retain_graph, "gradient_penalty": _gradient_penalty}
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}


def _train(model: nn.Module, opt: torch.optim.Optimizer, loop, engine: ooc.OutOfCore | None,
           device: str = "cpu", batch: int = 8) -> None:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, device=device, generator=g)
    y = torch.randint(0, 10, (batch,), device=device, generator=g)
    torch.manual_seed(123)   # dropout's masks, the same in both runs
    for _ in range(STEPS):
        with engine.step() if engine is not None else contextlib.nullcontext():
            loop(model, x, y)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("manage", [("activations",), ALL], ids=["activations", "all"])
@pytest.mark.parametrize("loop,optimizer", [("retain_graph", "sgd"), ("gradient_penalty", "adam")])
def test_two_backward_passes_over_one_graph_train_bitwise_with_every_plan_proven(
        loop: str, optimizer: str, manage: tuple[str, ...], caplog: pytest.LogCaptureFixture) -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    _train(ref, ref_opt, LOOPS[loop], None)
    engine = ooc.OutOfCore(model, opt, budget=BUDGET, manage=manage)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        _train(model, opt, LOOPS[loop], engine)
    stats = engine.stats()
    engine.close()
    unsafe = [r.getMessage() for r in caplog.records if "unsafe" in r.getMessage()]
    assert not unsafe, unsafe[0]
    assert stats["steps.planned"] >= 1 and stats["steps.diverged"] == 0
    assert stats["plan.bytes_out"] + stats["plan.bytes_recomputed"] > 0, "the budget must make the plan act"
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(ref_opt.state.values(), opt.state.values()):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_a_gradient_penalty_on_the_cuda_path_over_the_fake_driver_is_bitwise() -> None:
    """FAKE DRIVER: the same loop with ``device="cuda"`` (``ooc.testing.fake_cuda``, the
    default arena), every driver call within the real driver's contract."""
    import ooc.testing

    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS["adam"](ref.parameters()), OPTIMIZERS["adam"](model.parameters())
    _train(ref, ref_opt, _gradient_penalty, None)
    with ooc.testing.fake_cuda() as driver:
        engine = ooc.OutOfCore(model, opt, device="cuda", budget=BUDGET)
        _train(model, opt, _gradient_penalty, engine)
        stats = engine.stats()
        engine.close()
        assert driver.violations == [], driver.violations
    assert stats["steps.planned"] >= 1 and stats["plan.bytes_out"] > 0
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("loop,optimizer", [("retain_graph", "sgd"), ("gradient_penalty", "adam")])
def test_gpu_two_backward_passes_train_bitwise(loop: str, optimizer: str) -> None:
    """REAL GPU (skips without one): the same loops on CUDA, cuDNN deterministic, the default
    arena, bitwise against the same loop without the engine."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    ref = _model().cuda()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    _train(ref, ref_opt, LOOPS[loop], None, device="cuda", batch=GPU_BATCH)
    engine = ooc.OutOfCore(model, opt, budget=GPU_BUDGET, device="cuda")
    _train(model, opt, LOOPS[loop], engine, device="cuda", batch=GPU_BATCH)
    stats = engine.stats()
    engine.close()
    assert stats["steps.planned"] >= 1 and stats["plan.bytes_out"] + stats["plan.bytes_recomputed"] > 0
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
