"""Optimizers as users and libraries write them: a subclass whose ``step()`` calls
``super().step()`` (one update, not two nested ones), one made from another optimizer (as
timm's ``Lookahead``, with or without ``Optimizer.__init__``), one that keeps a tensor in its
parameter groups (as timm's ``Lamb``), ``LBFGS``, whose ``step(closure)`` runs the forward
and backward inside the update, and schedulefree's optimizers, which move the weights in place
between training and evaluation.

PyTorch wraps each optimizer class's ``step`` in its hooks the first time an instance of that
class is made, so a subclass's ``step()`` that calls the parent's runs the engine's update
hooks twice, nested, in any process that made a parent-class optimizer before (the engine's
own dry runs make them too). The engine opens the update at the outer hook and closes it at the
outer hook's end (``UpdateGuard.update_starts``).
"""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc

pytestmark = pytest.mark.timeout(300)


class ClippedAdam(torch.optim.Adam):
    """Adam that clips the gradients' norm before its update, as users' subclasses do."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        return super().step(closure)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Dropout(0.1),
                         nn.Linear(16 * 16 * 16, 10))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, engine: ooc.OutOfCore | None, steps) -> None:
    """``_model``'s steps ``steps`` (each its own batch and dropout draws), in core where
    ``engine`` is None: the same steps give the same parameters whichever side runs first."""
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
        torch.manual_seed(100 + step)
        with engine.step() if engine is not None else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def _assert_bitwise(ref: nn.Module, model: nn.Module) -> None:
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"


@pytest.mark.parametrize("covers", ["managed", "step"])
def test_a_subclass_calling_its_hooked_parent_step_updates_once_and_bitwise(monkeypatch, covers: str) -> None:
    """Six steps of a small CNN (BatchNorm, dropout) with ``ClippedAdam`` under a budget that
    swaps (and one for the whole step), ``Adam.step`` wrapped in PyTorch's hooks first: the
    hooks run twice a step, the update's commit point once (twice before 2026-11-29; with a
    budget for the whole step the inner start then refused steps whose update had begun), and
    the parameters are bitwise in core's."""
    from ooc.engine.update_hooks import UpdateGuard

    torch.optim.Adam([nn.Parameter(torch.zeros(1))])   # wraps Adam.step, as any earlier Adam does
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = ClippedAdam(ref.parameters(), lr=1e-3), ClippedAdam(model.parameters(), lr=1e-3)
    hooks, commits = [], []
    real_starts, real_commit = UpdateGuard.update_starts, UpdateGuard._commit_point
    monkeypatch.setattr(UpdateGuard, "update_starts", lambda self, *a: hooks.append(1) or real_starts(self, *a))
    monkeypatch.setattr(UpdateGuard, "_commit_point", lambda self, st: commits.append(1) or real_commit(self, st))
    budget = 3 << 20 if covers == "managed" else 24 << 20
    with ooc.OutOfCore(model, opt, budget=budget, options=ooc.Options(chunk="64KiB", budget_covers=covers)) as engine:
        _steps(ref, ref_opt, None, range(6))
        _steps(model, opt, engine, range(6))
        stats = engine.stats()
    assert len(hooks) == 12 and len(commits) == 6, (len(hooks), len(commits))   # two hooks a step, one update
    assert stats["bytes_out"] > 0, stats
    _assert_bitwise(ref, model)


class Wrapping(torch.optim.Optimizer):
    """An optimizer made from another, as timm's ``Lookahead``: it shares the other's groups
    and state, and its constructor takes that optimizer, not parameter groups."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        super().__init__([p for group in base.param_groups for p in group["params"]], base.defaults)
        self.base, self.param_groups, self.state = base, base.param_groups, base.state

    @torch.no_grad()
    def step(self, closure=None):
        return self.base.step(closure)


@pytest.mark.parametrize("manage", [("activations",), ("activations", "params", "grads", "optimizer_state")])
def test_an_optimizer_made_from_another_trains_bitwise_under_a_budget_for_the_whole_step(manage) -> None:
    """The engine measures an update on ``meta`` twins of an optimizer of the same type; one
    that cannot be made so (``Wrapping``) is not measured, and trains: before 2026-11-29 the
    AttributeError its constructor raised on parameter groups stopped the first step."""
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = Wrapping(torch.optim.Adam(ref.parameters(), lr=1e-3))
    opt = Wrapping(torch.optim.Adam(model.parameters(), lr=1e-3))
    with ooc.OutOfCore(model, opt, budget=24 << 20, manage=manage,
                       options=ooc.Options(chunk="64KiB", budget_covers="step")) as engine:
        _steps(ref, ref_opt, None, range(4))
        _steps(model, opt, engine, range(4))
    _assert_bitwise(ref, model)


class GroupCounted(torch.optim.Optimizer):
    """SGD with momentum whose learning rate warms up over a step count kept in a tensor of
    each parameter group, as timm's ``Lamb`` keeps its steps."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = torch.tensor(0.0)
            group["step"].add_(1)
            scale = min(1.0, group["step"].item() / 3)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] * scale)


@pytest.mark.parametrize("covers", ["managed", "step"])
def test_an_optimizer_with_tensors_in_its_groups_trains_bitwise_with_every_kind_managed(covers: str) -> None:
    """The engine's dry runs of the update (``ooc/runtime/dry_run.py``) step an optimizer of the
    same type over ``meta`` twins; the tensors of its parameter groups are copies too (before
    2026-11-29 they were shared: each dry run counted a step in ``GroupCounted``'s counter, and
    timm's ``Lamb`` with its state managed was not bitwise)."""
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = GroupCounted(ref.parameters()), GroupCounted(model.parameters())
    with ooc.OutOfCore(model, opt, budget=(2 << 20) if covers == "managed" else (24 << 20),
                       manage=("activations", "params", "grads", "optimizer_state"),
                       options=ooc.Options(chunk="64KiB", budget_covers=covers)) as engine:
        _steps(ref, ref_opt, None, range(5))
        _steps(model, opt, engine, range(5))
        assert engine.stats()["bytes_out"] > 0
    assert [g["step"].item() for g in opt.param_groups] == [5.0]
    _assert_bitwise(ref, model)


class Bare(torch.optim.Optimizer):
    """As timm's ``Lookahead``: made from another optimizer without ``Optimizer.__init__``,
    its step hooks made by hand, no state-dict hooks."""

    def __init__(self, base: torch.optim.Optimizer) -> None:   # noqa: no super().__init__, on purpose
        self.base, self.param_groups, self.defaults = base, base.param_groups, base.defaults
        self.state = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()

    @torch.no_grad()
    def step(self, closure=None):
        return self.base.step(closure)


def test_an_optimizer_without_state_dict_hooks_trains_its_activations_and_refuses_the_rest() -> None:
    """``Bare`` (no state-dict hooks): activations managed, bitwise; params, grads or state
    managed, an ``OOCError`` at the engine's construction that names the optimizer and the way
    out (before 2026-11-29 an ``AttributeError`` from registering the hooks)."""
    with pytest.raises(ooc.OOCError, match=r"Bare has no state_dict hooks.*manage=\('activations',\)"):
        ooc.OutOfCore(_model(), Bare(torch.optim.Adam(_model().parameters())), budget=2 << 20,
                      manage=("activations", "optimizer_state"))
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = Bare(torch.optim.Adam(ref.parameters(), lr=1e-3))
    opt = Bare(torch.optim.Adam(model.parameters(), lr=1e-3))
    with ooc.OutOfCore(model, opt, budget=2 << 20, options=ooc.Options(chunk="64KiB")) as engine:
        _steps(ref, ref_opt, None, range(4))
        _steps(model, opt, engine, range(4))
        assert engine.stats()["bytes_out"] > 0
    _assert_bitwise(ref, model)


def _lbfgs_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)


def _closure_of(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """LBFGS's closure as its users write it: forward and backward inside the update."""
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("covers", ["managed", "step"])
def test_lbfgs_with_a_closure_trains_its_activations_and_refuses_the_rest_before_the_step(covers: str) -> None:
    """``LBFGS.step(closure)``: activations managed, four steps bitwise as in core; with
    params, grads or state managed, an ``OOCError`` at the update's start that names the
    closure and the way out, the step taken back (``step_applied`` False, parameters as they
    were). Before 2026-11-29 every kind managed crashed inside the closure's backward with
    "src holds 0 bytes", naming nothing."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    budget = (256 << 10) if covers == "managed" else (24 << 20)   # its history: 10 MiB after 4 steps, and records
    model = copy.deepcopy(ref)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with ooc.OutOfCore(model, opt, budget=budget, manage=("activations", "params"),
                       options=ooc.Options(chunk="16KiB", budget_covers=covers)) as engine:
        with pytest.raises(ooc.OOCError, match=r"LBFGS.step\(closure\).*manage=\('activations',\)") as err:
            with engine.step():
                opt.step(_closure_of(model, opt, *_lbfgs_data(0)))
    assert err.value.step_applied is False
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values()))
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=4)
    with ooc.OutOfCore(model, opt, budget=budget, options=ooc.Options(chunk="16KiB", budget_covers=covers)) as engine:
        for step in range(4):
            ref_opt.step(_closure_of(ref, ref_opt, *_lbfgs_data(step)))
            with engine.step():
                opt.step(_closure_of(model, opt, *_lbfgs_data(step)))
        assert engine.stats()["bytes_out"] > 0
    _assert_bitwise(ref, model)


def test_state_that_grows_between_steps_is_fitted_again_under_a_budget_for_the_whole_step() -> None:
    """LBFGS appends to its history (lists of tensors) every step: a small MLP's state is
    2.6 MiB after its first step and 16 MiB after its sixth. Under
    ``Options(budget_covers="step")`` the engine fitted its share to the steps it recorded
    whole, and before 2026-11-29 counted neither the lists nor any growth after: at an 8 MiB
    budget six steps ran, the state alone twice the budget. Now a step that starts with more
    than the last one recorded whole counted is recorded whole again: a budget the grown state
    leaves no room in is refused (with the least that works), one that holds it trains on,
    bitwise, the share fitted to the state as it grew."""
    def run(model: nn.Module, budget: int | None, steps: int) -> tuple[torch.optim.Optimizer, dict]:
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        if budget is None:
            for step in range(steps):
                opt.step(_closure_of(model, opt, *_lbfgs_data(step)))
            return opt, {}
        with ooc.OutOfCore(model, opt, budget=budget, options=ooc.Options(chunk="16KiB", budget_covers="step")) as e:
            for step in range(steps):
                with e.step():
                    opt.step(_closure_of(model, opt, *_lbfgs_data(step)))
            return opt, e.stats()

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    with pytest.raises(ooc.BudgetTooSmall) as err:
        run(copy.deepcopy(ref), 8 << 20, 6)
    assert err.value.minimum > 8 << 20
    model = copy.deepcopy(ref)
    opt, stats = run(model, 40 << 20, 6)
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for v in st.values()
                for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor))
    assert state > 12 << 20 and stats["step_held_bytes"] >= state - (3 << 20)   # fitted at step 5 at the latest
    run(ref, None, 6)
    _assert_bitwise(ref, model)


def _schedule_free(name: str, model: nn.Module) -> tuple[object, torch.optim.Optimizer]:
    """(What the user steps, the optimizer holding the state): schedulefree's AdamW, or its
    wrapper (no ``Optimizer``) around SGD."""
    import schedulefree

    if name == "adamw":
        opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-3, warmup_steps=2)
        return opt, opt
    wrapper = schedulefree.ScheduleFreeWrapper(torch.optim.SGD(model.parameters(), lr=0.05), momentum=0.9)
    return wrapper, wrapper.base


@pytest.mark.parametrize("name", ["adamw", "wrapper"])
def test_schedule_free_optimizers_train_and_evaluate_bitwise_with_every_kind_managed(name: str) -> None:
    """schedulefree's optimizers keep the weights where the gradient is taken (y) in training
    and move them in place to where they are evaluated (x) at ``opt.eval()``, and back at
    ``opt.train()``, between steps; its ``ScheduleFreeWrapper`` is no ``Optimizer`` (given to
    the engine it was refused: "optimizer must be a torch.optim.Optimizer or None") and moves
    them around its base optimizer's step inside its own. With every kind managed under a
    budget for the whole step, steps and evaluations between them: bitwise."""
    pytest.importorskip("schedulefree")
    runs = []
    for engine_kw in (None, {"budget": 24 << 20, "manage": ("activations", "params", "grads", "optimizer_state"),
                             "options": ooc.Options(chunk="64KiB", min_bytes=4096, budget_covers="step")}):
        model = _model()
        opt, state = _schedule_free(name, model)
        opt.train()
        engine = ooc.OutOfCore(model, opt, **engine_kw) if engine_kw is not None else None
        seen = []
        try:
            for step in range(4):
                _steps(model, opt, engine, [step])
                model.eval(), opt.eval()
                with torch.no_grad():
                    seen.append(model(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(9))))
                model.train(), opt.train()
            with engine.resident() if engine is not None else contextlib.nullcontext():
                kept = {(i, k): v.clone() for i, s in enumerate(state.state.values()) for k, v in s.items()
                        if torch.is_tensor(v)}
                runs.append((model, kept, seen, engine.stats() if engine is not None else {}))
        finally:
            if engine is not None:
                engine.close()
    (ref, ref_state, ref_seen, _), (model, got_state, got_seen, stats) = runs
    _assert_bitwise(ref, model)
    assert all(torch.equal(a, b) for a, b in zip(ref_seen, got_seen)), "the evaluations between steps differ"
    assert ref_state.keys() == got_state.keys() and all(torch.equal(v, got_state[k]) for k, v in ref_state.items())
    assert stats["bytes_out"] > 0 and stats["steps.planned"] + stats["steps.anchored"] > 0, stats
