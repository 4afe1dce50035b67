"""Tensors the backward reads that autograd never saved: the engine says so, once, naming them.

A custom ``autograd.Function`` that keeps a forward tensor on ``ctx`` (``ctx.a = a``) instead of
``ctx.save_for_backward(a)``, or a tensor hook whose closure holds one, keeps it alive until the
backward reads it, and no saved-tensor hook ever sees it: no plan can move it, and it stays in
memory beside the budget. Training stays bitwise (the engine never touches it); what was
missing was being told. The recording step notes, per op, the autograd node it ran inside
(``Recording.nodes``), and a storage born in the forward that an op inside a node read but
autograd never saved is reported (``Recording.held_by_nodes``): a warning where they are more
than an eighth of the budget, else an info line.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc

BUDGET = 6 << 20
KiB = 1 << 10


class _KeptOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.a = a   # held by the node, not saved: no pack hook sees it
        return a * a

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return 2 * g * ctx.a


class _Saved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        a, = ctx.saved_tensors
        return 2 * g * a


class _Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.conv, self.bn, self.how = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        if self.how == "ctx":
            h = _KeptOnCtx.apply(h)
        elif self.how == "saved":
            h = _Saved.apply(h)
        else:   # a tensor hook whose closure holds a forward tensor
            mask = (h > 0).float()
            h = h * 2
            h.register_hook(lambda g, mask=mask: g * mask)
        return x + h


def _model(how: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[_Block(how) for _ in range(8)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _train(model: nn.Module, managed: bool, steps: int = 4, seed: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ooc.OutOfCore(model, opt, budget=BUDGET) if managed else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    for _ in range(steps):
        with engine.step() if engine is not None else torch.enable_grad():
            if seed:   # the backward starts from a 512 KiB gradient of the features
                h = model[:-3](x)
                h.backward(torch.full_like(h, 1e-3))
            else:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    if engine is not None:
        engine.close()


def _said(caplog: pytest.LogCaptureFixture, how: str, seed: bool = False) -> list[logging.LogRecord]:
    ref = _model(how)
    model = copy.deepcopy(ref)
    _train(ref, False, seed=seed)
    with caplog.at_level(logging.INFO, logger="ooc"):
        _train(model, True, seed=seed)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    return [r for r in caplog.records if "held outside autograd's saved tensors" in r.getMessage()]


@pytest.mark.parametrize("how,node", [("ctx", "_KeptOnCtxBackward"), ("hook", "MulBackward0")])
def test_tensors_the_backward_reads_unsaved_are_named_once(caplog: pytest.LogCaptureFixture, how: str,
                                                           node: str) -> None:
    said = _said(caplog, how)
    assert len(said) == 1, [r.getMessage() for r in said]   # once, though the step records again
    text = said[0].getMessage()
    assert said[0].levelno == logging.WARNING   # 8 x 512 KiB: more than an eighth of the budget
    assert text.startswith("8 tensor(s), 4 MiB in all") and "512 KiB" in text and f"read by {node}" in text, text


def test_tensors_saved_for_backward_are_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    assert _said(caplog, "saved") == []


def test_the_gradient_a_backward_starts_from_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    """``h.backward(g)``: ``g``, made right before the backward, is read by every node it flows
    through as views of itself; it is the backward's input, not a tensor a node holds."""
    assert _said(caplog, "saved", seed=True) == []
