"""A model whose ops change from step to step at random: LayerDrop, each residual block
skipped with probability 0.3 in training (as wav2vec2's configuration does by default, 0.1).

No plan holds past the step it was made from: the next step skips other blocks and leaves it.
Every step was planned from (15 plans in 16 steps: the first chooses the chunk), each plan left
at the next step, and on a GPU planning takes longer than a step. Now, after ``REPLAN_STREAK`` steps in a row that kept
no plan, the engine plans from one only at doubling intervals (``scheduler.step_plans.
plans_again``); the steps between run the last plan to where they leave it, then on demand.
At the streak's first such point the step drops its plan instead, once (``Decision.trace``):
the next step records with its hook trace, and its plan is made there with its anchored form
(which the next skipped block leaves). Bitwise as in core throughout.

A step that skips a block its anchored form ran (``anchored_step.py``) saves the next layers'
tensors where the skipped block's were, of the same sizes. Where the plan's step saved one
tensor twice (a block's input, read by two layers), this step saved two: the second was bound
to the first's slot, and its node read the first's bytes back (wrong gradients, silently:
HF's Hubert at its default ``layerdrop=0.1``). Now a save bound to a variable already seen
must be the tensor seen there, else the step leaves its plan. Where the skipped block's only
parameter is a bias added (no node saves it), its chains were replayed from the next block's
saves with the skipped block's bias: what a chain makes is now checked with the parameters its
nodes read (``made_by.signature``), and a buffer read where no save shows it gets no template.
A mask drawn inside the forward at every step (HF's ViTMAE) changes no op: its anchored form holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.engine import hook_forms
from ooc.testing.forced_forms import decided
from scheduler.step_plans import REPLAN_STREAK, plans_again

STEPS = 16


class _LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
                                    for _ in range(8))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if self.training and torch.rand(()) < 0.3:
                continue
            h = h + block(h)
        return self.head(h)


def _train(model: nn.Module, managed: bool) -> list[int]:
    """Train STEPS steps (under an engine where ``managed``); the plans made so far after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ooc.OutOfCore(model, opt, budget=6 << 20) if managed else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.manual_seed(2)   # which blocks each step skips: the same draws in both runs
    plans = []
    for _ in range(STEPS):
        with engine.step() if engine is not None else torch.enable_grad():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if engine is not None:
            plans.append(engine.stats()["plans"])
    if engine is not None:
        engine.close()
    return plans


def test_a_model_whose_ops_change_at_random_is_planned_from_at_doubling_intervals() -> None:
    ref = _LayerDrop()
    model = copy.deepcopy(ref)
    _train(ref, False)
    plans = _train(model, True)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    made = [b - a for a, b in zip([0] + plans, plans)]   # 1 where a step was planned from
    # The first step chooses the chunk (the next records again); then no step keeps a plan:
    # planned from at 0, 1, 2, 4 (the traced recording: at 3 the plan was dropped for it), 6,
    # 10 steps in a row unkept (15 before).
    assert made[0] == 0 and made[1:7] == [1, 1, 1, 0, 1, 0], made
    assert made[1:] == [int(plans_again(n) and n != REPLAN_STREAK) for n in range(STEPS - 1)], made


class _SkipsItsLast(nn.Module):
    """Blocks whose input two layers save (``q`` and ``k``), then dropout and a head of the
    blocks' width; the loop sets ``skip`` to leave the last block out of one step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.k = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(3))
        self.head = nn.Linear(64, 64)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for q, k, norm in list(zip(self.q, self.k, self.norms))[:2 if self.skip else 3]:
            x = norm(x + torch.tanh(q(x)) * k(x))
        return self.head(F.dropout(x, 0.1, self.training))


def _forms(opt: torch.optim.Optimizer, engine: ooc.OutOfCore | None, steps: int, batch_of: Callable[[int], Any],
           loss_of: Callable[[Any], torch.Tensor]) -> list[tuple[str, bool]]:
    """``steps`` steps, each of ``loss_of(batch)``'s backward and an update, the batch made by
    ``batch_of(step)`` before the step begins; under ``engine`` (closed after) or in core.
    Under the engine, each step's form and whether it left its plan."""
    forms = []
    for step in range(steps):
        batch = batch_of(step)
        with engine.step() if engine is not None else torch.enable_grad():
            loss_of(batch).backward()
            opt.step()
            opt.zero_grad()
        if engine is not None:
            s = engine.stats()
            forms.append((ooc.FORMS[s["last_form"]], s["last_diverged_at"] != -1))
    if engine is not None:
        engine.close()
    return forms


def _trained_alike(ref: nn.Module, optimizer: Callable[[nn.Module], torch.optim.Optimizer], steps: int,
                   batch_of: Callable[[int], Any], loss_of: Callable[[nn.Module, Any], torch.Tensor]
                   ) -> list[tuple[str, bool]]:
    """``ref`` and a copy of it trained ``steps`` steps (``_forms``), in core and under an
    engine with a 1 MiB budget; their parameters and buffers must end bitwise equal. The
    engine's forms."""
    model = copy.deepcopy(ref)
    for m in (ref, model):
        opt = optimizer(m)
        engine = ooc.OutOfCore(m, opt, budget=1 << 20) if m is model else None
        forms = _forms(opt, engine, steps, batch_of, lambda b, m=m: loss_of(m, b))
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    return forms


def test_a_step_that_skips_a_block_of_its_anchored_form_reads_its_own_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap only, the anchored form kept whatever the times; the last block skipped at step 9."""
    monkeypatch.setattr(hook_forms.HookPlan, "judge", decided(keep=True))
    ref = _SkipsItsLast()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        def batch_of(step: int, m: nn.Module = m) -> tuple[torch.Tensor, torch.Tensor]:
            m.skip = step == 9
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 16, 64, generator=g), torch.randn(32, 16, 64, generator=g)
            torch.manual_seed(100 + step)   # dropout
            return x, y

        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        engine = ooc.OutOfCore(m, opt, budget=1 << 20, recompute="never") if m is model else None
        forms = _forms(opt, engine, 12, batch_of, lambda b, m=m: F.mse_loss(m(b[0]), b[1]))
    assert forms[8] == ("anchored", False) and forms[9] == ("anchored", True), forms
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_hugging_faces_hubert_at_its_default_layerdrop_trains_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's Hubert for CTC as its configuration comes (``layerdrop=0.1``, SpecAugment's time
    masks drawn with NumPy), templates forced (``templates_forced``): its anchored form's step
    13 skipped the last layer, and ``lm_head`` read the first layer's output in place of its
    own input on the code before (its weight alone differed; no loss did)."""
    import numpy as np

    from ooc.testing.forced_forms import templates_forced

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    templates_forced(monkeypatch.setattr)
    config = transformers.HubertConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.3, mask_time_length=2, pad_token_id=0)
    runs = []
    for managed in (False, True):
        torch.manual_seed(0)
        model = transformers.HubertForCTC(config).train()

        def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            np.random.seed(step)
            torch.manual_seed(1000 + step)
            return torch.randn(4, 4000), torch.randint(1, 32, (4, 20))

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = ooc.OutOfCore(model, opt, budget=16 << 20) if managed else None
        forms = _forms(opt, engine, 14, batch_of, lambda b, m=model: m(input_values=b[0], labels=b[1]).loss)
        if managed:
            assert ("anchored", True) in forms, "no anchored step left its plan: the case no longer skips a layer there"
        runs.append(model.state_dict())
    for (name, a), b in zip(runs[0].items(), runs[1].values()):
        assert torch.equal(a, b), name


def test_hugging_faces_vit_mae_masking_patches_at_random_each_step_trains_bitwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's ViTMAE for pre-training draws its mask inside the forward at every step (noise,
    argsort, gather: indices no step shares) beside dropout; templates forced, its anchored
    steps rerun chains from them (bytes recomputed) and train bitwise with AdamW."""
    from ooc.testing.forced_forms import templates_forced

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    templates_forced(monkeypatch.setattr)
    config = transformers.ViTMAEConfig(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, decoder_hidden_size=32, decoder_num_hidden_layers=2, decoder_num_attention_heads=4,
        decoder_intermediate_size=64, mask_ratio=0.75, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        attn_implementation="eager")
    torch.manual_seed(0)
    ref = transformers.ViTMAEForPreTraining(config).train()
    recomputed = []
    close = ooc.OutOfCore.close

    def closed(engine: ooc.OutOfCore) -> None:
        recomputed.append(engine.stats()["bytes_recomputed"])
        close(engine)

    monkeypatch.setattr(ooc.OutOfCore, "close", closed)

    def batch_of(step: int) -> torch.Tensor:
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(100 + step)   # the mask's noise and dropout
        return x

    forms = _trained_alike(ref, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 10, batch_of,
                           lambda m, x: m(pixel_values=x).loss)
    assert forms[4:] == [("anchored", False)] * 6, forms
    assert recomputed[0] > 0, "no chain was rerun: the case no longer recomputes"


class _BiasesAdded(nn.Module):
    """A linear stem, then blocks whose one tensor is a bias added (``t + b``: no node saves
    it), a parameter (read as itself, or through views: ``b[None, None]``) or a buffer, the second block skipped as LayerDrop does (a draw of
    ``torch.rand`` below 0.1), and a head."""

    def __init__(self, held_as: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head = nn.Linear(64, 64), nn.Linear(64, 64)
        self.viewed = held_as == "viewed parameter"
        self.blocks = nn.ModuleList(nn.Module() for _ in range(4))
        for block in self.blocks:
            b = torch.randn(64) / 10
            if held_as != "buffer":
                block.b = nn.Parameter(b)
            else:
                block.register_buffer("b", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            if i == 1 and self.training and torch.rand([]).item() < 0.1:
                continue
            x = F.gelu(torch.relu(x) + (block.b[None, None] if self.viewed else block.b)) * torch.tanh(x)
        return self.head(x)


@pytest.mark.parametrize("held_as", ["parameter", "viewed parameter", "buffer"])
def test_a_step_that_skips_a_block_whose_bias_no_node_saves_recomputes_with_its_own(
        monkeypatch: pytest.MonkeyPatch, held_as: str) -> None:
    """Templates forced; the second block skipped at step 9 of the anchored form. Its chains
    (``relu(x) + b`` then ``gelu``) were replayed from the next block's saves with the skipped
    block's bias on the code before, which no save showed (``at_saves``): wrong gradients,
    though the step left its plan at a later save. A parameter is now named in the signature
    of what its chain makes (``made_by._parameters``, also through view ops: ``b[None, None]``;
    ``test_templates.py`` has the walk that missed it); a buffer no step shows gets no
    template (``TemplateCapture._unseen``: its chain is swapped)."""
    from ooc.testing.forced_forms import templates_forced

    templates_forced(monkeypatch.setattr)
    draws = [(s, torch.rand([], generator=torch.Generator().manual_seed(s)).item() < 0.1) for s in range(100)]
    kept, skipped = next(s for s, skip in draws if not skip), next(s for s, skip in draws if skip)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, 64, generator=g), torch.randn(32, 16, 64, generator=g)
        torch.manual_seed(skipped if step == 9 else kept)
        return x, y

    forms = _trained_alike(_BiasesAdded(held_as), lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                           12, batch_of, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert forms[8] == ("anchored", False) and forms[9] == ("anchored", True), forms


class _PerLanguage(nn.Module):
    """An embedding table per language, the batch's language passed as a string, and a body."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.ModuleDict({"en": nn.Embedding(100, 64), "de": nn.Embedding(100, 64)})
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, ids: torch.Tensor, language: str) -> torch.Tensor:
        return self.body(F.gelu(self.embed[language](ids) * 2.0))


def test_a_step_that_reads_another_embedding_table_recomputes_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Templates forced; the German table at steps 9 and 13. The embedding's node saves the
    ids alone, and the string that picks the table is no number the forms compare: on the
    code before, the anchored form replayed ``gelu``'s input from the English table at those
    steps and never left its plan (both tables' gradients wrong, at default settings too)."""
    from ooc.testing.forced_forms import templates_forced

    templates_forced(monkeypatch.setattr)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, 100, (32, 64), generator=g), torch.randn(32, 64, 64, generator=g),
                "de" if step in (9, 13) else "en")

    forms = _trained_alike(_PerLanguage(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), 15, batch_of,
                           lambda m, b: F.mse_loss(m(b[0], b[2]), b[1]))
    assert forms[8] == ("anchored", False) and forms[9] == ("anchored", True), forms
