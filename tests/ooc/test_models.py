"""ooc.models: every zoo model builds on meta and runs with its example batch."""

from __future__ import annotations

import pytest
import torch

from ooc import OOCError, models


def _meta(name: str, **kw):
    with torch.device("meta"):
        return models.get(name, **kw)


@pytest.mark.parametrize("name", models.NAMES)
def test_builds_and_runs_on_meta(name):
    model = _meta(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    x, y = models.example_batch(name, 2, "meta")
    assert x.device.type == "meta" and y.dtype == torch.int64
    out = model(x)
    loss = models.loss_fn(name)(out, y)
    assert loss.shape == () and loss.device.type == "meta"


@pytest.mark.parametrize("name,out_shape", [
    ("resnet18", (2, 1000)), ("resnet50", (2, 1000)), ("vgg16", (2, 1000)), ("densenet121", (2, 1000)),
    ("unet", (2, 2, 256, 256)), ("gpt2", (2, 1024, 50257)), ("small_cnn", (2, 10)),
    ("tiny_transformer", (2, 32, 256)),
])
def test_output_shapes(name, out_shape):
    x, _ = models.example_batch(name, 2, "meta")
    assert tuple(_meta(name)(x).shape) == out_shape


@pytest.mark.parametrize("name,count", [
    ("resnet18", 11_689_512), ("resnet50", 25_557_032), ("vgg16", 138_357_544), ("densenet121", 7_978_856),
    ("gpt2", 124_439_808),  # GPT-2 small with tied embeddings (+ 1024 positions)
])
def test_parameter_counts_match_the_reference_architectures(name, count):
    assert sum(p.numel() for p in _meta(name).parameters()) == count


def test_vgg16_small_input_is_the_cifar_variant():
    model = _meta("vgg16", small_input=True, batch_norm=True, num_classes=100)
    x, y = models.example_batch("vgg16", 64, "meta", small_input=True, num_classes=100)
    assert tuple(x.shape) == (64, 3, 32, 32)
    assert tuple(model(x).shape) == (64, 100)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 13


def test_gpt2_options_and_tied_head():
    model = _meta("gpt2", depth=2, width=128, heads=4, seq_len=64, vocab=1000)
    assert model.lm_head.weight is model.wte.weight
    x, y = models.example_batch("gpt2", 3, "meta", seq_len=64, vocab=1000)
    assert tuple(x.shape) == tuple(y.shape) == (3, 64)
    assert tuple(model(x).shape) == (3, 64, 1000)
    sdpa = _meta("gpt2", depth=1, width=64, heads=4, seq_len=16, vocab=50, attention="sdpa")
    assert tuple(sdpa(models.example_batch("gpt2", 2, "meta", seq_len=16, vocab=50)[0]).shape) == (2, 16, 50)


def test_small_models_train_on_cpu():
    torch.manual_seed(0)
    for name, kw, size in [("small_cnn", {"width": 8}, 32), ("tiny_transformer", {}, None),
                           ("unet", {"base": 4, "depth": 2}, 32)]:
        model = models.get(name, **kw)
        x, y = models.example_batch(name, 2, "cpu", image_size=size, **kw)
        loss = models.loss_fn(name)(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in model.parameters())


def test_example_batch_is_deterministic_and_in_range():
    a = models.example_batch("small_cnn", 4, "cpu", seed=3)
    b = models.example_batch("small_cnn", 4, "cpu", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    rng = torch.get_rng_state()
    x, y = models.example_batch("unet", 2, "cpu", image_size=32, num_classes=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not used
    assert tuple(x.shape) == (2, 3, 32, 32) and tuple(y.shape) == (2, 32, 32)
    assert int(y.min()) >= 0 and int(y.max()) < 3
    tokens, targets = models.example_batch("tiny_transformer", 2, "cpu", vocab=7)
    assert int(tokens.max()) < 7 and int(targets.max()) < 7


def test_unknown_names_and_options():
    with pytest.raises(models.UnknownModel, match="resnet50, vgg16") as info:
        models.get("resnet51")
    assert isinstance(info.value, OOCError)
    for call in (lambda: models.example_batch("nope", 2), lambda: models.loss_fn("nope")):
        with pytest.raises(models.UnknownModel):
            call()
    with pytest.raises(models.UnknownModel, match="seq_len"):
        models.get("resnet50", seq_len=5)
    with pytest.raises(ValueError):
        models.example_batch("resnet50", 0)
