"""Reversible layers: HF's Reformer, whose backward reruns each layer's forward and runs a
backward inside its own.

Its ``_ReversibleFunction`` saves only the last layer's two halves; its backward unpacks them
(``ctx.saved_tensors``) and, layer by layer, reruns the layer's feed-forward and attention
under ``enable_grad`` and calls ``backward(..., retain_graph=True)`` on them, holding what it
unpacked across those inner backwards. Two bugs of the engine showed, both at a planned step,
neither in core:

- the inner backward's first unpack closed the outer node (``SavedTensors.close_node``): the
  halves it still held went back to the plan while their bytes stayed in the pool, and a
  swap-in the plan had proven did not fit (``OutOfBudget`` at 1/3 of the peak, the second
  step). A node's tensors that something still holds now stay counted until it lets go;
- the graphs it reran, kept by ``retain_graph=True``, were never freed once an anchored plan
  kept a saved output where it was: the pack hook gave autograd the output itself, a cycle
  through its own node (``saved_tensors.unlinked``), and each anchored step left a 32 KiB
  range of the pool behind until a swap-in found it full (``BudgetExceeded`` at 1/2, the
  eighth step).

Reformer draws its dropout seeds with ``torch.seed()`` (nondeterministic, in core too); here
they are drawn from the global generator, which each micro-batch seeds, so that two runs can
be compared bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ooc import FORMS
from test_outside_models import (SEQ, Case, _assert_bitwise, _hf, _HF_SMALL, _library, _lm_loss, _tokens,
                                 _train)

UPDATES = 10


def _reformer() -> torch.nn.Module:
    return _hf("ReformerConfig", "ReformerModelWithLMHead", attn_layers=["local", "lsh", "local", "lsh"],
               hidden_size=64, feed_forward_size=128, num_attention_heads=2, attention_head_size=32,
               axial_pos_embds=True, axial_pos_shape=[4, 8], axial_pos_embds_dim=[32, 32],
               local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, max_position_embeddings=SEQ,
               is_decoder=True, hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1,
               local_attention_probs_dropout_prob=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
               **_HF_SMALL)()


def _seed() -> int:
    """``torch.seed()`` drawn from the global generator: a seed per call, the same in every run."""
    s = int(torch.randint(0, 2 ** 62, ()).item())
    torch.manual_seed(s)
    return s


@pytest.mark.parametrize("fraction,form", [(3, "planned"), (2, "anchored")])
def test_reformers_reversible_layers_train_bitwise_within_the_budget(monkeypatch: pytest.MonkeyPatch,
                                                                      fraction: int, form: str) -> None:
    """1/3 of the peak, per-op steps (the anchored form rejected, whatever the times); 1/2,
    anchored steps (kept, whatever the times). Bitwise with the reference, every step within
    the budget, the form reached."""
    from ooc.engine import hook_forms
    from ooc.testing.forced_forms import decided

    _, why = _library("transformers")
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(torch, "seed", _seed)
    monkeypatch.setattr(hook_forms.HookPlan, "judge", decided(keep=form == "anchored"))
    case = Case("transformers", _reformer, _tokens, _lm_loss, clip=True)
    model = _reformer_from_seed()
    ref = _train(case, copy.deepcopy(model), None, updates=UPDATES)
    peak = _train(case, copy.deepcopy(model), {"budget": "4GiB"}, updates=2)["stats"]["plan.in_core_peak_bytes"]
    budget = peak // fraction
    got = _train(case, copy.deepcopy(model), {"budget": budget}, updates=UPDATES)
    _assert_bitwise(ref, got, "reformer")
    stats = got["stats"]
    forms = [FORMS[f] for f, _ in got["steps"]]
    assert form in forms[2:], forms
    assert stats["bytes_out"] > 0 and stats["plan.peak_resident_bytes"] <= budget, stats


@pytest.mark.parametrize("arena", ["pool", "pytorch"])
def test_reformer_under_the_least_step_budget_over_the_fake_driver(monkeypatch: pytest.MonkeyPatch, arena: str) -> None:
    """FAKE driver (``ooc.testing.fake_cuda``): the CUDA path under the least budget for the
    whole step the engine names, swap-ins in ooc's pool or PyTorch's allocator: bitwise, the
    driver's contract kept, nothing left outstanding, a planned step among the four updates."""
    import ooc.testing
    from test_outside_models import CHUNK, _at_the_least_step_budget, ARCHITECTURES

    _, why = _library("transformers")
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(torch, "seed", _seed)
    case = Case("transformers", _reformer, _tokens, _lm_loss, clip=True)
    monkeypatch.setitem(ARCHITECTURES, "reformer", case)   # _at_the_least_step_budget builds it by name
    ref = _train(case, _reformer_from_seed(), None)
    with ooc.testing.fake_cuda(granularity=CHUNK) as driver:
        got, budget, named = _at_the_least_step_budget(case, "reformer", {"device": "cuda", "options": {"arena": arena}})
        assert driver.violations == []
        assert set(driver.outstanding().values()) == {0}, driver.outstanding()
    _assert_bitwise(ref, got, "reformer")
    assert named and got["stats"]["step_budget"] == budget and got["stats"]["tier.bytes_written"] > 0
    assert any(got["planned"]), "no step ran its plan"


def _reformer_from_seed() -> torch.nn.Module:
    torch.manual_seed(0)
    return _reformer()
