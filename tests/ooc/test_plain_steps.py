"""Plain steps: a verified plan that moves nothing runs without the dispatch mode.

Issue 16 item 9: with nothing to move, an engine may cost at most 5% over in-core, and
PyTorch's Python dispatch alone costs more than that on small models. Time is not asserted
(benchmarks/bench_overhead.py measures it); what is: that such steps run no op through the
engine, give parameters and BatchNorm statistics bitwise equal to in-core training, that a
step that saves other tensors than the plan's is noticed, kept near the budget and re-planned,
and that a failed plain step is rolled back like any other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc import OOCError, OutOfCore, Options
from ooc.runtime import stepper as stepper_module

pytestmark = pytest.mark.timeout(180)


class Net(nn.Module):
    """Conv-BN-ReLU, a residual block, dropout, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(out)) + out)
        return self.fc(self.drop(torch.flatten(y, 1)))


def fresh(opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    if opt == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(model, opt, engine, steps, sizes=None, fail_at=None, hidden=False) -> list[dict]:
    """``steps`` steps (batch size ``sizes[i]``); the step ``fail_at`` raises after backward.
    ``hidden``: the engine's steps call ``model.forward`` (no hooks), so the engine does not
    see a step's shape before it runs: it runs the last step's plan. Returns the engine's
    stats after each step (empty dicts in core)."""
    out = []
    for i in range(steps):
        x, y = batch(i, sizes[i] if sizes else 8)
        torch.manual_seed(1000 + i)   # dropout's masks: the same draws in both runs
        if engine is None:
            if i == fail_at:
                continue   # in core, the failed step is as if it never ran
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append({})
            continue
        try:
            with engine.step():
                F.cross_entropy((model.forward if hidden else model)(x), y).backward()
                if i == fail_at:
                    raise RuntimeError("the user's code failed")
                opt.step()
                opt.zero_grad(set_to_none=True)
        except RuntimeError as e:
            assert i == fail_at and "user's code" in str(e)
        out.append(engine.stats())
    return out


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs from in-core training"


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_plan_that_moves_nothing_runs_plain_and_bitwise(monkeypatch, opt) -> None:
    ref, ref_opt = fresh(opt)
    train(ref, ref_opt, None, 7)
    model, o = fresh(opt)
    ops = []
    on_op = stepper_module.Stepper.on_op

    def counting(self, func, args, kwargs):
        ops.append(len(ops))
        return on_op(self, func, args, kwargs)

    monkeypatch.setattr(stepper_module.Stepper, "on_op", counting)
    with OutOfCore(model, o, budget="64MiB", options=Options(chunk="64KiB")) as engine:
        stats = []
        for i in range(7):
            before = len(ops)
            x, y = batch(i)
            torch.manual_seed(1000 + i)
            with engine.step():
                F.cross_entropy(model(x), y).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            stats.append(engine.stats() | {"ops seen": len(ops) - before})
    assert stats[-1]["plan.bytes_out"] == stats[-1]["plan.bytes_recomputed"] == 0
    assert stats[-1]["plan.variables"] > 0   # activations are managed; the plan keeps them
    plain = [s for s in stats if s["ops seen"] == 0]
    # record, re-plan once the optimizer's state exists, verify the plan: then plain
    assert len(plain) >= 4 and stats[-1]["steps.plain"] == len(plain), [s["ops seen"] for s in stats]
    assert all(s["last_planned"] and s["last_diverged_at"] == -1 for s in plain)
    first = stats.index(plain[0])   # the recording step wrote activations out; no plain step did
    assert (stats[-1]["bytes_out"], stats[-1]["bytes_in"]) == (stats[first - 1]["bytes_out"],
                                                               stats[first - 1]["bytes_in"])
    assert_same(ref, model)


def test_plain_steps_are_off_when_the_plan_moves_bytes() -> None:
    # Swap only: with recompute priced on the recording's op seconds, a fast machine's plan
    # recomputed every tensor and moved none.
    model, o = fresh("sgd")
    with OutOfCore(model, o, budget="512KiB", options=Options(chunk="64KiB"), recompute="never") as engine:
        stats = train(model, o, engine, 5)
    assert stats[-1]["plan.bytes_out"] > 0 and stats[-1]["steps.plain"] == 0


def test_a_larger_batch_in_a_plain_step_keeps_its_saved_bytes_near_the_budget() -> None:
    """The plan was made for batch 8; batch 32 saves four times the bytes. Called so that the
    engine does not see its shape first (``model.forward``; seen, the step would take up a plan
    of its shape, test_variable_shapes.py), the plain step notices at its first saved tensor of
    another size, writes to the tier what would take its saved activations over the budget,
    reads them back for the backward (bitwise), and the next step records again."""
    sizes = [8, 8, 8, 8, 32, 32, 32, 32, 8]
    ref, ref_opt = fresh("sgd")
    train(ref, ref_opt, None, len(sizes), sizes)
    model, o = fresh("sgd")
    with OutOfCore(model, o, budget="2MiB", options=Options(chunk="64KiB")) as engine:
        stats = train(model, o, engine, len(sizes), sizes, hidden=True)
    assert stats[3]["steps.plain"] >= 1 and stats[3]["plan.bytes_out"] == 0
    big = stats[4]
    assert big["steps.plain"] == stats[3]["steps.plain"] + 1   # it ran plain, and diverged
    assert big["last_diverged_at"] >= 0 and not big["last_planned"]
    written, read = (big[k] - stats[3][k] for k in ("bytes_out", "bytes_in"))
    assert written > 0 and read == written
    assert big["resident_peak_bytes"] <= big["budget"]
    assert stats[5]["last_planned"] == 0 and stats[5]["steps.plain"] == big["steps.plain"]  # records
    assert_same(ref, model)


def test_a_smaller_batch_diverges_without_writing_anything() -> None:
    sizes = [8, 8, 8, 8, 4, 8, 8, 8]
    ref, ref_opt = fresh("sgd")
    train(ref, ref_opt, None, len(sizes), sizes)
    model, o = fresh("sgd")
    with OutOfCore(model, o, budget="8MiB", options=Options(chunk="64KiB")) as engine:
        stats = train(model, o, engine, len(sizes), sizes, hidden=True)   # its shape unseen: see above
    assert stats[4]["last_diverged_at"] >= 0 and stats[4]["steps.plain"] == stats[3]["steps.plain"] + 1
    assert stats[4]["bytes_out"] == stats[3]["bytes_out"]
    assert stats[-1]["last_planned"] and stats[-1]["last_diverged_at"] == -1
    assert_same(ref, model)


def test_a_plain_step_that_fails_is_rolled_back() -> None:
    """BatchNorm's running statistics were updated by the failed step's forward: the plain
    step copied them when it started and puts them back; the gradients it made are dropped."""
    ref, ref_opt = fresh("sgd")
    train(ref, ref_opt, None, 7, fail_at=4)
    model, o = fresh("sgd")
    with OutOfCore(model, o, budget="8MiB", options=Options(chunk="64KiB")) as engine:
        stats = train(model, o, engine, 7, fail_at=4)
        assert stats[4]["steps.plain"] == stats[3]["steps.plain"] + 1   # the failed one was plain
        assert all(p.grad is None for p in model.parameters())
    assert stats[-1]["steps.plain"] > stats[4]["steps.plain"]
    assert_same(ref, model)


def test_gradient_accumulation_runs_plain_in_both_starting_states() -> None:
    ref, ref_opt = fresh("sgd")
    model, o = fresh("sgd")
    engine = OutOfCore(model, o, budget="8MiB", options=Options(chunk="64KiB"))
    for m, opt, e in ((ref, ref_opt, None), (model, o, engine)):
        for i in range(12):
            x, y = batch(i)
            torch.manual_seed(1000 + i)
            with e.step() if e is not None else torch.enable_grad():
                (F.cross_entropy(m(x), y) / 2).backward()
                if i % 2:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    stats = engine.stats()
    engine.close()
    assert stats["steps.plain"] >= 4 and stats["last_diverged_at"] == -1
    assert_same(ref, model)


def test_another_engine_inside_a_plain_step_is_refused() -> None:
    model, o = fresh("sgd")
    other, other_opt = fresh("sgd")
    with OutOfCore(model, o, budget="8MiB", options=Options(chunk="64KiB")) as engine, \
            OutOfCore(other, other_opt, budget="8MiB", options=Options(chunk="64KiB")) as inner:
        train(model, o, engine, 5)
        assert engine.stats()["steps.plain"] >= 1
        with engine.step():
            with pytest.raises(OOCError, match="do not nest"):
                with inner.step():
                    pass
            x, y = batch(9)
            F.cross_entropy(model(x), y).backward()


def test_save_on_cpu_inside_a_plain_step_is_refused_at_the_next_step() -> None:
    """No per-op check runs in a plain step: hooks entered inside it take the saved tensors
    away from its guard, the step diverges, and the step after it (recorded through the
    dispatch mode) refuses them by name, as in any recorded step."""
    model, o = fresh("sgd")
    with OutOfCore(model, o, budget="8MiB", options=Options(chunk="64KiB")) as engine:
        train(model, o, engine, 5)
        for i in range(2):
            x, y = batch(20 + i)
            try:
                with engine.step():
                    with torch.autograd.graph.save_on_cpu():
                        F.cross_entropy(model(x), y).backward()
            except OOCError as e:
                assert i == 1 and "were entered inside engine.step()" in str(e), (i, str(e))
                break
        else:
            pytest.fail("save_on_cpu inside the step was never refused")
        assert engine.stats()["steps.plain"] >= 2   # the first of the two ran plain


def test_a_saved_parameter_is_told_from_an_activation_as_isinstance_tells_it() -> None:
    """The hook-driven steps ask at every save whether the tensor is a parameter or a view of
    one (its bytes are never swapped); the quick answer is the metaclass's own, in each case."""
    from ooc.runtime.saved_tensors import _of_parameter

    p = nn.Parameter(torch.randn(4, 4))
    flagged = torch.randn(4, 4)
    flagged._is_param = True   # what Parameter's metaclass counts as one (FSDP's unsharded views)

    class Sub(torch.Tensor):
        pass

    cases = [p, p.t(), p[1:], p.detach(), torch.randn(4, 4), torch.randn(4, 4)[1:], flagged, flagged[1:],
             torch.randn(2).as_subclass(Sub), p.detach().as_subclass(Sub), torch.empty(3, device="meta")]
    want = [isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) for t in cases]
    assert [_of_parameter(t) for t in cases] == want
    assert want[:4] == [True, True, True, False] and want[6:8] == [True, True] and not any(want[4:6])
