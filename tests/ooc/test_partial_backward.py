"""Steps whose backward does not reach every node that saved an activation, and later steps
whose backward does: ``backward(inputs=...)`` on a part of the model in some steps, an
auxiliary head the loss takes in only now and then.

A plan gives an activation's bytes back after its last use in the step it was recorded from.
Saved by a node that backward never reached there, its last use was in the forward, while
autograd still held it; a later step that reached the node left its plan there, and on
demand the unpack found no bytes: the step failed with ``AttributeError: 'NoneType' object
has no attribute 'device'``. Now an activation autograd saved before a backward began and no
node unpacked counts as used to the step's end (``SavedTensors.hold_unread``), and a
read of bytes the plan did give back (a second backward that the recorded step did not run)
raises an ``OOCError`` that names the tensor, its bytes and the op, and rolls the step back.
Each loop trains a residual CNN with BatchNorm and dropout in core and under the engine, with
SGD and Adam, bitwise. The head's loss may also come from a helper that returns the loss alone
(Hugging Face's ``Trainer.compute_loss``): then, in a step that leaves the head out, its graph
is gone before the backward begins. Counted dead, its activations were given back after their
last use in the forward, and the next step that took the head in (the same ops up to the
loss, which leaves the plan only there) failed at their unpack (``OOCError``, rolled back).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from test_second_backward import ALL, _model

STEPS = 8
BUDGET = 6 << 20   # of ~11 MiB of saved activations a step


def _inputs_now_and_then(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every other step, gradients of the last layers only (fine-tuning the head)."""
    loss = F.cross_entropy(model(x), y)
    head = list(model[-1].parameters()) + list(model[-5].parameters())
    loss.backward(inputs=head if step % 2 else list(model.parameters()))


class _WithAux(nn.Module):
    """A trunk with an auxiliary head; the loss takes the head in on every third step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _model()
        self.aux = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk[:5](x)
        return self.trunk[5:](h), self.aux(h)


def _aux_now_and_then(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    out, aux = model(x)
    loss = F.cross_entropy(out, y)
    (loss + 0.3 * F.cross_entropy(aux, y) if step % 3 == 2 else loss).backward()


def _loss_of(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss alone, as Hugging Face's ``Trainer.compute_loss`` returns it: the head's output
    dies with this frame, so where the loss leaves the head out, autograd lets go of the head's
    graph before the backward begins."""
    out, aux = model(x)
    loss = F.cross_entropy(out, y)
    return loss + 0.3 * F.cross_entropy(aux, y) if step % 3 == 2 else loss


def _aux_from_a_helper(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    _loss_of(model, step, x, y).backward()


LOOPS = {"inputs": (_model, _inputs_now_and_then), "aux_head": (_WithAux, _aux_now_and_then),
         "aux_head_from_a_helper": (_WithAux, _aux_from_a_helper)}


def _train(model: nn.Module, loop, optimizer: str, manage: tuple[str, ...] | None,
           device: str = "cpu") -> dict:
    """The loop in core (``manage`` None) or under the engine on ``device``; the engine's stats."""
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    engine = (ooc.OutOfCore(model, opt, budget=BUDGET, manage=manage, device=device)
              if manage is not None else None)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        if next(model.parameters()).is_cuda:   # a real GPU (the fake driver's model stays here)
            x, y = x.cuda(), y.cuda()
        torch.manual_seed(100 + step)   # dropout
        with engine.step() if engine is not None else contextlib.nullcontext():
            loop(model, step, x, y)
            opt.step()
            opt.zero_grad()
    if engine is None:
        return {}
    stats = engine.stats()
    engine.close()
    return stats


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("manage", ["activations", "all"])
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_node_the_recorded_backward_did_not_reach_keeps_its_activations(
        name: str, manage: str, optimizer: str) -> None:
    build, loop = LOOPS[name]
    ref = build()
    got = copy.deepcopy(ref)
    _train(ref, loop, optimizer, None)
    stats = _train(got, loop, optimizer, ALL if manage == "all" else ("activations",))
    assert stats["bytes_out"] > 0 and stats["steps.diverged"] > 0, "the case must swap and leave its plan"
    for (key, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), key


def test_an_auxiliary_head_now_and_then_on_the_cuda_path_over_the_fake_driver() -> None:
    """FAKE DRIVER: the auxiliary head's loop with ``device="cuda"`` (``ooc.testing.fake_cuda``,
    the default arena), every driver call within the real driver's contract."""
    import ooc.testing

    ref = _WithAux()
    got = copy.deepcopy(ref)
    _train(ref, _aux_now_and_then, "adam", None)
    with ooc.testing.fake_cuda() as driver:
        stats = _train(got, _aux_now_and_then, "adam", ("activations",), device="cuda")
        assert driver.violations == [], driver.violations
    assert stats["bytes_out"] > 0 and stats["steps.diverged"] > 0
    for (key, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_gpu_a_node_the_recorded_backward_did_not_reach_keeps_its_activations(name: str) -> None:
    """REAL GPU (skips without one): both loops on CUDA, cuDNN deterministic, the default
    arena, bitwise against the same loop without the engine."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    build, loop = LOOPS[name]
    ref = build().cuda()
    got = copy.deepcopy(ref)
    _train(ref, loop, "adam", None)
    stats = _train(got, loop, "adam", ("activations",), device="cuda")
    assert stats["steps.diverged"] > 0
    for (key, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), key


def test_a_second_backward_the_recorded_step_did_not_run_names_what_it_reads() -> None:
    """A graph kept with ``retain_graph=True`` in every step, and in one step a second
    backward over it: the plan gave back what the first backward had read (the recorded
    steps read it once), so the step fails, saying what, and leaves the model as before it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = ooc.OutOfCore(model, opt, budget=BUDGET)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    for _ in range(3):
        with engine.step():
            F.cross_entropy(model(x), y).backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ooc.OOCError, match=r"reads the saved activation .* B\).*retain_graph") as err:
        with engine.step():
            out = model(x)
            F.cross_entropy(out, y).backward(retain_graph=True)
            out.pow(2).mean().backward()
            opt.step()
    assert "aten." in str(err.value), "the op that read it is named"
    opt.zero_grad()
    for key, a in before.items():
        assert torch.equal(a, model.state_dict()[key]), key
    with engine.step():   # the engine goes on
        F.cross_entropy(model(x), y).backward()
        opt.step()
    engine.close()
