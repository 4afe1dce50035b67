"""A model whose ops change from step to step at random: LayerDrop, each residual block
skipped with probability 0.3 in training (as wav2vec2's configuration does by default, 0.1).

No plan holds past the step it was made from: the next step skips other blocks and leaves it.
Every step was planned from (15 plans in 16 steps: the first chooses the chunk), each plan left
at the next step, and on a GPU planning takes longer than a step. Now, after ``REPLAN_STREAK`` steps in a row that kept
no plan, the engine plans from one only at doubling intervals (``scheduler.step_plans.
plans_again``); the steps between run the last plan to where they leave it, then on demand.
At the streak's first such point the step drops its plan instead, once (``Decision.trace``):
the next step records with its hook trace, and its plan is made there with its anchored form
(which the next skipped block leaves). Bitwise as in core throughout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from scheduler.step_plans import REPLAN_STREAK, plans_again

STEPS = 16


class _LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
                                    for _ in range(8))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if self.training and torch.rand(()) < 0.3:
                continue
            h = h + block(h)
        return self.head(h)


def _train(model: nn.Module, managed: bool) -> list[int]:
    """Train STEPS steps (under an engine where ``managed``); the plans made so far after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ooc.OutOfCore(model, opt, budget=6 << 20) if managed else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.manual_seed(2)   # which blocks each step skips: the same draws in both runs
    plans = []
    for _ in range(STEPS):
        with engine.step() if engine is not None else torch.enable_grad():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if engine is not None:
            plans.append(engine.stats()["plans"])
    if engine is not None:
        engine.close()
    return plans


def test_a_model_whose_ops_change_at_random_is_planned_from_at_doubling_intervals() -> None:
    ref = _LayerDrop()
    model = copy.deepcopy(ref)
    _train(ref, False)
    plans = _train(model, True)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    made = [b - a for a, b in zip([0] + plans, plans)]   # 1 where a step was planned from
    # The first step chooses the chunk (the next records again); then no step keeps a plan:
    # planned from at 0, 1, 2, 4 (the traced recording: at 3 the plan was dropped for it), 6,
    # 10 steps in a row unkept (15 before).
    assert made[0] == 0 and made[1:7] == [1, 1, 1, 0, 1, 0], made
    assert made[1:] == [int(plans_again(n) and n != REPLAN_STREAK) for n in range(STEPS - 1)], made
