"""The step ``ooc.trace`` records: an untraced warm-up step, then forward, loss, backward,
``optimizer.step()`` and ``zero_grad(set_to_none=True)`` under the recorder, with what
exists before the step registered and what it created classified after."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ooc.errors import OOCError
from ooc.record.copies import named_tensors
from ooc.record.roles import Roles, mark_grads, mark_persistent, register_persistent
from ooc.record.scopes import ModuleScopes
from ooc.record.trace_mode import Recorder, TraceError
from scheduler.ir import Kind

LossFn = Callable[..., torch.Tensor]


def record_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: Any,
            loss_fn: LossFn, dev: torch.device, measure: bool,
            progress: bool) -> Recorder:
    opt.zero_grad(set_to_none=True)
    with explain_failure(None, dev):
        _step(model, opt, inputs, targets, loss_fn)  # warm-up: lazy optimizer state appears

    rec = Recorder(measure=measure, device=dev, progress=progress)
    names = _register(rec, model, opt, inputs, targets)
    scopes = ModuleScopes(model, names.params)
    try:
        with explain_failure(rec, dev), rec, rec.saved_tensors_hooks():
            rec.phase("forward")
            rec.scope = scopes.forward
            output = call_model(model, inputs)
            rec.phase("loss")
            scopes.enter("loss")
            loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
            scopes.enter("backward")
            del output
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TraceError(f"loss_fn must return a scalar tensor, got "
                                 f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
            rec.phase("backward")
            rec.scope = scopes.backward
            loss.backward()
            del loss
            mark_grads(rec.steps, names)
            rec.phase("optimizer")
            rec.scope = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        scopes.remove()
        rec._stash.clear()
    mark_persistent(rec.steps, names, opt)
    return rec


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: Any,
          loss_fn: LossFn) -> None:
    output = call_model(model, inputs)
    loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
    del output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError(f"loss_fn must return a scalar tensor, got "
                         f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _register(rec: Recorder, model: nn.Module, opt: torch.optim.Optimizer, inputs: Any,
              targets: Any) -> Roles:
    """Declare what exists before the step, in a fixed order (so ids are reproducible)."""
    roles = register_persistent(rec.steps, model, opt)
    for n, t in named_tensors("input", inputs):
        rec.register(t, Kind.INPUT, n)
    for n, t in named_tensors("target", targets):
        rec.register(t, Kind.INPUT, n)
    return roles


class explain_failure:
    """Turn an exception inside the step into a TraceError naming the op."""

    def __init__(self, rec: Recorder | None, dev: torch.device) -> None:
        self.rec, self.dev = rec, dev

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, (OOCError, KeyboardInterrupt)) or not isinstance(exc, Exception):
            return False
        where = "the warm-up step" if self.rec is None else "the recorded step"
        if self.rec is not None and self.rec.failed_at is not None:
            i, op = self.rec.failed_at
            where += f" at function {i} ({op})"
        hint = ""
        if self.dev.type == "meta":
            hint = ("; on meta, ops that need tensor values (.item(), nonzero, data-dependent "
                    "shapes) cannot run: trace on a real device (device='cpu')")
        raise TraceError(f"tracing failed in {where}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}{hint}") from exc

