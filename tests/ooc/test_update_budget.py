"""Issue 16, item 4: a budget too small for the first update fails before anything changes.

The recording step runs the optimizer on demand: each of its ops needs the managed tensors it
touches resident at once, and so do the storages the optimizer creates (its state, and
temporaries such as Adam's denominator). With everything managed, an Adam MLP whose largest
parameter, its ``exp_avg`` and the denominator exceed the budget used to pass the feasibility
check (it read the sizes of storages already on the tier: 0 bytes), update the parameters,
and only then raise ``OutOfBudget``: a failed step with the update applied, against the one
commit point of GUARANTEES.md. Now the step fails at ``optimizer_step()`` with
``BudgetTooSmall`` naming the op, the tensors, the bytes and the smallest budget that works,
with model and optimizer bitwise unchanged; at that budget training completes within it and
matches in core. The issue's case (3072-2048-2048-10, batch 512, 64 MiB) scaled down 4x in
width: the largest parameter is 1.5 MiB, Adam's update of it holds 4.5 MiB, the budget is 4.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.engine import Options, OutOfCore
from test_reliability import CHUNK, ALL, _one_torch_thread, assert_same, state_of  # noqa: F401

BUDGET = 4 << 20
BIGGEST = 768 * 512 * 4   # 0.weight


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(768, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(128, 768, generator=g), torch.randint(0, 10, (128,), generator=g)


def train_step(model, opt, step: int, engine: OutOfCore | None = None) -> None:
    x, y = batch(step)
    if engine is None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return
    with engine.step():
        F.cross_entropy(model(x), y).backward()
        engine.optimizer_step()


def test_an_update_over_the_budget_fails_before_it_changes_anything() -> None:
    model, opt = fresh()
    before = state_of(model, opt)
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    with pytest.raises(ooc.BudgetTooSmall) as err:
        train_step(model, opt, 0, engine)
    e = err.value
    assert e.minimum == e.working_set == 3 * BIGGEST > BUDGET   # parameter, exp_avg, denominator
    message = str(e)
    for words in ("aten.addcdiv_", "0.weight (", "0.weight.exp_avg (", f"{BIGGEST} B",
                  f"raise the budget to at least 4.5 MiB ({3 * BIGGEST} B)"):
        assert words in message, message
    assert not opt.state, "the optimizer must not have stepped"
    assert_same(before, state_of(model, opt, engine), "after the failed step")
    engine.close()

    # The minimum it names is a budget that works: within it, bitwise as in core.
    ref_model, ref_opt = fresh()
    model, opt = fresh()
    engine = OutOfCore(model, opt, budget=e.minimum, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    for step in range(3):
        train_step(ref_model, ref_opt, step)
        train_step(model, opt, step, engine)
        assert engine.stats()["resident_peak_bytes"] <= e.minimum, f"step {step} over the budget"
    assert engine.stats()["last_planned"] == 1
    assert_same(state_of(ref_model, ref_opt), state_of(model, opt, engine), "at the minimum")
    engine.close()


def test_a_first_update_in_a_planned_step_is_checked_before_it_runs() -> None:
    """Steps that run no update (accumulation's first micro-batches; a GradScaler that skips
    the update its plan was recorded from) are planned without one; the first update then runs
    in a planned step. It is measured there before it runs, as in a recording step: refused
    with ``BudgetTooSmall``, nothing changed (it ran on demand and raised ``OutOfBudget``
    mid-training: torchvision's ViT with fp16 and every kind managed, on torch 2.14); at the
    minimum named, the same loop is bitwise as in core."""
    def loop(model, opt, engine: OutOfCore | None, steps: range) -> None:
        for step in steps:   # two micro-batches without an update, then one with
            x, y = batch(step)
            with engine.step() if engine is not None else contextlib.nullcontext():
                F.cross_entropy(model(x), y).backward()
                if step % 3 == 2:
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    model, opt = fresh()
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL)
    loop(model, opt, engine, range(2))
    assert engine.stats()["steps"] == 2
    before = state_of(model, opt, engine)
    with pytest.raises(ooc.BudgetTooSmall) as err:
        loop(model, opt, engine, range(2, 3))
    assert "of the optimizer step" in str(err.value) and err.value.minimum > BUDGET, err.value
    assert not opt.state, "the optimizer must not have stepped"
    assert err.value.step_applied is False   # taken back: a retrying loop runs the batch again
    after = state_of(model, opt, engine)
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]), f"{k} changed although the update was refused"
    # the gradients two micro-batches accumulated had this one's added: rolled back, it says so
    assert "already added to the gradients" in "".join(getattr(err.value, "__notes__", [])), err.value
    engine.close()

    ref_model, ref_opt = fresh()
    loop(ref_model, ref_opt, None, range(6))
    model, opt = fresh()
    with OutOfCore(model, opt, budget=err.value.minimum, options=Options(chunk=CHUNK, min_bytes=4096),
                   manage=ALL) as engine:
        loop(model, opt, engine, range(6))
        assert_same(state_of(ref_model, ref_opt), state_of(model, opt, engine), "at the minimum")

