"""What the tensors of a training step are (parameter, buffer, optimizer state, gradient),
told to the recorder the same way by both of its drivers: ``ooc.trace``'s step and the
engine's recording step. Ids follow registration order: parameters, buffers, then each
optimized parameter's state, so a recording is reproducible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ooc.record.recorder import StepRecorder
from scheduler.ir import Kind


@dataclass
class Roles:
    """The persistent tensors of a step, by name."""

    params: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]


def register_persistent(rec: StepRecorder, model: nn.Module, opt: torch.optim.Optimizer | None,
                        nbytes: Callable[[torch.Tensor], int | None] = lambda t: None) -> Roles:
    """Declare the parameters, buffers and optimizer state that exist before the step.
    ``nbytes(t)``: the size of a tensor whose bytes are elsewhere now (None: its storage's)."""
    roles = Roles(list(model.named_parameters()), list(model.named_buffers()))
    pname = {id(p): n for n, p in roles.params}
    for n, p in roles.params:
        rec.register(p, Kind.PARAM, n, live_out=True, nbytes=nbytes(p))
    for n, b in roles.buffers:
        rec.register(b, Kind.PARAM, n, live_out=True, nbytes=nbytes(b))
    if opt is None:
        return roles
    extra = 0
    for group in opt.param_groups:
        for p in group["params"]:
            n = pname.get(id(p))
            if n is None:  # an optimized tensor that is not a model parameter
                n = f"param#{extra}"
                extra += 1
                rec.register(p, Kind.PARAM, n, live_out=True, nbytes=nbytes(p))
                roles.params.append((n, p))
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    rec.register(value, Kind.OPTIMIZER_STATE, f"{n}.{key}", live_out=True,
                                 nbytes=nbytes(value))
    return roles


def mark_grads(rec: StepRecorder, roles: Roles) -> None:
    """After the backward: the storages in ``p.grad`` are gradients."""
    for name, p in roles.params:
        if p.grad is not None:
            rec.mark(p.grad, Kind.GRAD, f"{name}.grad")


def mark_persistent(rec: StepRecorder, roles: Roles, opt: torch.optim.Optimizer | None) -> None:
    """After the step: anything persistent it replaced rather than updated in place stays
    alive (a new state tensor, a parameter assigned anew)."""
    for name, p in roles.params:
        rec.mark(p, Kind.PARAM, name, live_out=True)
    for name, b in roles.buffers:
        rec.mark(b, Kind.PARAM, name, live_out=True)
    if opt is None:
        return
    for name, p in roles.params:
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                rec.mark(value, Kind.OPTIMIZER_STATE, f"{name}.{key}", live_out=True)


def state_so_far(rec: StepRecorder, roles: Roles, opt: torch.optim.Optimizer | None) -> dict[int, Kind]:
    """The variables of the optimizer's state a step made so far and nothing classified yet,
    as state (``StepRecorder.sequence``'s ``kinds``), not yet outliving the step: a sequence of
    the step so far (``ooc.engine.step_budget.check_so_far``) that called them temporaries
    counted the state ooc manages as held beside it; marked as they are at the step's end,
    outliving it, they counted from the step's start where the managed recording, not yet
    marked, did not."""
    kinds: dict[int, Kind] = {}
    for _, p in roles.params if opt is not None else ():
        for value in opt.state.get(p, {}).values():
            vid = rec.var(value) if isinstance(value, torch.Tensor) else None
            if vid is not None and rec.kind[vid] is None:
                kinds[vid] = Kind.OPTIMIZER_STATE
    return kinds
