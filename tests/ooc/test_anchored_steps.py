"""Anchored steps: a plan that swaps, run at autograd's saved-tensor hooks, no op intercepted.

What is asserted (time is not: benchmarks/bench_cpu.py measures it): anchored steps run no op
through the engine and give parameters, losses and BatchNorm statistics bitwise equal to
in-core training, on a CNN (BatchNorm, skip connections, in-place ReLU) and a transformer
(dropout), with SGD and Adam; a step that saves other tensors than the plan's is finished
synchronously and re-planned; a failed anchored step is rolled back; an anchored plan that
loses its trial is not run again.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc import OutOfCore, models
from ooc.engine import hook_forms
from ooc.measure import managed_peak, update_in_backward
from ooc.runtime import stepper as stepper_module
# shared with the template tests, the module database's forms and bench_hook_host.py
from ooc.testing.forced_forms import CHEAP_OP_S, templates_forced  # noqa: F401
from ooc.testing.forced_forms import decided as _decided
from test_second_backward import _model as residual_cnn

pytestmark = pytest.mark.timeout(300)

CASES = {"small_cnn": dict(width=16, blocks=4, per_stage=2),
         "gpt2": dict(depth=3, width=128, heads=2, seq_len=128, vocab=512)}


def fresh(name: str, opt: str):
    torch.manual_seed(0)
    model = models.get(name, **CASES[name])
    if opt == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def data(name: str, step: int, n: int):
    torch.manual_seed(10_000 + step)
    return models.example_batch(name, n, **CASES[name])


def train(name, model, opt, engine, sizes, fail_at=None, ops=None, in_backward=False, hidden=False):
    """One step per entry of ``sizes`` (the batch size). Returns the losses and, with an
    engine, its stats after each step with the ops it intercepted (``ops`` counts them).
    ``in_backward``: the updates run inside the backward (``update_in_backward`` set them up).
    ``hidden``: the engine's steps call ``model.forward`` (no hooks): the engine does not see a
    step's shape before it runs, and runs the last step's plan."""
    loss_fn = models.loss_fn(name)
    losses, stats = [], []
    for i, n in enumerate(sizes):
        x, y = data(name, i, n)
        torch.manual_seed(1000 + i)   # dropout's masks: the same draws in both runs
        if engine is None:
            if i != fail_at:
                loss = loss_fn(model(x), y)
                loss.backward()
                if not in_backward:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            continue
        before = len(ops) if ops is not None else 0
        try:
            with engine.step():
                loss = loss_fn((model.forward if hidden else model)(x), y)
                loss.backward()
                if i == fail_at:
                    raise RuntimeError("the user's code failed")
                if not in_backward:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        except RuntimeError as e:
            assert i == fail_at and "user's code" in str(e)
        stats.append(engine.stats() | {"ops seen": (len(ops) - before) if ops is not None else -1})
    return losses, stats


def assert_same(a, b, losses_a, losses_b) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs from in-core training"
    assert all(torch.equal(p, q) for p, q in zip(losses_a, losses_b)), "losses differ from in-core"


@pytest.fixture
def counted_ops(monkeypatch):
    """The ops the per-op path intercepts, counted; and every trial kept (its outcome is a
    timing, which tests do not depend on)."""
    ops: list[int] = []
    on_op = stepper_module.Stepper.on_op

    def counting(self, func, args, kwargs):
        ops.append(1)
        return on_op(self, func, args, kwargs)

    monkeypatch.setattr(stepper_module.Stepper, "on_op", counting)
    monkeypatch.setattr(hook_forms.HookPlan, "judge", _decided(keep=True))
    return ops


def engine_for(name: str, model, opt, fraction: float, **kw) -> OutOfCore:
    peak = managed_peak(name, 8, model_kwargs=CASES[name])
    return OutOfCore(model, opt, budget=int(peak * fraction), **kw)


@pytest.mark.parametrize("name,opt", [("small_cnn", "sgd"), ("small_cnn", "adam"), ("gpt2", "adam")])
def test_anchored_steps_intercept_no_op_and_are_bitwise(counted_ops, name, opt) -> None:
    sizes = [8] * 9
    ref, ref_opt = fresh(name, opt)
    ref_losses, _ = train(name, ref, ref_opt, None, sizes)
    model, o = fresh(name, opt)
    with engine_for(name, model, o, 0.4, recompute="never") as engine:
        losses, stats = train(name, model, o, engine, sizes, ops=counted_ops)
    anchored = [s for s in stats if s["ops seen"] == 0]
    assert len(anchored) >= 3 and stats[-1]["steps.anchored"] == len(anchored), [s["ops seen"] for s in stats]
    assert all(s["last_planned"] and s["last_diverged_at"] == -1 for s in anchored)
    last = anchored[-1]
    assert last["plan.bytes_out"] > 0 and last["plan.peak_resident_bytes"] <= last["budget"]
    moved = [(b["bytes_out"] - a["bytes_out"], b["bytes_in"] - a["bytes_in"]) for a, b in zip(stats, stats[1:])
             if b["ops seen"] == 0]
    assert all(out > 0 and back == out for out, back in moved), moved   # swapped, and read back
    assert_same(ref, model, ref_losses, losses)


def test_the_default_engine_runs_a_plan_that_recomputes_at_the_hooks_from_templates(counted_ops, monkeypatch) -> None:
    """The per-op plan recomputes; its anchored form reruns the chains from the templates a
    per-op step captured (``ooc/runtime/templates.py``; the dropout's chains draw from the
    generator's state at the save before them, ``ooc/runtime/bound_templates.py``):
    with the trial kept, the engine's steps intercept no op, recompute, keep to their plan and
    give in-core's parameters and losses bitwise. Plans recompute whatever the machine's load
    (``templates_forced``: priced at what the file measured, a busy CI machine once planned
    swap only)."""
    templates_forced(monkeypatch.setattr)
    sizes = [8] * 10
    ref, ref_opt = fresh("gpt2", "sgd")
    ref_losses, _ = train("gpt2", ref, ref_opt, None, sizes)
    model, o = fresh("gpt2", "sgd")
    with engine_for("gpt2", model, o, 0.3) as engine:
        losses, stats = train("gpt2", model, o, engine, sizes, ops=counted_ops)
        per_op = engine._plans.schedule
    assert per_op.bytes_recomputed > 0
    hooked = [(a, b) for a, b in zip(stats, stats[1:]) if b["ops seen"] == 0]
    assert len(hooked) >= 3, [s["ops seen"] for s in stats]
    assert all(b["last_diverged_at"] == -1 and b["plan.bytes_recomputed"] > 0 for _, b in hooked)
    assert all(b["bytes_recomputed"] > a["bytes_recomputed"] for a, b in hooked)   # each step recomputed
    assert_same(ref, model, ref_losses, losses)


def test_an_anchored_step_keeps_the_saved_tensor_only_where_its_bytes_never_leave(counted_ops, monkeypatch) -> None:
    """Autograd's record of a saved activation holds the tensor itself (its unpack returns it,
    no new view) only where the plan neither swaps nor discards it: holding a swapped one would
    keep its bytes in memory after the swap-out. Itself, or an alias of it without the
    ``grad_fn`` that would make its node hold itself (``saved_tensors.unlinked``)."""
    from ooc.runtime.anchored_step import AnchoredStep
    from ooc.runtime.saved_tensors import Packed

    seen, unpacked = [], []
    pack, unpack = AnchoredStep.pack, AnchoredStep.unpack

    def packing(self, t):   # notes no tensor: holding one would hold its bytes
        p = pack(self, t)
        if isinstance(p, Packed) and self.actions:
            itself = p.tensor is t or (p.tensor is not None and p.tensor.grad_fn is None and p.tensor.data_ptr() ==
                                       t.data_ptr() and p.tensor.shape == t.shape and p.tensor.stride() == t.stride())
            seen.append((p.slot.var in self.leaving, itself, p.tensor is None))
        return p

    def unpacking(self, p):
        out = unpack(self, p)
        if isinstance(p, Packed) and self.actions:
            unpacked.append((p.tensor is not None, out is p.tensor))
        return out

    monkeypatch.setattr(AnchoredStep, "pack", packing)
    monkeypatch.setattr(AnchoredStep, "unpack", unpacking)
    model, o = fresh("small_cnn", "sgd")
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        _, stats = train("small_cnn", model, o, engine, [8] * 8, ops=counted_ops)
    assert stats[-1]["steps.anchored"] >= 3
    kept = [itself for leaving, itself, _ in seen if not leaving]
    gone = [none for leaving, _, none in seen if leaving]
    assert kept and gone and all(kept) and all(gone), (len(kept), len(gone))
    assert any(held for held, _ in unpacked) and all(same for held, same in unpacked if held)


def test_recompute_prefer_keeps_the_per_op_plan_that_recomputes(counted_ops) -> None:
    """``recompute="prefer"`` asks for recomputation, so no anchored form (which swaps what the
    plan recomputes) is tried, even where it would win its trial (counted_ops keeps it): every
    settled step intercepts ops and recomputes (bench_cpu's "prefer" rows ran anchored and
    recomputed nothing before)."""
    sizes = [8] * 10
    ref, ref_opt = fresh("gpt2", "sgd")
    ref_losses, _ = train("gpt2", ref, ref_opt, None, sizes)
    model, o = fresh("gpt2", "sgd")
    with engine_for("gpt2", model, o, 0.3, recompute="prefer") as engine:
        losses, stats = train("gpt2", model, o, engine, sizes, ops=counted_ops)
    assert stats[-1]["steps.anchored"] == 0
    assert all(s["ops seen"] > 0 for s in stats[-4:])
    assert stats[-1]["plan.bytes_recomputed"] > 0
    assert stats[-1]["bytes_recomputed"] > stats[-2]["bytes_recomputed"]   # the last step recomputed
    assert_same(ref, model, ref_losses, losses)


def test_a_rejected_trial_keeps_the_per_op_plan(monkeypatch) -> None:
    monkeypatch.setattr(hook_forms.HookPlan, "judge", _decided(keep=False))
    sizes = [8] * 9
    ref, ref_opt = fresh("small_cnn", "sgd")
    ref_losses, _ = train("small_cnn", ref, ref_opt, None, sizes)
    model, o = fresh("small_cnn", "sgd")
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        losses, stats = train("small_cnn", model, o, engine, sizes)
    tried = stats[-1]["steps.anchored"]
    assert tried >= 1 and all(s["steps.anchored"] == tried for s in stats[-3:])
    assert_same(ref, model, ref_losses, losses)


def test_a_larger_batch_leaves_the_anchored_plan_and_is_still_bitwise(counted_ops) -> None:
    """Batch 16 in an anchored step saves tensors of other sizes (called as ``model.forward``,
    so that the engine does not see its shape first and take up a plan of that shape): the
    first one ends the plan, the step brings back what the backward unpacks synchronously,
    writes what it saves beyond the budget to the tier at once (it used to keep all of it,
    twice the plan's activations, and report none), and the next step records again."""
    sizes = [8] * 6 + [16, 16, 8, 8, 8, 8, 8]
    ref, ref_opt = fresh("small_cnn", "sgd")
    ref_losses, _ = train("small_cnn", ref, ref_opt, None, sizes)
    model, o = fresh("small_cnn", "sgd")
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        losses, stats = train("small_cnn", model, o, engine, sizes, ops=counted_ops, hidden=True)
    assert stats[5]["ops seen"] == 0   # anchored before the larger batch
    big = stats[6]
    assert big["ops seen"] == 0 and big["last_diverged_at"] >= 0 and not big["last_planned"]
    assert 0 < big["resident_peak_bytes"] <= big["budget"]
    assert big["bytes_out"] - stats[5]["bytes_out"] > 0 and big["bytes_in"] - stats[5]["bytes_in"] > 0
    assert stats[7]["ops seen"] > 0 and not stats[7]["last_planned"]   # recorded again
    assert stats[-1]["ops seen"] == 0 and stats[-1]["last_diverged_at"] == -1   # anchored again
    assert_same(ref, model, ref_losses, losses)


def test_an_anchored_step_that_fails_is_rolled_back(counted_ops) -> None:
    """BatchNorm's running statistics were updated by the failed step's forward: they get
    their old bytes back, the gradients it made are dropped, its transfers are settled."""
    sizes = [8] * 9
    ref, ref_opt = fresh("small_cnn", "sgd")
    ref_losses, _ = train("small_cnn", ref, ref_opt, None, sizes, fail_at=6)
    model, o = fresh("small_cnn", "sgd")
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        losses, stats = train("small_cnn", model, o, engine, sizes, fail_at=6, ops=counted_ops)
        assert stats[6]["ops seen"] == 0 and all(p.grad is None for p in model.parameters())
    assert stats[-1]["ops seen"] == 0
    assert_same(ref, model, ref_losses, losses)


def test_an_update_the_plans_step_did_not_run_hands_the_state_back_to_the_per_op_path(counted_ops) -> None:
    """Gradient accumulation: micro-batches share a starting state with the one that updates.
    An anchored form made from a step without the update does not see the update's ops (a per-op
    step diverges there, its plan has none): after an anchored step ran one, that state's steps
    go back to the per-op path, whose next update step diverges and plans from a step that
    updates. Only a step that ran its whole plan makes an anchored form, so the plan settles:
    from the third window on every step keeps to it, and anchored steps run again."""
    model, o = fresh("small_cnn", "sgd")
    ref, ref_o = fresh("small_cnn", "sgd")
    loss_fn = models.loss_fn("small_cnn")
    stats = []
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        for step in range(14):
            x, y = data("small_cnn", step, 8)
            before = len(counted_ops)
            for m, opt, ctx in ((model, o, engine.step()), (ref, ref_o, torch.enable_grad())):
                torch.manual_seed(step)
                with ctx:
                    loss_fn(m(x), y).backward()
                    if step % 4 == 3:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            stats.append(engine.stats() | {"ops seen": len(counted_ops) - before})
    assert stats[3]["ops seen"] == 0 and stats[3]["last_diverged_at"] == -1   # the update, anchored
    assert stats[7]["ops seen"] > 0 and stats[7]["last_diverged_at"] >= 0     # per-op: seen, re-planned
    assert all(s["last_planned"] and s["last_diverged_at"] == -1 for s in stats[8:]), stats[8:]
    assert stats[-1]["steps.anchored"] > stats[3]["steps.anchored"]
    assert_same(ref, model, [], [])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_updates_inside_the_backward_run_anchored_and_bitwise(counted_ops, opt) -> None:
    """The updates interleave with the backward's unpacks: the anchored form reaches its
    commit point at the first of them, and the rest of the backward's actions still run."""
    sizes = [8] * 9
    ref, ref_opt = fresh("small_cnn", opt)
    update_in_backward(ref, ref_opt)
    ref_losses, _ = train("small_cnn", ref, ref_opt, None, sizes, in_backward=True)
    model, o = fresh("small_cnn", opt)
    with engine_for("small_cnn", model, o, 0.4, recompute="never") as engine:
        update_in_backward(model, o)   # after the engine, as users add it
        losses, stats = train("small_cnn", model, o, engine, sizes, ops=counted_ops, in_backward=True)
    anchored = [s for s in stats if s["ops seen"] == 0]
    assert len(anchored) >= 3 and all(s["last_diverged_at"] == -1 for s in anchored), \
        [(s["ops seen"], s["last_diverged_at"]) for s in stats]
    assert anchored[-1]["plan.bytes_out"] > 0
    assert_same(ref, model, ref_losses, losses)


def test_a_plan_with_no_anchored_form_within_the_budget_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Near the smallest budget the step fits, the anchored form (actions held to the next hook
    of autograd) is not proven within it: the steps run per op, and the log says why there is
    no trial. A residual CNN that needs 2.5-3 MiB, at 3 MiB (at 4 MiB it has a form)."""
    model = residual_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = OutOfCore(model, opt, budget=3 << 20)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    with caplog.at_level(logging.INFO, logger="ooc"):
        for _ in range(10):
            with engine.step():
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    stats = engine.stats()
    engine.close()
    said = [r.getMessage() for r in caplog.records if "no anchored form" in r.getMessage()]
    assert said and stats["steps.anchored"] == 0 and stats["steps.planned"] >= 5, (said, stats["steps.planned"])


class _MultiTask(nn.Module):
    """A trunk of residual MLP blocks and three heads, one of them narrower: the loop picks
    the task (and so the head) at random per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1),
                                                 nn.Linear(256, 128)) for _ in range(4))
        self.heads = nn.ModuleList([nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 5)),
                                    nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 5)),
                                    nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 5))])

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        for block in self.trunk:
            x = x + block(x)
        return self.heads[task](x)


def _multitask(model: nn.Module, budget: int | None, steps: int = 30) -> tuple[list, dict]:
    import random

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = OutOfCore(model, opt, budget=budget) if budget is not None else None
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(640, 128, generator=g), torch.randint(0, 5, (640,), generator=g)
    torch.manual_seed(2)
    losses = []
    for s in range(steps):
        i = (s % 10) * 64
        with engine.step() if engine is not None else torch.enable_grad():
            loss = F.cross_entropy(model(xs[i:i + 64], random.Random(s).randrange(3)), ys[i:i + 64])
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
    if engine is not None:
        engine.close()
    return losses, model.state_dict()


def test_a_step_that_left_its_anchored_plan_gives_back_what_its_recomputes_read() -> None:
    """Multi-task training, the head drawn per step, at the default settings and 256 KiB (a
    fifth of the managed peak). An anchored step whose head differs leaves its plan at the
    head's first save; its backward then recomputes the activations the plan had discarded,
    reading their inputs back from the tier. Each recompute's result and inputs stayed in the
    pool to the step's end (no plan frees ran): ``BudgetExceeded`` at step 10, three runs of
    three on the code before. Each goes back after its one use now (``AnchoredStep._let_go``),
    bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the plan that ran the pool out was priced on one thread's op times
    try:
        ref_losses, ref_state = _multitask(_MultiTask(), None)
        losses, state = _multitask(_MultiTask(), 256 << 10)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}"
    for k, a in ref_state.items():
        assert torch.equal(a, state[k]), k
