"""Opacus's DP-SGD, the engine given what its users make: a ``GradSampleModule`` (forward and
backward hooks on each layer keep its input, an alias of what autograd saves and the engine
swaps, and write each parameter's per-sample gradients, ``p.grad_sample``) and a
``DPOptimizer`` (it clips each sample's gradient, adds noise from the global generator, and
steps the optimizer it wraps). Bitwise as the same loop without the engine, with activations
managed and with every kind under a budget for the whole step, at the least budget the engine
names, the planner free to recompute.

``DPOptimizer``'s ``__init__`` skips ``Optimizer.__init__`` and keeps the user's optimizer as
``.original_optimizer``; given to the engine it was refused ("DPOptimizer has no step hooks
... and wraps no optimizer"), which looked for Accelerate's ``.optimizer`` only. The engine
now hooks the one ``Optimizer`` such a wrapper holds (``ooc.engine.arguments.stepped_optimizer``).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from test_reliability import ALL, _one_torch_thread  # noqa: F401
from test_user_idioms import at_the_least_budget

opacus = pytest.importorskip("opacus")


def _model() -> nn.Module:
    """GroupNorm, not BatchNorm: Opacus refuses BatchNorm, which mixes the samples."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(256, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))


def _trained(engine_kw: dict | None) -> tuple[tuple[list, dict, dict], dict]:
    """Four DP-SGD steps (in core where ``engine_kw`` is None): (losses, the model's state,
    the wrapped optimizer's state), and the engine's stats."""
    torch.manual_seed(0)
    model = opacus.GradSampleModule(_model())
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = opacus.optimizers.DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=16)
    engine = None if engine_kw is None else ooc.OutOfCore(model, opt, **engine_kw)
    g, losses = torch.Generator().manual_seed(1), []
    try:
        for i in range(4):
            x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            torch.manual_seed(100 + i)   # dropout's masks and the noise
            with engine.step() if engine is not None else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach().clone())
        with engine.resident() if engine is not None else contextlib.nullcontext():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return (losses, state, copy.deepcopy(sgd.state_dict())), {} if engine is None else engine.stats()
    finally:
        if engine is not None:
            engine.close()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("manage,covers", [(("activations",), "managed"), (ALL, "step")], ids=["activations", "all-step"])
def test_opacus_dp_sgd_trains_bitwise_at_the_least_budget(manage: tuple[str, ...], covers: str) -> None:
    (ref_losses, ref_state, ref_opt), _ = _trained(None)
    (losses, state, opt), stats = at_the_least_budget(
        lambda budget: _trained({"budget": budget, "manage": manage, "recompute": "auto",
                                 "options": ooc.Options(budget_covers=covers)}), "opacus")
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"the loss of step {i} differs: {a.item()} vs {b.item()}"
    for k, a in ref_state.items():
        assert torch.equal(a, state[k]), f"{k} differs"
    for i, s in ref_opt["state"].items():
        for k, a in s.items():
            assert torch.equal(a, opt["state"][i][k]), f"the optimizer's {k} of parameter {i} differs"
    assert stats["steps.planned"] + stats["steps.anchored"] > 0, "no step ran its plan"
    assert stats["bytes_out"] + stats["bytes_recomputed"] > 0, "the budget must make the plan act"


def test_a_wrapper_of_two_optimizers_without_step_hooks_is_refused() -> None:
    class Two(torch.optim.Optimizer):
        def __init__(self, a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:   # no step hooks
            self.a, self.b, self.param_groups = a, b, a.param_groups + b.param_groups

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    two = Two(torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1))
    with pytest.raises(ooc.OOCError, match="Two has no step hooks .* wraps 2 optimizers, not one"):
        ooc.OutOfCore(model, two, budget="1MiB")
