"""A budget either works or is refused at the first step with ``BudgetTooSmall``.

A step of the same shape that the engine accepted once never runs out of budget later, and no
internal error reaches the user mid-training (issue 40). How it broke:

- the anchored form of a plan is sought at lower budgets, lowered by what it went over; an
  anchored form that went over by more than the whole budget lowered it below zero, and
  ``scheduler.plan`` raised ``ValueError`` mid-training.

Each run is compared with in-core training, bit for bit. Models are small so the file runs in
seconds.
"""

from __future__ import annotations

import pytest
import torch

import ooc
from ooc import models

pytestmark = pytest.mark.timeout(300)

CNN = dict(width=16, blocks=1)   # a stem and one block: 16-channel convolutions with BatchNorm


def _train(name: str, shape: dict, batch: int, steps: int, stats: list | None = None,
           **engine_args) -> tuple[dict, list[dict]]:
    """``steps`` AdamW steps of model ``name``; in core without ``engine_args``. Returns the
    final state dict and, out of core, each step's ``stats()`` (appended to ``stats`` as the
    steps end, where given)."""
    torch.manual_seed(0)
    model = models.get(name, **shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = models.loss_fn(name)
    engine = ooc.OutOfCore(model, optimizer, **engine_args) if engine_args else None
    stats = [] if stats is None else stats
    for i in range(steps):
        x, y = models.example_batch(name, batch, "cpu", seed=100 + i, **shape)
        torch.manual_seed(1000 + i)
        if engine is None:
            _one_step(model, optimizer, loss_fn, x, y)
            continue
        with engine.step():
            _one_step(model, optimizer, loss_fn, x, y)
        stats.append(engine.stats())
    if engine is not None:
        engine.close()
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


def _one_step(model, optimizer, loss_fn, x, y) -> None:
    loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _assert_same(expected: dict, got: dict) -> None:
    for name, x in expected.items():
        assert torch.equal(x, got[name]), f"{name} differs from in-core training"


def test_an_anchored_form_over_the_whole_budget_leaves_the_per_op_plan() -> None:
    """At 4 MiB the anchored form of the CNN's plan holds more than the budget can give up:
    no anchored form, the per-op plan goes on. Before: step 3 raised ``ValueError: budget must
    be positive`` from ``scheduler.plan``, called at a budget lowered below zero."""
    steps = 6
    got, stats = _train("small_cnn", CNN, 8, steps, budget=4 << 20)
    assert all(s["last_planned"] == 1 for s in stats[2:])
    assert stats[-1]["anchored_steps"] == 0
    _assert_same(_train("small_cnn", CNN, 8, steps)[0], got)
