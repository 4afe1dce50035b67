"""Small models under the default chunk: the chunk and threshold adapt so the budget is met.

With a fixed 2 MiB chunk, tensors under 1 MiB were never managed: a small ResNet whose saved
activations are all under 1 MiB moved 0 bytes at a quarter of its activations, which all
stayed in memory. By default the engine now chooses the chunk after its first recording
step (``scheduler/chunk_size.py``) and records again; chunk or min_bytes given explicitly
keep the old behaviour exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc import Options, OutOfCore
from scheduler.chunk_size import UNMANAGED_SHARE

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
STEPS = 4


class Block(nn.Module):
    """ResNet's BasicBlock: conv-BN-ReLU, conv-BN, the residual added in place, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (None if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.down is None else self.down(x)
        return self.relu(out)


class SmallResNet(nn.Module):
    """A ResNet for 32x32 inputs, three stages of two blocks (16-64 channels): at batch 8 it
    saves ~8.5 MiB of activations, none as large as 1 MiB (half the old default chunk)."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        layers, cin = [], width
        for i, c in enumerate((width, 2 * width, 4 * width)):
            layers += [Block(cin, c, 1 if i == 0 else 2), Block(c, c, 1)]
            cin = c
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SmallResNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def _saved_sizes() -> list[int]:
    """Bytes of each distinct storage the forward saves for backward that the step creates
    (not parameters, not the input batch): what an engine could manage."""
    model, _ = _fresh()
    x, y = _batch(0)
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if not isinstance(t, nn.Parameter) and s.data_ptr() != x.untyped_storage().data_ptr():
            sizes[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x), y)
    return list(sizes.values())


def _in_core() -> list[dict[str, torch.Tensor]]:
    model, opt = _fresh()
    states = []
    for step in range(STEPS + 1):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _train(budget: int, steps: int, reference: list[dict[str, torch.Tensor]],
           **engine_kw) -> tuple[OutOfCore, list[dict]]:
    model, opt = _fresh()
    options = {k: engine_kw.pop(k) for k in ("chunk", "min_bytes") if k in engine_kw}
    engine = OutOfCore(model, opt, budget=budget, options=Options(**options), **engine_kw)
    return engine, _steps(engine, model, range(steps), reference)


def _steps(engine: OutOfCore, model: nn.Module, steps: range,
           reference: list[dict[str, torch.Tensor]]) -> list[dict]:
    stats = []
    for step in steps:
        x, y = _batch(step)
        with engine.step():
            F.cross_entropy(model(x), y).backward()
            engine.optimizer_step()
        stats.append(engine.stats())
        for k, v in model.state_dict().items():
            assert torch.equal(v, reference[step][k]), f"{k} differs from in core after step {step}"
    return stats


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    return _in_core()


@pytest.fixture(scope="module")
def saved() -> list[int]:
    sizes = _saved_sizes()
    assert max(sizes) < MiB, "the model must save nothing the old threshold (1 MiB) manages"
    return sizes


@pytest.mark.parametrize("fixed", [{"chunk": "2MiB"}, {"min_bytes": "1MiB"}])
def test_explicit_chunk_or_min_bytes_keeps_the_old_behaviour(fixed, saved, reference) -> None:
    """What the default did before: 2 MiB chunks, nothing under 1 MiB managed; at a quarter
    of the saved activations nothing moves. Given either one, it stays so."""
    budget = sum(saved) // 4
    engine, stats = _train(budget, 2, reference, **fixed)
    assert (engine._mem.chunk, engine._mem.min_bytes) == (2 * MiB, MiB)
    assert stats[-1]["bytes_out"] == 0 and stats[-1]["bytes_in"] == 0
    engine.close()


def test_default_chunk_adapts_and_meets_a_quarter_budget(saved, reference, caplog) -> None:
    """At a quarter of its saved activations, the small ResNet now moves bytes, its managed
    peak stays within the budget, what stays with PyTorch (tensors under the adapted
    threshold) is at most an eighth of the budget, later steps run planned, and training is
    bitwise identical to in core."""
    budget = sum(saved) // 4
    assert budget >= 2 * MiB   # the old default accepted this budget (one 2 MiB chunk)
    with caplog.at_level(logging.INFO, logger="ooc.engine"):
        engine, stats = _train(budget, STEPS, reference)
    assert engine._mem.chunk < 2 * MiB and engine._mem.min_bytes == engine._mem.chunk // 2
    assert any("the next step records again" in r.message for r in caplog.records)
    last = stats[-1]
    assert last["bytes_out"] > 0 and last["bytes_in"] > 0, "a quarter budget must move bytes"
    assert last["last_planned"] and last["last_diverged_at"] == -1
    assert last["plan.bytes_out"] > 0
    for s in stats:
        assert s["resident_peak_bytes"] <= budget, s
    outside = sum(n for n in saved if n < engine._mem.min_bytes)
    assert outside <= budget // UNMANAGED_SHARE, (outside, engine._mem.min_bytes)
    engine.close()


def test_a_budget_under_two_mib_is_accepted_with_the_default_chunk(saved, reference) -> None:
    """The old default refused any budget under its 2 MiB chunk; the default chunk now starts
    at the largest power of two within the budget."""
    budget = 3 * MiB // 2
    engine, stats = _train(budget, 3, reference)
    assert engine._mem.chunk <= MiB
    assert all(s["resident_peak_bytes"] <= budget for s in stats)
    assert stats[-1]["bytes_out"] > 0
    engine.close()


def test_set_budget_chooses_the_chunk_again(saved, reference) -> None:
    """Everything fits a large budget: the chunk stays 2 MiB and nothing moves. Lowered by
    ``set_budget`` under 2 MiB, the budget is accepted, and the next recording step chooses
    a smaller chunk for it."""
    model, opt = _fresh()
    engine = OutOfCore(model, opt, budget=4 * sum(saved))
    stats = _steps(engine, model, range(2), reference)
    assert engine._mem.chunk == 2 * MiB and stats[-1]["bytes_out"] == 0
    budget = 3 * MiB // 2
    engine.set_budget(budget)
    start = engine._mem.chunk
    stats = _steps(engine, model, range(2, STEPS + 1), reference)
    assert start <= MiB and engine._mem.chunk < start
    assert stats[-1]["plan.bytes_out"] > 0 and stats[-1]["last_planned"]
    assert all(s["resident_peak_bytes"] <= budget for s in stats)
    engine.close()


@pytest.mark.parametrize("granularity", [64 << 10, 2 * MiB])
def test_on_the_cuda_path_the_vmm_granularity_is_the_floor(granularity, saved, reference, caplog) -> None:
    """Over the fake CUDA driver (model on the CPU): the chunk adapts down to the VMM
    granularity and no further. With a real GPU's 2 MiB it cannot adapt at all: the engine
    warns, naming the bytes left outside the budget and the granularity."""
    import ooc.testing

    budget = sum(saved) // 4
    with ooc.testing.fake_cuda(granularity=granularity) as driver:
        with caplog.at_level(logging.WARNING, logger="ooc.engine"):
            engine, stats = _train(budget, 3, reference, device="cuda")
        chunk = engine._mem.chunk
        engine.close()
    assert driver.violations == []
    assert chunk % granularity == 0 and chunk >= granularity
    warned = [r.message for r in caplog.records if "granularity" in r.message]
    if granularity == 2 * MiB:
        assert chunk == 2 * MiB and stats[-1]["bytes_out"] == 0
        assert warned and "stay outside it" in warned[0] and "cuda" in warned[0]
    else:
        assert chunk < 2 * MiB and stats[-1]["bytes_out"] > 0 and not warned
        assert all(s["resident_peak_bytes"] <= budget for s in stats)
