"""Private copies of the model, optimizer and inputs that ``ooc.trace`` runs its step on, so
that the caller's model, optimizer state, gradients and RNG state stay exactly as they were."""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable

import torch
from torch import nn

from ooc.record.trace_mode import TraceError

LossFn = Callable[..., torch.Tensor]


def resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def copy_model(model: nn.Module, dev: torch.device) -> tuple[nn.Module, dict[int, Any]]:
    """Deep copy of ``model`` on ``dev`` and the deepcopy memo (original id -> copy).

    For ``meta`` the memo is pre-filled with meta twins of every parameter, buffer and
    tensor attribute, so the copy never materializes the real weights.
    """
    memo: dict[int, Any] = {}
    if dev.type != "meta" and any(t.device.type == "meta" for t in
                                  itertools.chain(model.parameters(), model.buffers())):
        raise TraceError(f"the model is on meta (no values) and cannot run on {dev}: trace it "
                         f"with device='meta', or materialize it first (to_empty + init)")
    if dev.type == "meta":
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                               requires_grad=p.requires_grad)
            for b in m._buffers.values():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device="meta")
            for v in vars(m).values():
                if isinstance(v, torch.Tensor) and id(v) not in memo:
                    memo[id(v)] = torch.empty_like(v, device="meta")
    with torch.no_grad():
        work = copy.deepcopy(model, memo)
    if dev.type != "meta":
        work.to(dev)
    return work, memo


_BY_NAME: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "foreach": False}),
    "adam": (torch.optim.Adam, {"lr": 1e-3, "foreach": False}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "foreach": False}),
}


def make_optimizer(optimizer: Any, work: nn.Module, memo: dict[int, Any],
                    on_meta: bool) -> torch.optim.Optimizer:
    if optimizer is None:
        optimizer = "sgd"
    if isinstance(optimizer, str):
        try:
            cls, kw = _BY_NAME[optimizer.lower()]
        except KeyError:
            raise TraceError(f"unknown optimizer {optimizer!r}; use one of "
                             f"{', '.join(_BY_NAME)}, an optimizer or a factory") from None
        return cls(work.parameters(), **kw)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return optimizer(work.parameters())
        raise TraceError(f"optimizer must be an Optimizer, a callable or a name, "
                         f"not {type(optimizer).__name__}")
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            twin = memo.get(id(p))
            if twin is None:
                raise TraceError("the optimizer updates a tensor that is not a parameter or "
                                 "buffer of the model; trace the optimizer of this model")
            params.append(twin)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    cls = type(optimizer)
    try:
        new = cls(groups, **optimizer.defaults)
    except TypeError:
        new = cls(groups)
    state = optimizer.state_dict()
    # load_state_dict keeps tensors already on the right device (and "step" anywhere) as
    # the *same* objects: copy them, or the warm-up and traced steps would update the
    # caller's optimizer. On meta only the (scalar) steps need real copies.
    if on_meta:
        copied = {i: {k: (_meta_or_clone(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                      for k, v in s.items()} for i, s in state["state"].items()}
    else:
        copied = copy.deepcopy(state["state"])
    new.load_state_dict({"state": copied, "param_groups": state["param_groups"]})
    return new


def _meta_or_clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone() if t.numel() <= 1 else torch.empty_like(t, device="meta")


def to_device(value: Any, dev: torch.device, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``value``'s tensors on ``dev`` (shapes only on meta). A tensor passed twice (the same
    ids as ``input_ids`` and ``labels``) gets one copy, as the step would see one storage;
    ``memo`` carries that across calls."""
    if memo is None:
        memo = {}
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = (torch.empty_like(value, device="meta") if dev.type == "meta"
                               else value.to(dev))
        return memo[id(value)]
    if isinstance(value, dict):
        return {k: to_device(v, dev, memo) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, dev, memo) for v in value)
    return value


def default_loss(has_targets: bool) -> LossFn:
    if has_targets:
        return torch.nn.functional.cross_entropy
    return lambda output: output.float().mean()


def batch_size(inputs: Any) -> int | None:
    for _, t in named_tensors("input", inputs):
        return int(t.shape[0]) if t.dim() else None
    return None




def named_tensors(prefix: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [(f"{prefix}.{k}", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if isinstance(value, (list, tuple)):
        return [(f"{prefix}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []
