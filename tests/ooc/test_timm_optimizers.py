"""timm's optimizers under the engine, every kind managed: bitwise as in core.

Libraries' optimizers hold what PyTorch's do not: timm's ``Lamb`` keeps its step count in a
tensor of each parameter group (the engine's dry runs of the update advanced it: not bitwise
until 2026-11-29), ``Lookahead`` is made from another optimizer without
``Optimizer.__init__``, others branch on the data (``adamp``, ``novograd``: their update is
not measured on ``meta`` twins). timm does not import beside this suite's torch 2.13 (it needs
torchvision), so ``tests/test_second_pytorch.py`` runs these in its torch 2.14.1 environment.
A probe of 32 of timm's optimizers, three settings each, found only Lamb's case.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import ooc
from test_users_optimizers import _assert_bitwise, _model, _steps

timm_optim = pytest.importorskip("timm.optim", exc_type=ImportError)

pytestmark = pytest.mark.timeout(300)

ALL = ("activations", "params", "grads", "optimizer_state")
NAMES = ["lamb", "adan", "madgrad", "adafactorbv", "lion", "muon", "adamp", "novograd"]


def _trained(name: str, covers: str | None, checkpoint: bool) -> dict[str, torch.Tensor]:
    """Six steps (in core where ``covers`` is None), through a checkpoint saved and loaded
    into a new model, optimizer and engine after the third where ``checkpoint``."""
    def make():
        model = _model()
        opt = timm_optim.create_optimizer_v2(model, opt=name, lr=1e-3)
        engine = None if covers is None else ooc.OutOfCore(
            model, opt, budget=(2 << 20) if covers == "managed" else (24 << 20), manage=ALL,
            options=ooc.Options(chunk="64KiB", budget_covers=covers))
        return model, opt, engine

    model, opt, engine = make()
    _steps(model, opt, engine, range(3))
    if checkpoint:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        if engine is not None:
            engine.close()
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        model, opt, engine = make()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    _steps(model, opt, engine, range(3, 6))
    if engine is not None:
        assert engine.stats()["bytes_out"] > 0
        engine.close()
    return copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("covers", ["managed", "step"])
@pytest.mark.parametrize("name", NAMES)
def test_timm_optimizer_trains_bitwise_with_every_kind_managed(name: str, covers: str) -> None:
    """Every kind managed under a budget that swaps (and one for the whole step; the Lamb and
    Adan ones through a checkpoint saved and loaded between steps): bitwise as in core."""
    checkpoint = name in ("lamb", "adan")
    ref, got = _trained(name, None, checkpoint), _trained(name, covers, checkpoint)
    for key, a in ref.items():
        assert torch.equal(a, got[key]), f"{name}: {key} differs from training without ooc"


def test_timm_lookahead_trains_its_activations_and_refuses_the_rest() -> None:
    """``Lookahead`` has no state-dict hooks: activations managed, bitwise; every kind, the
    ``OOCError`` that says so."""
    model = _model()
    with pytest.raises(ooc.OOCError, match="Lookahead has no state_dict hooks"):
        ooc.OutOfCore(model, timm_optim.create_optimizer_v2(model, opt="lookahead_adam", lr=1e-3),
                      budget=2 << 20, manage=ALL)
    ref, got = _model(), _model()
    ref_opt, opt = (timm_optim.create_optimizer_v2(m, opt="lookahead_adam", lr=1e-3) for m in (ref, got))
    _steps(ref, ref_opt, None, range(4))
    with ooc.OutOfCore(got, opt, budget=2 << 20, options=ooc.Options(chunk="64KiB")) as engine:
        _steps(got, opt, engine, range(4))
        assert engine.stats()["bytes_out"] > 0
    _assert_bitwise(ref, got)
