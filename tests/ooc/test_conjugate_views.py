"""Saved views with PyTorch's lazy conjugate and negative bits train bitwise under the engine.

``x.conj()`` of a complex tensor is a view of the same bytes marked "conjugated"
(``is_conj()``), ``x.conj().imag`` one marked "negated" (``is_neg()``), and autograd saves them
as they are. The engine rebuilt every view it brings back from dtype, size, stride and offset
alone, so the backward read them unconjugated: op_db's complex64 samples of ``cov``,
``masked.var``, ``masked.std``, ``linalg.lu_solve``, ``svd_lowrank`` and ``pca_lowrank`` got
wrong gradients (gaps up to 70), from the recording step on. ``ooc/runtime/views.py`` keeps
the bits wherever a view is rebuilt: an unpack (per op and anchored), a spilled activation
read back, a recompute chain's arguments and results (per op and from templates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from db_steps import CONFIGS, TEMPLATES, Sample, op_sample, run_chosen
from test_reliability import _one_torch_thread  # noqa: F401

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (the dev extra)")
from test_op_db import OPS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

FOUND = ("cov", "masked.var", "masked.std", "linalg.lu_solve", "svd_lowrank", "pca_lowrank")


@pytest.mark.parametrize("name", FOUND)
def test_complex_op_samples_train_bitwise(name: str) -> None:
    op = OPS[name][1]
    torch.manual_seed(0)
    samples = []
    for j, s in enumerate(op.sample_inputs_func(op, "cpu", torch.complex64, True)):
        if j == 2:
            break
        samples.append(op_sample(f"{name}#{j}", op, s))
    run_chosen([(s, c) for s in samples for c in CONFIGS])


class _Views(nn.Module):
    """Complex parameters whose conjugate and negated views autograd saves: ``mul`` keeps
    each factor for the other's gradient, here a conjugate view and a negative one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64, dtype=torch.cfloat) / 8)
        self.v = nn.Parameter(torch.randn(64, dtype=torch.cfloat))
        self.out = nn.Linear(64, 4)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = z @ self.w
        a = h * self.v.conj()              # saves the conjugate view of v
        b = a.conj().imag * h.real         # saves a negative view of a's bytes
        c = torch.tanh(a.real + b) * (h.conj() * a).real
        return self.out(c)


def _views_sample() -> Sample:
    def inputs() -> tuple:
        g = torch.Generator().manual_seed(3)
        return (torch.randn(16, 64, dtype=torch.cfloat, generator=g),)

    def build() -> nn.Module:
        torch.manual_seed(1)
        return _Views()

    return Sample("conjugate-and-negative-views", build, inputs, lambda m, x: m(*x))


@pytest.mark.parametrize("setting", [*CONFIGS, *TEMPLATES])
def test_a_model_saving_conjugate_and_negative_views_trains_bitwise(setting: str) -> None:
    assert any(t.is_neg() for t in _saved(_views_sample()))   # the model does what it says
    run_chosen([(_views_sample(), setting)])


def _saved(sample: Sample) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: out.append(t) or t, lambda t: t):
        sample.run(sample.module(), sample.inputs())
    return out
