"""A small model zoo for tracing, planning and demos; every model builds on ``meta``.

Each builder returns a plain ``nn.Module`` (no torchvision needed)::

    import torch, ooc
    with torch.device("meta"):              # no memory: shapes only
        model = ooc.models.resnet50()
    x, y = ooc.models.example_batch("resnet50", 1440, "meta")
    loss = ooc.models.loss_fn("resnet50")(model(x), y)

``get(name, **kw)`` builds by name (``NAMES`` lists them); ``example_batch(name, batch,
device, **kw)`` returns ``(inputs, targets)`` shaped for that model (pass the same size
keywords as to ``get``, e.g. ``seq_len`` or ``small_input``); ``loss_fn(name)`` is the
matching loss: cross-entropy over classes, over pixels (unet) or over the vocabulary at
every position (the transformers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ooc.errors import OOCError
from ooc.models.densenet import densenet121
from ooc.models.gpt import gpt2, tiny_transformer
from ooc.models.resnet import resnet18, resnet50
from ooc.models.routed import routed_experts
from ooc.models.small import small_cnn
from ooc.models.unet import unet
from ooc.models.vgg import vgg16

__all__ = ["NAMES", "UnknownModel", "get", "example_batch", "loss_fn", "builder",
           "resnet18", "resnet50", "vgg16", "densenet121", "unet", "gpt2", "small_cnn", "tiny_transformer",
           "routed_experts"]


class UnknownModel(OOCError, LookupError):
    """A model name the zoo does not have; the message lists the names it has."""


def classification_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(batch, classes)`` logits, or of ``(batch, classes, H, W)`` score
    maps against ``(batch, H, W)`` labels (per-pixel, averaged)."""
    return F.cross_entropy(output, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: ``(batch, seq, vocab)`` logits against ``(batch, seq)`` ids."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass(frozen=True, slots=True)
class _Spec:
    build: Callable[..., nn.Module]
    inputs: str           # "image" (batch, 3, S, S) | "tokens" (batch, seq_len)
    targets: str          # "class" | "pixel" | "tokens"
    image_size: int = 0   # default side for image models
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = classification_loss


_ZOO: dict[str, _Spec] = {
    "resnet18": _Spec(resnet18, "image", "class", 224),
    "resnet50": _Spec(resnet50, "image", "class", 224),
    "vgg16": _Spec(vgg16, "image", "class", 224),
    "densenet121": _Spec(densenet121, "image", "class", 224),
    "unet": _Spec(unet, "image", "pixel", 256),
    "gpt2": _Spec(gpt2, "tokens", "tokens", loss=lm_loss),
    "small_cnn": _Spec(small_cnn, "image", "class", 64),
    "tiny_transformer": _Spec(tiny_transformer, "tokens", "tokens", loss=lm_loss),
}

NAMES: tuple[str, ...] = tuple(_ZOO)


def _spec(name: str) -> _Spec:
    try:
        return _ZOO[name]
    except (KeyError, TypeError):
        raise UnknownModel(f"unknown model {name!r}; the zoo has: {', '.join(NAMES)}") from None


def builder(name: str) -> Callable[..., nn.Module]:
    """The builder function of ``name`` (for its signature and defaults)."""
    return _spec(name).build


def get(name: str, **kw: Any) -> nn.Module:
    """Build zoo model ``name`` with keyword arguments of its builder, e.g.
    ``get("gpt2", depth=48)``. Build under ``torch.device("meta")`` for a shape-only model."""
    spec = _spec(name)
    params = inspect.signature(spec.build).parameters
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise UnknownModel(f"{name} has no option {', '.join(unknown)}; "
                           f"it takes: {', '.join(params) or 'nothing'}")
    return spec.build(**kw)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss ``loss(output, targets)`` that trains zoo model ``name``."""
    return _spec(name).loss


def example_batch(name: str, batch: int, device: str | torch.device = "cpu", *,
                  image_size: int | None = None, seed: int = 0,
                  **model_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of the right shapes and dtypes for ``get(name, **model_kw)``.

    Images are ``(batch, in_channels, S, S)`` float32 with ``S`` = ``image_size`` or the
    model's usual side (224; 32 for ``vgg16(small_input=True)``; 256 for unet; 64 for
    small_cnn); class targets are ``(batch,)`` int64, unet targets ``(batch, S, S)``; token
    models take ``(batch, seq_len)`` int64 ids and the same shape of next-token targets.
    On ``meta`` the tensors have shapes only; elsewhere the values are random, drawn from a
    private generator seeded with ``seed`` (the global RNG is not touched).
    """
    spec = _spec(name)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    defaults = {k: p.default for k, p in inspect.signature(spec.build).parameters.items()}
    unknown = sorted(set(model_kw) - set(defaults))
    if unknown:
        raise UnknownModel(f"{name} has no option {', '.join(unknown)}; "
                           f"it takes: {', '.join(defaults) or 'nothing'}")
    kw = {**defaults, **model_kw}
    device = torch.device(device)
    if spec.inputs == "tokens":
        x_shape: tuple[int, ...] = (batch, kw["seq_len"])
        y_shape, high_x, high_y = x_shape, kw["vocab"], kw["vocab"]
        x_dtype = torch.int64
    else:
        side = image_size or (32 if kw.get("small_input") else spec.image_size)
        x_shape = (batch, kw.get("in_channels", 3), side, side)
        x_dtype, high_x = torch.float32, 0
        high_y = kw.get("num_classes", 1000)
        y_shape = (batch, side, side) if spec.targets == "pixel" else (batch,)
    if device.type == "meta":
        return (torch.empty(x_shape, dtype=x_dtype, device=device),
                torch.empty(y_shape, dtype=torch.int64, device=device))
    gen = torch.Generator().manual_seed(seed)
    if x_dtype is torch.int64:
        x = torch.randint(0, high_x, x_shape, generator=gen)
    else:
        x = torch.randn(x_shape, generator=gen)
    y = torch.randint(0, high_y, y_shape, generator=gen)
    return x.to(device), y.to(device)
