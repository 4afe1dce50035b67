"""``Options(budget_covers="step")``: a budget for every tensor of the step, not only ooc's.

The engine records the whole step once, gives its managed tensors what is left of the budget
where the step holds the most beside them (less, on the CPU, its allocator's cache), and from
then on plans as ever: training stays bitwise that of plain PyTorch. The process's peak, in a
fresh process (VmHWM), stays within the budget.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
import ooc.testing
from ooc import measure
from ooc.engine.lifetime import recycle_bytes
from ooc.trace import trace
from scheduler import BudgetTooSmall
from test_outside_models import least_step_budget

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


class Net(nn.Module):
    """conv-BN-ReLU blocks with a skip connection and dropout: the step's gradients of
    activations and weights peak in the backward, beside the saved activations."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(width * 8 * 8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        return self.head(F.adaptive_avg_pool2d(x, 8))


def _fresh(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, opt


def _batch(step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _whole_peak(model: nn.Module) -> int:
    """Every tensor of a step in core, at its peak: a trace on ``meta``."""
    x, y = _batch(0)
    return trace(copy.deepcopy(model).to("meta"), x.to("meta"), targets=y.to("meta"),
                 loss_fn=F.cross_entropy, device="meta").in_core_peak_bytes


def _train(engine: ooc.OutOfCore | None, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
           sizes: tuple[int, ...] = (32,)) -> None:
    for step in range(steps):
        x, y = _batch(step, sizes[step * len(sizes) // steps])
        torch.manual_seed(100 + step)   # dropout
        if engine is None:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            continue
        with engine.step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_managed_tensors_get_what_the_step_leaves_and_training_stays_bitwise(tmp_path, optimizer: str) -> None:
    ref_model, ref_opt = _fresh(optimizer)
    _train(None, ref_model, ref_opt, 5)
    model, opt = _fresh(optimizer)
    budget = _whole_peak(model) * 3 // 4
    with ooc.OutOfCore(model, opt, budget=budget, storage=str(tmp_path),
                       options=ooc.Options(chunk="64KiB", budget_covers="step")) as engine:
        _train(engine, model, opt, 5)
        stats = engine.stats()
        recording = engine.last_recording
    assert stats["step_budget"] == budget
    held = stats["step_held_bytes"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert held >= weights + state   # the step holds at least its weights and the state it keeps
    assert held <= recording.in_core_peak_bytes + state
    left = budget - recycle_bytes(budget, whole_step=True) - held
    assert left - 64 * 1024 < stats["budget"] <= left   # what is left, in whole chunks
    assert stats["plan.bytes_out"] + stats["plan.bytes_recomputed"] > 0   # the budget made it move
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"


def test_a_step_budget_under_what_the_step_holds_names_the_minimum_which_then_works(tmp_path) -> None:
    """At 4 MiB the recording step's own plan does not fit (its minimum leaves room for the
    managed tensors beside what the step starts with, and says so); at that minimum the whole
    step does not (its minimum counts what the backward holds beside them); at the latter the
    engine trains."""
    model, opt = _fresh("sgd")
    engine = ooc.OutOfCore(model, opt, budget="4MiB", storage=str(tmp_path),
                           options=ooc.Options(chunk="64KiB", budget_covers="step"))
    notes = []
    for _ in range(3):
        try:
            _train(engine, model, opt, 3)
            break
        except BudgetTooSmall as err:
            notes.append("".join(getattr(err, "__notes__", [])))
            assert err.minimum > engine.stats()["step_budget"]
            engine.set_budget(err.minimum)   # fitted again at the next recording
    assert [("starts with" in n, "holds up to" in n) for n in notes] == [(True, False), (False, True)]
    assert engine.stats()["steps"] >= 3 and engine.stats()["budget"] < engine.stats()["step_budget"]
    engine.close()


def _least_for(size: int) -> int:
    """The least step budget the engine trains batches of ``size`` under (each minimum it names, in turn)."""
    def run(budget: int, _: int) -> None:
        model, opt = _fresh("sgd")
        with ooc.OutOfCore(model, opt, budget=budget, options=ooc.Options(chunk="64KiB", budget_covers="step")) as e:
            _train(e, model, opt, 3, (size,))

    return least_step_budget(run, start=1 * MiB, tries=4)[1]


def test_a_refusal_says_whether_its_step_was_applied_and_training_goes_on_bitwise(tmp_path) -> None:
    """Under the least step budget for batches of 32, batches of 128 come: each refusal names
    the least step budget (after the first step recorded whole, beside what that step held
    beside its managed tensors, not what the step starts with), and says whether its step was
    applied: one refused before its update is rolled back (the loop runs that batch again), one
    refused after it completed says so (the loop goes on). Trained on the batches applied,
    in the order applied, the model is bitwise the one in core."""
    budget = _least_for(32)
    model, opt = _fresh("sgd")
    engine = ooc.OutOfCore(model, opt, budget=budget, storage=str(tmp_path),
                           options=ooc.Options(chunk="64KiB", budget_covers="step"))
    applied, notes = [], []
    for step, size in enumerate((32, 32, 32, 128, 128, 128)):
        for _ in range(4):
            x, y = _batch(step, size)
            torch.manual_seed(100 + step)
            try:
                with engine.step():
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            except BudgetTooSmall as err:
                note = "".join(getattr(err, "__notes__", []))
                notes.append(note)
                assert err.minimum > engine.stats()["step_budget"], (err.minimum, str(err))
                assert err.step_applied is ("this step completed" in note), (err.step_applied, note)
                engine.set_budget(err.minimum)
                if err.step_applied:
                    applied.append((step, size))
                    break
                continue
            applied.append((step, size))
            break
    engine.close()
    assert len(notes) >= 2 and "recorded whole holds" in notes[0] and "this step completed" not in notes[0], notes
    assert any("this step completed" in n for n in notes), notes
    assert [s for s, _ in applied] == list(range(6))
    ref_model, ref_opt = _fresh("sgd")
    for step, size in applied:
        x, y = _batch(step, size)
        torch.manual_seed(100 + step)
        F.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc on the batches applied"


def test_a_shape_that_holds_more_beside_lowers_the_share_and_one_that_holds_less_keeps_it(tmp_path) -> None:
    """Batches of 32, then 64 (its gradients of activations are twice the bytes), then 32
    again: the 64's recording lowers the managed tensors' share and drops the 32's plan,
    whose next step records again and keeps the lower share. Bitwise throughout."""
    sizes = (32, 64, 32)
    ref_model, ref_opt = _fresh("sgd")
    _train(None, ref_model, ref_opt, 12, sizes)
    model, opt = _fresh("sgd")
    x, y = _batch(0, 64)
    budget = trace(copy.deepcopy(model).to("meta"), x.to("meta"), targets=y.to("meta"), loss_fn=F.cross_entropy,
                   device="meta").in_core_peak_bytes * 17 // 20   # the 64's: the 32 holds less beside
    seen = []
    with ooc.OutOfCore(model, opt, budget=budget, storage=str(tmp_path),
                       options=ooc.Options(chunk="64KiB", budget_covers="step")) as engine:
        for part in range(3):
            _train(engine, model, opt, 4, (sizes[part],))
            seen.append((engine.stats()["budget"], engine.stats()["step_held_bytes"]))
    (first, held32), (second, held64), (third, held_after) = seen
    assert second < first and held64 > held32, seen
    assert third == second and held_after == held64, seen
    assert engine.stats()["steps.recorded"] >= 3   # each shape, and the 32's again after its plan went
    # the same loop without the engine, batch for batch
    ref_model, ref_opt = _fresh("sgd")
    for part in range(3):
        _train(None, ref_model, ref_opt, 4, (sizes[part],))
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"


def test_over_the_fake_cuda_driver_one_arena_gets_the_budget_less_what_the_step_holds() -> None:
    """THE DRIVER IS A FAKE (``ooc.testing.fake_cuda``): the CUDA path, host memory for the
    device's. No allocator's cache is kept back there; PyTorch's arena holds the swap-ins."""
    ref_model, ref_opt = _fresh("sgd")
    _train(None, ref_model, ref_opt, 4)
    with ooc.testing.fake_cuda() as driver:
        model, opt = _fresh("sgd")
        budget = _whole_peak(model) * 3 // 4
        engine = ooc.OutOfCore(model, opt, device="cuda", budget=budget,
                               options=ooc.Options(chunk="64KiB", min_bytes=4096, budget_covers="step"))
        _train(engine, model, opt, 4)
        stats = engine.stats()
        engine.close()
        assert not driver.violations
    assert budget - stats["step_held_bytes"] - 64 * 1024 < stats["budget"] <= budget - stats["step_held_bytes"]
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"


@pytest.mark.slow
def test_the_process_peak_stays_within_a_budget_for_the_whole_step(tmp_path) -> None:
    """ResNet-18 at batch 32 in a fresh process per case (VmHWM reset once model, optimizer
    and batch are built, and again after the two steps that record and plan): its peak rise
    with the weights it had before (which the budget covers) is within the step budget, at 7/8
    of the step's in-core peak; in core it is not."""
    x, y = ooc.models.example_batch("resnet18", 32, "meta")
    with torch.device("meta"):
        net = ooc.models.get("resnet18")
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    whole = trace(net, x, targets=y, loss_fn=ooc.models.loss_fn("resnet18"), optimizer="sgd",
                  device="meta").in_core_peak_bytes
    budget = whole * 7 // 8   # 3/4 is under what it holds beside its largest working set
    common = dict(model="resnet18", batch=32, steps=6, storage=str(tmp_path), steady_from=2)
    run = measure.run_case(measure.Case(method="ooc", budget=budget, budget_covers="step", **common))
    assert run.stats["step_budget"] == budget
    assert run.steady_peak_rise_bytes + weights <= budget, (run.steady_peak_rise_bytes, weights, budget)
    # the libraries' code the first steps paged in (file pages, which the bench reports apart): within the rise
    assert run.steady_code_rise_bytes is not None and 0 < run.steady_code_rise_bytes < run.steady_peak_rise_bytes
    in_core = measure.run_case(measure.Case(method="incore", **common))
    assert in_core.steady_peak_rise_bytes + weights > budget   # the bound is the engine's doing


@pytest.mark.gpu
def test_gpu_the_device_peak_stays_within_a_budget_for_the_whole_step() -> None:
    """REAL GPU (skips without one; not yet run on one): batch 256 of the test's CNN at 3/4 of
    its in-core peak of every tensor. PyTorch's peak allocated bytes of the steps after the
    two that record and plan stay within the step budget and cuDNN's workspaces, which no
    recording sees (an eighth of the budget allowed for them); training is bitwise."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10 + step)
        return (torch.randn(256, 3, 32, 32, generator=g).cuda(), torch.randint(0, 10, (256,), generator=g).cuda())

    def run(engine: ooc.OutOfCore | None, model: nn.Module, opt: torch.optim.Optimizer) -> int:
        for step in range(6):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            x, y = batch(step)
            torch.manual_seed(100 + step)
            with engine.step() if engine is not None else contextlib.nullcontext():
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    torch.manual_seed(0)
    ref = Net().cuda()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    base = torch.cuda.memory_allocated()
    in_core = run(None, ref, ref_opt) - base   # the batch's tensors included, as in the engine's run
    budget = in_core * 3 // 4
    engine = ooc.OutOfCore(model, opt, device="cuda", budget=budget, options=ooc.Options(budget_covers="step"))
    base = torch.cuda.memory_allocated() - sum(p.numel() * p.element_size() for p in model.parameters())
    peak = run(engine, model, opt) - base
    stats = engine.stats()
    engine.close()
    assert stats["budget"] < budget and stats["plan.bytes_out"] + stats["plan.bytes_recomputed"] > 0
    assert peak <= budget + budget // 8, (peak, budget, stats["budget"], stats["step_held_bytes"])
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from training without ooc"
