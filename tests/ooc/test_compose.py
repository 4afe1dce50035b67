"""What composes with ``engine.step()`` and what is refused (issue 16 item 8).

Before: ``save_on_cpu`` (any saved-tensor hooks) entered inside the step silently took every
activation saved under it away from the engine (0 managed, 0 bytes moved); entered around
the step, the engine's hooks silently replaced it; a second engine's step inside the first
one's took the first engine's activations and dropped them at its end (a ``KeyError`` from
the tier in the outer backward). Now those are refused with an ``OOCError`` naming what was
found, and the step is rolled back. ``torch.utils.checkpoint``, both flavours, composes:
training stays bitwise identical to in-core training with the same checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

from ooc import OOCError, OutOfCore, Options

pytestmark = pytest.mark.timeout(300)

KiB = 1 << 10
BUDGET, CHUNK = 1 << 20, 64 * KiB   # fixed chunk: these tests are not about its choice
STEPS = 4


class Net(nn.Module):
    """An MLP whose last block (BatchNorm, dropout) may run under checkpointing; its
    activations are 512 KiB each at batch 256, so a 1 MiB budget moves bytes."""

    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self.a = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                               nn.Linear(512, 512), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Dropout(0.1), nn.ReLU(),
                               nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.mode == "plain":
            return self.b(h)
        return checkpoint.checkpoint(self.b, h, use_reentrant=self.mode == "reentrant")


def _fresh(mode: str = "plain") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net(mode)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g)


def _in_core_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    torch.manual_seed(1000 + step)   # dropout
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _engine_step(engine: OutOfCore, model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    torch.manual_seed(1000 + step)
    with engine.step():
        F.cross_entropy(model(x), y).backward()
        engine.optimizer_step()


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs from in core"


def _own_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


HOOKS = {"save_on_cpu": (torch.autograd.graph.save_on_cpu, "save_on_cpu"),
         "own hooks": (_own_hooks, "_own_hooks")}


@pytest.mark.parametrize("hooks", HOOKS)
def test_saved_tensor_hooks_inside_the_step_are_refused_and_the_step_rolled_back(hooks) -> None:
    """The first op saving under them fails the step with an OOCError that names them; the
    step is rolled back (BatchNorm statistics, no gradient), and the next step trains as in
    core."""
    make, name = HOOKS[hooks]
    ref, ref_opt = _fresh()
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    x, y = _batch(0)
    with pytest.raises(OOCError, match=f"{name}.*inside engine.step\\(\\).*bypass ooc"):
        with engine.step():
            with make():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            engine.optimizer_step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by the refused step"
    assert all(p.grad is None for p in model.parameters())
    for step in range(2):
        _in_core_step(ref, ref_opt, step)
        _engine_step(engine, model, step)
        _assert_same(ref, model)
    assert engine.stats()["bytes_out"] > 0
    engine.close()


def test_torch_func_grad_inside_the_step_says_why_and_the_step_rolls_back() -> None:
    """Per-sample gradients by ``torch.func`` (DP-SGD's way): grad refuses any saved-tensor
    hooks, ooc's included. The user gets an ``OOCError`` that names the refusal and what to do
    (PyTorch's own error chained to it), the step is rolled back, and the same gradients
    computed outside the step then train as in core."""
    from torch.func import functional_call, grad, vmap

    def per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Clipped per-sample gradients of the first block (no BatchNorm: vmap over single
        samples), averaged into ``.grad``; the rest of the model gets none."""
        params = {k: v.detach() for k, v in model.a.named_parameters()}

        def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model.a, p, (xi[None],))[:, :10], yi[None])

        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:16], y[:16])
        for k, p in model.a.named_parameters():
            p.grad = g[k].clamp(-1, 1).mean(0)

    model, opt = _fresh()
    ref, ref_opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    x, y = _batch(0)
    with pytest.raises(OOCError, match=r"torch.func's grad.*saved-tensor hooks.*outside `with engine.step\(\)`") as info:
        with engine.step():
            per_sample(model, x, y)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.step_applied is False   # a retrying loop runs the batch again
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by the refused step"
    for m, o in ((ref, ref_opt), (model, opt)):   # outside the step: PyTorch's alone
        per_sample(m, x, y)
        o.step()
        o.zero_grad(set_to_none=True)
    _engine_step(engine, model, 1)
    _in_core_step(ref, ref_opt, 1)
    _assert_same(ref, model)
    engine.close()


def test_saved_tensor_hooks_around_the_step_are_refused() -> None:
    """Around the step, the engine's hooks would replace them for the step's duration."""
    model, opt = _fresh()
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(OOCError, match="save_on_cpu.*around engine.step\\(\\)"):
            with engine.step():
                pass
    assert engine.stats()["steps"] == 0
    engine.close()


def test_save_on_cpu_inside_composes_when_activations_are_not_managed() -> None:
    """What the error message offers: the engine manages the parameters, ``save_on_cpu``
    the activations; bitwise identical to in core with ``save_on_cpu``."""
    ref, ref_opt = _fresh()
    model, opt = _fresh()
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK), manage=("params",))
    for step in range(3):
        x, y = _batch(step)
        torch.manual_seed(1000 + step)
        with torch.autograd.graph.save_on_cpu():
            F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + step)
        with engine.step():
            with torch.autograd.graph.save_on_cpu():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            engine.optimizer_step()
        _assert_same(ref, model)
    assert engine.stats()["bytes_out"] > 0
    engine.close()


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpoint_inside_the_step_composes_bitwise(mode) -> None:
    """``torch.utils.checkpoint`` around a block with BatchNorm and dropout: the engine
    manages the activations outside it (and, reentrant, the recomputed ones), moves bytes,
    runs planned, and training is bitwise identical to in-core training with the same
    checkpointing (its RNG restore and BatchNorm's second update included)."""
    ref, ref_opt = _fresh(mode)
    model, opt = _fresh(mode)
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    for step in range(STEPS):
        _in_core_step(ref, ref_opt, step)
        _engine_step(engine, model, step)
        _assert_same(ref, model)
    stats = engine.stats()
    assert stats["plan.variables"] > 0 and stats["plan.bytes_out"] + stats["plan.bytes_recomputed"] > 0
    assert stats["last_planned"] and stats["last_diverged_at"] == -1
    assert stats["resident_peak_bytes"] <= BUDGET
    engine.close()


def test_nested_engines_are_refused_and_both_train_afterwards() -> None:
    """A second engine's step inside the first one's: refused at its entry, naming the other
    engine; the outer step rolls back. Run one after the other, both match in core."""
    ref, ref_opt = _fresh()
    ref2, ref2_opt = _fresh()
    model, opt = _fresh()
    model2, opt2 = _fresh()
    outer = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    inner = OutOfCore(model2, opt2, budget=BUDGET, options=Options(chunk=CHUNK))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch(0)
    with pytest.raises(OOCError, match="inside the step of another OutOfCore engine"):
        with outer.step():
            loss = F.cross_entropy(model(x), y)
            with inner.step():
                F.cross_entropy(model2(x), y).backward()
            loss.backward()
    assert all(p.grad is None for p in [*model.parameters(), *model2.parameters()])
    for k, v in model.state_dict().items():   # the outer forward's BatchNorm update undone
        assert torch.equal(v, before[k]), f"{k} changed by the refused step"
    assert inner.stats()["steps"] == 0
    for step in range(3):
        _in_core_step(ref, ref_opt, step)
        _in_core_step(ref2, ref2_opt, step)
        _engine_step(outer, model, step)
        _engine_step(inner, model2, step)
        _assert_same(ref, model)
        _assert_same(ref2, model2)
    assert outer.stats()["bytes_out"] > 0 and inner.stats()["bytes_out"] > 0
    outer.close()
    inner.close()


def test_torch_compile_inside_the_step_is_refused_not_run_eagerly() -> None:
    """torch.compile under the engine's dispatch mode would run eagerly, silently (dynamo skips
    frames while a TorchDispatchMode is active; issue 40 saw parameters equal to eager, not
    compiled, training): a compiled call inside the step is refused and the step rolled back;
    the uncompiled model trains on, bitwise; a compiled submodule is refused at construction."""
    ref, ref_opt = _fresh()
    model, opt = _fresh()
    engine = OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK))
    compiled = torch.compile(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch(0)
    with pytest.raises(OOCError, match="called through torch.compile inside engine.step"):
        with engine.step():
            F.cross_entropy(compiled(x), y).backward()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by the refused step"
    for step in range(3):
        _in_core_step(ref, ref_opt, step)
        _engine_step(engine, model, step)
        _assert_same(ref, model)
    engine.close()
    wrapped, wrapped_opt = _fresh()
    wrapped.add_module("head", torch.compile(nn.Identity()))
    with pytest.raises(OOCError, match="submodule head is compiled"):
        OutOfCore(wrapped, wrapped_opt, budget=BUDGET, options=Options(chunk=CHUNK))


def test_a_model_called_with_dynamo_disabled_inside_the_step_is_not_taken_for_compiled() -> None:
    """A call through ``torch._dynamo.disable`` (dynamo's ``DisableContext``, the frame
    ``torch.compile``'s entry also runs in) is eager: it trains, bitwise. LBFGS's ``step()`` runs
    under one once ``torch.compile`` has run in the process, and before 2026-11-29 the model
    its closure calls was refused as compiled."""
    ref, ref_opt = _fresh()
    model, opt = _fresh()

    @torch._dynamo.disable
    def loss_of(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    with OutOfCore(model, opt, budget=BUDGET, options=Options(chunk=CHUNK)) as engine:
        for step in range(3):
            _in_core_step(ref, ref_opt, step)
            x, y = _batch(step)
            torch.manual_seed(1000 + step)
            with engine.step():
                loss_of(model, x, y).backward()
                engine.optimizer_step()
            _assert_same(ref, model)
