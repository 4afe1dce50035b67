"""Issue 42: PyTorch's module database (``torch.testing._internal.common_modules.module_db``,
114 ``nn`` modules with sample inputs) trains bitwise under the engine.

Each sample, in training mode: one step in core, then two inside ``OutOfCore`` (the
recording step and a planned one) at the smallest budget that plans, against the same two
steps in core (``db_steps.compare`` says how and why). The plan's choice is forced each
way: swap only (``recompute="never"``) and ``recompute="prefer"``, with activations managed
or every kind; and under a budget for the whole step (``Options(budget_covers="step")``) at the
least the engine names, which found the share capped below the planner's chunks (every sample
of ``nn.ReLU``, ``nn.BatchNorm2d``, ``nn.LSTM`` and 30 more modules refused at every budget;
all 1,802 samples bitwise since). A sample that fails in core (PyTorch's own sample does not run) is skipped
with its reason.

What runs, to stay within the suite's time (the whole database under every setting takes
~10 minutes on a 2-core machine; this file ~1): a deterministic choice. Each module's
samples are made from seed 0; up to ``PER_MODULE`` of them, evenly spaced, each under one
setting, the settings taken in turn (shifted by the module's position, so a module with one
sample does not always get the first); the recurrent modules, where issue 42's bugs were,
run every setting on each sample chosen. ``OOC_DB_FULL=1`` runs every sample under every
setting.

What it found: the GRU and LSTM cells wrote in place into a saved gate storage while the
recording step was writing it out (the tier kept the bytes from before), and the CPU LSTM's
replay under ``no_grad`` lost its workspace; a node's two unpacks with autograd's detach in
between were taken for two nodes (``MultiLabelSoftMarginLoss``: the plan gave back memory the
node still read); an anchored plan lowered its budget below zero (``L1Loss``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from db_steps import CONFIGS, FULL, WHOLE_STEP, Sample, run_chosen
from test_reliability import _one_torch_thread  # noqa: F401

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (the dev extra)")
from torch.testing._internal.common_modules import module_db  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")   # the samples' own deprecation warnings

PER_MODULE = 4
RECURRENT = {"nn.GRU", "nn.GRUCell", "nn.LSTM", "nn.LSTMCell", "nn.RNN", "nn.RNNCell"}
SETTINGS = [*CONFIGS, WHOLE_STEP]   # and a budget for the whole step, at the least it names
INFOS = {info.name: (k, info) for k, info in enumerate(module_db)}


def _samples(info: Any) -> list[Sample]:
    """The module's samples in training mode, made from seed 0 (they are random)."""
    torch.manual_seed(0)
    inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                     training=True)
    out = []
    for j, s in enumerate(inputs):
        if s.forward_input is None:
            continue
        c, f = s.constructor_input, s.forward_input
        out.append(Sample(f"{info.name}#{j}", lambda c=c: info.module_cls(*c.args, **c.kwargs).train(),
                          lambda f=f: (f.args, f.kwargs), lambda m, x: m(*x[0], **x[1])))
    return out


def _chosen(samples: list[Sample], shift: int, per: int, every: bool) -> list[tuple[Sample, str]]:
    """(sample, setting) pairs: up to ``per`` samples evenly spaced, the settings in turn from
    ``shift`` (``every``: each sample under every setting; ``FULL``: all of them)."""
    if FULL:
        return [(s, c) for s in samples for c in SETTINGS]
    n = len(samples)
    picks = sorted({round(i * (n - 1) / (per - 1)) for i in range(per)}) if n > per else range(n)
    if every:
        return [(samples[i], c) for i in picks for c in SETTINGS]
    return [(samples[i], SETTINGS[(j + shift) % len(SETTINGS)]) for j, i in enumerate(picks)]


@pytest.mark.parametrize("name", list(INFOS))
def test_module_samples_train_bitwise_under_the_engine(name: str) -> None:
    k, info = INFOS[name]
    run_chosen(_chosen(_samples(info), k, PER_MODULE, name in RECURRENT))
