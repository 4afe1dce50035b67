"""Out-of-core training gives bitwise identical parameters and losses to in-core training.

Real models (BatchNorm, dropout, long skip connections), SGD with momentum and Adam, each
``manage`` combination, budgets of 1/2 and 1/4 of the in-core managed peak, 6 steps each.
Sizes are small so the whole file runs in well under a minute on 2 cores; chunks are 64 KiB
so that these small tensors are managed at all.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.engine import Options, OutOfCore

CHUNK = 16 << 10
STEPS = 6


class BNCNN(nn.Module):
    """conv-BN-ReLU blocks with residual connections and dropout; deep enough that a
    quarter of its peak still holds the largest single op."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
            for _ in range(blocks))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(F.adaptive_avg_pool2d(x, 4))


def _double_conv(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class TinyUNet(nn.Module):
    """Two levels down, two up: long skip connections held across the whole forward."""

    def __init__(self) -> None:
        super().__init__()
        c = 8
        self.d1 = _double_conv(3, c)
        self.d2 = _double_conv(c, 2 * c)
        self.mid = _double_conv(2 * c, 2 * c)
        self.u2 = _double_conv(4 * c, c)
        self.u1 = nn.Sequential(_double_conv(2 * c, c), nn.Conv2d(c, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        u = self.u2(torch.cat([F.interpolate(m, scale_factor=2.0), s2], 1))
        return self.u1(torch.cat([F.interpolate(u, scale_factor=2.0), s1], 1))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.out = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos
        return self.out(self.blocks(h, mask=self.mask, is_causal=True))


def _data(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "cnn":
        return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    if kind == "unet":
        return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 2, (4, 32, 32), generator=g)
    idx = torch.randint(0, 64, (8, 33), generator=g)
    return idx[:, :-1], idx[:, 1:]


MODELS = {"cnn": BNCNN, "unet": TinyUNet, "gpt": TinyGPT}


def _loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _fresh(kind: str, opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MODELS[kind]()
    return model, _optimizer(opt, model)


def _train(kind: str, opt_name: str, engine_kw: dict | None, steps: int = STEPS):
    model, opt = _fresh(kind, opt_name)
    engine = OutOfCore(model, opt, options=Options(chunk=CHUNK, min_bytes=4096), **engine_kw) if engine_kw else None
    losses = []
    for step in range(steps):
        x, y = _data(kind, step)
        torch.manual_seed(1000 + step)   # dropout
        if engine is None:
            loss = _loss(kind, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with engine.step():
                loss = _loss(kind, model(x), y)
                loss.backward()
                engine.optimizer_step()
        losses.append(loss.detach().clone())
    stats = None
    if engine is not None:
        stats = engine.stats()
        engine.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, opt, stats


_REFERENCE: dict = {}


def _reference(kind: str, opt: str):
    if (kind, opt) not in _REFERENCE:
        _REFERENCE[kind, opt] = _train(kind, opt, None)
    return _REFERENCE[kind, opt]


_PEAK: dict = {}


def managed_peak(kind: str, opt: str, manage: tuple[str, ...]) -> int:
    """The in-core peak of the managed tensors, from a step recorded with a huge budget."""
    key = (kind, opt, manage)
    if key not in _PEAK:
        model, optimizer = _fresh(kind, opt)
        with OutOfCore(model, optimizer, budget="4GiB", options=Options(chunk=CHUNK, min_bytes=4096), manage=manage) as e:
            for step in range(2):
                x, y = _data(kind, step)
                with e.step():
                    _loss(kind, model(x), y).backward()
                    e.optimizer_step()
            _PEAK[key] = e._plans.schedule.sequence.in_core_peak_bytes
    return _PEAK[key]


def assert_same(reference, got) -> None:
    ref_losses, ref_state, ref_opt, _ = reference
    losses, state, opt, _ = got
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i} differs: {a.item()} vs {b.item()}"
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), f"{name} differs after {STEPS} steps"
    for (p, s_ref), s in zip(ref_opt.state.items(), opt.state.values()):
        for k in s_ref:
            assert torch.equal(s_ref[k], s[k]), f"optimizer state {k} differs"


MANAGE = {
    "activations": ("activations",),
    "params": ("params",),
    "grads": ("grads",),
    "optimizer_state": ("optimizer_state",),
    "act+params": ("activations", "params"),
    "all": ("activations", "params", "grads", "optimizer_state"),
}


@pytest.mark.parametrize("fraction", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["cnn", "unet", "gpt"])
def test_bitwise_identical_all_managed(kind: str, opt: str, fraction: int) -> None:
    manage = MANAGE["all"]
    budget = managed_peak(kind, opt, manage) // fraction
    got = _train(kind, opt, {"budget": budget, "manage": manage})
    assert_same(_reference(kind, opt), got)
    stats = got[3]
    assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0, "a quarter budget must move bytes"
    assert stats["plan.peak_resident_bytes"] <= budget


@pytest.mark.parametrize("manage", list(MANAGE))
@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_bitwise_identical_each_manage_combination(kind: str, manage: str) -> None:
    opt = "adam"
    budget = managed_peak(kind, opt, MANAGE[manage]) // 2
    got = _train(kind, opt, {"budget": budget, "manage": MANAGE[manage]})
    assert_same(_reference(kind, opt), got)


def test_plenty_of_budget_moves_nothing_after_planning() -> None:
    model, opt = _fresh("cnn", "sgd")
    with OutOfCore(model, opt, budget="4GiB", options=Options(chunk=CHUNK, min_bytes=4096)) as e:
        for step in range(3):
            x, y = _data("cnn", step)
            with e.step():
                _loss("cnn", model(x), y).backward()
                e.optimizer_step()
        assert e._plans.schedule.bytes_in == 0 and e._plans.schedule.bytes_out == 0
        assert e.stats()["last_planned"] == 1


def test_budget_too_small_fails_in_step_one_and_leaves_model_untouched() -> None:
    model, opt = _fresh("cnn", "adam")
    before = copy.deepcopy(model.state_dict())
    e = OutOfCore(model, opt, budget=CHUNK, options=Options(chunk=CHUNK, min_bytes=4096), manage=MANAGE["all"])
    x, y = _data("cnn", 0)
    with pytest.raises(ooc.BudgetTooSmall) as err:
        with e.step():
            _loss("cnn", model(x), y).backward()
            e.optimizer_step()
    assert "raise the budget to at least" in str(err.value)
    assert err.value.minimum > CHUNK
    e.close()
    for k, v in before.items():
        assert torch.equal(v, model.state_dict()[k]), f"{k} changed although step 1 failed"
    assert not opt.state, "the optimizer must not have stepped"


def test_another_batch_shape_is_recorded_and_both_plans_kept() -> None:
    """A different batch shape changes the op sequence: the model's forward shows it before
    any op ran, so the step runs on demand (recorded, not diverged) and is planned; the first
    shape's plan is kept and runs again when that shape comes back (test_variable_shapes.py)."""
    model, opt = _fresh("cnn", "sgd")
    ref_model, ref_opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations",)) // 2
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096))
    shapes = [16, 16, 8, 8, 16]
    for step, n in enumerate(shapes):
        x, y = _data("cnn", step)
        x, y = x[:n], y[:n]
        for m, o, eng in ((model, opt, e), (ref_model, ref_opt, None)):
            torch.manual_seed(step)
            if eng is None:
                _loss("cnn", m(x), y).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            else:
                with eng.step():
                    _loss("cnn", m(x), y).backward()
                    eng.optimizer_step()
        if step == 2:
            assert e.stats()["last_diverged_at"] == -1 and e.stats()["last_planned"] == 0
    assert e.stats()["last_planned"] == 1 and e.stats()["plans_kept"] == 2
    e.close()
    for (k, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_eval_between_steps_and_close_leave_plain_pytorch() -> None:
    model, opt = _fresh("cnn", "sgd")
    ref, ref_opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", MANAGE["all"]) // 2
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=MANAGE["all"])
    xe, _ = _data("cnn", 99)
    for step in range(4):
        x, y = _data("cnn", step)
        torch.manual_seed(step)
        with e.step():
            _loss("cnn", model(x), y).backward()
            e.optimizer_step()
        torch.manual_seed(step)
        _loss("cnn", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        model.eval()
        ref.eval()
        with torch.no_grad(), e.resident():
            assert torch.equal(model(xe), ref(xe))
        model.train()
        ref.train()
    e.close()
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    # After close the model is ordinary PyTorch: train it without the engine.
    x, y = _data("cnn", 7)
    _loss("cnn", model(x), y).backward()
    opt.step()


def test_gradient_accumulation_over_steps() -> None:
    model, opt = _fresh("cnn", "sgd")
    ref, ref_opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations", "grads")) // 2
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), manage=("activations", "grads"))
    for step in range(6):
        x, y = _data("cnn", step)
        torch.manual_seed(step)
        with e.step():
            _loss("cnn", model(x), y).backward()
            if step % 2 == 1:
                e.optimizer_step()
        torch.manual_seed(step)
        _loss("cnn", ref(x), y).backward()
        if step % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    e.close()
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_gradient_accumulation_with_unmanaged_grads_is_planned() -> None:
    """Issue 16, item 5: one step per micro-batch, an update every 4th, activations managed.
    The first micro-batch of a window creates the grads, the others add to them, the 4th also
    updates: three op sequences. They used to share one plan (its key, the managed persistent
    tensors, is empty here) and re-plan at every step; now each starting state keeps its plan,
    and after the first two windows (the second update meets momentum that now exists)
    every step runs planned, bitwise as in-core accumulation."""
    model, opt = _fresh("cnn", "sgd")
    ref, ref_opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations",)) // 2
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096))
    plans = []
    for step in range(12):
        x, y = _data("cnn", step)
        torch.manual_seed(step)
        with e.step():
            _loss("cnn", model(x), y).backward()
            if step % 4 == 3:
                e.optimizer_step()
        torch.manual_seed(step)
        _loss("cnn", ref(x), y).backward()
        if step % 4 == 3:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        stats = e.stats()
        plans.append(stats["plans"])
        if step >= 8:
            assert stats["last_planned"] == 1 and stats["last_diverged_at"] == -1, (step, stats)
    assert plans[-1] == plans[7], f"plans kept growing after the warm-up: {plans}"
    assert e.stats()["bytes_out"] > 0, "half the peak must swap activations"
    e.close()
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("kinds", [False, True])
def test_steps_that_start_alike_keep_a_plan_per_kind(kinds: bool) -> None:
    """Lightning's accumulation, one step per micro-batch: gradients are zeroed inside a
    window's first micro-batch, after its forward, so both micro-batches start with
    gradients; the first zeroes them, the second updates. Their start states are alike, so
    without a kind each replaces the other's plan and every step runs on demand; with
    ``engine.step(kind)`` each keeps its plan and the steps after the warm-up run planned
    (without one, after five steps in a row that kept no plan the engine stops planning from
    each: ``scheduler.step_plans.plans_again``).
    Bitwise as in core either way."""
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256),
                            nn.ReLU(), nn.Linear(256, 10))
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    model, opt = fresh()
    ref, ref_opt = fresh()
    e = OutOfCore(model, opt, budget="192KiB", options=Options(chunk=CHUNK, min_bytes=4096), # 3/4 of its peak
                  recompute="never")   # the plan swaps (recomputing instead depends on measured times)
    planned = []
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
        for net, o, engine in ((model, opt, e), (ref, ref_opt, None)):
            torch.manual_seed(step)
            with engine.step(step % 2 if kinds else None) if engine else contextlib.nullcontext():
                loss = F.cross_entropy(net(x), y)
                if step % 2 == 0:
                    o.zero_grad(set_to_none=True)
                loss.backward()
                if step % 2 == 1:
                    o.step()
        planned.append(e.stats()["last_planned"])
    assert e.stats()["plan.bytes_out"] > 0, "the plan must move bytes"
    e.close()
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    if kinds:
        assert all(planned[6:]), f"steps after the warm-up must run planned: {planned}"
    else:   # why the kind is there: they replace each other's plan, on demand, until the
        # engine plans from them at doubling intervals only (``plans_again``), and then one
        # kind's plan is run by both: not every step runs planned
        assert not any(planned[2:6]) and not all(planned[6:]), f"alike starts shared a plan: {planned}"


@pytest.mark.parametrize("bad, words", [
    ({"budget": 0}, "budget: must be"), ({"budget": -5}, "budget: must be"),
    ({"budget": "sixteen"}, "not a size"), ({"budget": "16 GBs"}, "not a size"),
    # the default chunk adapts down to a page (below 2 MiB budgets too): below a page, refused
    ({"budget": "2KiB"}, "smaller than one chunk"), ({"budget": "1MiB", "chunk": "2MiB"}, "smaller than one chunk"),
    ({"budget": "1GiB", "chunk": "3000"}, "granularity"),
    ({"budget": "1GiB", "manage": ("weights",)}, "unknown kind"),
    ({"budget": "1GiB", "device": "cuda"}, r"ooc\[cuda\]|no usable CUDA"),
    ({"budget": "1GiB", "device": "mps"}, "runs on 'cpu' or 'cuda'"),
])
def test_bad_arguments_fail_before_any_work(bad: dict, words: str) -> None:
    model, opt = _fresh("cnn", "sgd")
    options = {k: bad.pop(k) for k in ("chunk",) if k in bad}
    with pytest.raises(ooc.OOCError, match=words):
        OutOfCore(model, opt, options=Options(**options), **bad)


class _TwoOptimizers:
    """What a GAN's loop may hold: two optimizers behind one object, not itself an optimizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.g = torch.optim.SGD(model.parameters(), lr=0.1)
        self.d = torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_model_or_optimizer_of_another_type_is_refused_by_name() -> None:
    """Not an ``AttributeError`` from deep inside the engine (``register_step_pre_hook``)."""
    model, _ = _fresh("cnn", "sgd")
    with pytest.raises(ooc.OOCError, match="optimizer must be a torch.optim.Optimizer, an object that wraps one, or None, got _TwoOptimizers"):
        OutOfCore(model, _TwoOptimizers(model), budget="1GiB")
    with pytest.raises(ooc.OOCError, match="model must be a torch.nn.Module, got function"):
        OutOfCore(lambda x: model(x), budget="1GiB")


def test_a_closed_engine_leaves_none_of_its_step_sequences_alive() -> None:
    """What an engine recorded and planned (sequences, their chains and facts) goes with it:
    a module-level cache of the chains found in them (``scheduler.replay``) kept the last 65
    sequences planned with recomputation alive after their engine had closed."""
    import gc
    import weakref

    from scheduler.ir import VariableSequence

    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, VariableSequence)}
    model, opt = _fresh("cnn", "adam")
    e = OutOfCore(model, opt, budget=managed_peak("cnn", "adam", MANAGE["all"]) // 2,
                  options=Options(chunk=CHUNK, min_bytes=4096), manage=MANAGE["all"], recompute="prefer")
    for step in range(4):
        x, y = _data("cnn", step)
        with e.step():
            _loss("cnn", model(x), y).backward()
            e.optimizer_step()
    assert e.stats()["bytes_recomputed"] > 0
    gc.collect()
    made = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, VariableSequence) and id(o) not in before]
    assert made
    e.close()
    del e
    gc.collect()
    assert [len(r().functions) for r in made if r() is not None] == []


def test_swap_directory_is_private_and_empty_after_close(tmp_path) -> None:
    model, opt = _fresh("cnn", "sgd")
    budget = managed_peak("cnn", "sgd", ("activations",)) // 4
    e = OutOfCore(model, opt, budget=budget, options=Options(chunk=CHUNK, min_bytes=4096), storage=str(tmp_path))
    x, y = _data("cnn", 0)
    with e.step():
        _loss("cnn", model(x), y).backward()
        e.optimizer_step()
    entries = os.listdir(tmp_path)
    assert len(entries) == 1
    private = tmp_path / entries[0]
    assert (os.stat(private).st_mode & 0o777) == 0o700
    assert not [f for f in os.listdir(private) if os.path.isfile(private / f)], "swap file must be unlinked"
    e.close()
    assert os.listdir(tmp_path) == []
