"""What else may run inside ``engine.step()``: other saved-tensor hooks, checkpointing, engines.

ooc manages saved activations through ``torch.autograd.graph.saved_tensors_hooks``, and
PyTorch calls only the innermost pair of such hooks. So anything else that installs them
takes the saved activations away from ooc, silently: measured before these checks,

- ``torch.autograd.graph.save_on_cpu()`` entered inside the step: every activation saved
  under it bypassed ooc (0 managed, 0 bytes moved, the budget not applied); results stayed
  right. Entered around the step: ooc's hooks replaced it for the step, as silently.
- a second engine's step entered inside the first one's: the inner engine took the saved
  activations of every model run inside it, the outer engine's included, and let go of them
  at its own step's end; the outer backward then read a swap key that was gone
  (``KeyError`` from the tier). Both engines recorded each other's ops.
- ``torch.utils.checkpoint`` (either flavour) composes, bitwise: non-reentrant checkpoint
  pushes its own hooks only around the checkpointed region (ooc still manages the region's
  inputs and everything outside it) and recomputes inside the backward, where the dispatch
  mode sees and records the recomputation; the reentrant one saves its inputs through ooc's
  hooks and recomputes under them, so ooc manages the recomputed activations too (that
  needs the budget to hold a region's recomputation: the plan says how much).

The first two are refused with an ``OOCError`` that names what was found; checkpointing's
hooks are told apart by the module that defines them, ``torch.utils.checkpoint``.

``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``hessian`` refuse saved-tensor hooks
themselves: called inside the step (per-sample gradients for DP-SGD, a meta-learning inner
loop) they raised PyTorch's "don't yet support saved tensor hooks. Please open an issue",
which names neither ooc nor a way out. The step rolls back as for any exception, and
``refused_hooks`` gives the error that says why and what to do instead.

``torch.compile`` does not compose yet, and is refused too: dynamo skips every frame while a
``TorchDispatchMode`` is active, so a compiled model called inside the step ran eagerly,
silently (its parameters came out bitwise equal to eager in-core training, not to compiled
training: the compiled code never ran). Outside the mode, autograd's saved-tensor hooks do
see what a compiled graph saves, so a hook-driven step could manage it one day; the
recording step, which needs the mode, could not record it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ooc.errors import OOCError
from ooc.runtime.user_hooks import UserHook

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


# PyTorch's innermost (pack, unpack) saved-tensor hooks of this thread, or None. A private
# call: where it does not exist, nothing is detected. Looked up once: the step's per-op path
# calls it directly (``Stepper.on_op``).
top_saved_tensors_hooks: Callable[[bool], tuple[Callable, Callable] | None] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _top_hooks() -> tuple[Callable, Callable] | None:
    """The innermost (pack, unpack) saved-tensor hooks in force on this thread, or None."""
    return None if top_saved_tensors_hooks is None else top_saved_tensors_hooks(False)


def _describe(hook: Callable) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{getattr(hook, '__module__', None) or '?'}.{name}"


def _is_checkpoint(hook: Callable) -> bool:
    """Whether ``hook`` belongs to ``torch.utils.checkpoint`` (its region and recomputation
    hooks), which composes with ooc's."""
    return getattr(hook, "__module__", None) == _CHECKPOINT_MODULE


_NESTED = ("engine.step() was entered inside the step of another OutOfCore engine: steps of two "
           "engines do not nest (the inner engine would take the saved activations of every model "
           "run inside it, the other engine's too, and both would record each other's ops). Finish "
           "one engine's step before starting the other's, or manage both models with one engine "
           "(e.g. over an nn.ModuleDict holding them)")


def check_step_entry(engine_mode: type, manages_activations: bool) -> None:
    """Refuse to start a step inside another engine's step, or (activations managed) under
    saved-tensor hooks that the step's own hooks would silently replace."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, engine_mode):
            raise OOCError(_NESTED)
    top = _top_hooks()
    if top is not None and _is_hook_step(top[0]):
        raise OOCError(_NESTED)   # a hook-driven step of the other engine: no dispatch mode to find
    if not manages_activations:
        return
    if top is not None:
        raise OOCError(
            f"saved-tensor hooks ({_describe(top[0])}) are active around engine.step(): the "
            "step's own hooks would replace them while it runs, since PyTorch calls only the "
            "innermost pair. ooc already keeps saved activations within its budget, moving them "
            "to its slower tier: leave those hooks (torch.autograd.graph.save_on_cpu or your "
            "own) out of the step, or create the engine with manage= without 'activations' "
            "to keep them in charge of activations")


def _is_hook_step(hook: Callable) -> bool:
    """Whether ``hook`` is the pack hook of an engine's hook-driven step (plain or anchored,
    ``anchored_step.py``), which runs without the dispatch mode the check above looks for."""
    from ooc.runtime.hook_step import HookStep

    return isinstance(getattr(hook, "__self__", None), HookStep)


def check_hooks_inside(own_pack: Any) -> None:
    """Refuse saved-tensor hooks entered inside the step (other than checkpointing's): the
    activations saved under them would bypass ooc. Cheap (one C call); called per op."""
    top = _top_hooks()
    if top is None or top[0] is own_pack or _is_checkpoint(top[0]):
        return
    if top[0] == own_pack:   # the same bound method, another object
        return
    raise OOCError(
        f"saved-tensor hooks ({_describe(top[0])}) were entered inside engine.step(): the "
        "activations saved under them bypass ooc, which then neither moves them nor counts "
        "them in its budget. Remove them from the step (ooc already moves saved activations to "
        "its slower tier within the budget; torch.utils.checkpoint composes with it), or create "
        "the engine with manage= without 'activations' to leave activations to those hooks")


_COMPILED = ("{what} inside engine.step(): the engine sees every op of the step through a "
             "TorchDispatchMode, under which torch.compile does not compile (dynamo runs the model "
             "eagerly, so the parameters would match eager training, not compiled training). "
             "Train the uncompiled model under the engine (OutOfCore(model, ...) and call model, "
             "not torch.compile(model)), or compile without the engine")


# torch._functorch.vmap.doesnt_support_saved_tensors_hooks's words, which grad, vjp, jacrev and
# hessian raise on entry while any saved-tensor hooks are active
_FUNC_REFUSAL = "don't yet support saved tensor hooks"


def refused_hooks(exc: BaseException) -> OOCError | None:
    """The error to raise instead of ``exc`` where a ``torch.func`` transform refused the
    step's saved-tensor hooks; None for any other exception."""
    if isinstance(exc, OOCError) or not isinstance(exc, RuntimeError) or _FUNC_REFUSAL not in str(exc):
        return None
    return OOCError(
        "torch.func's grad, vjp, jacrev and hessian refuse autograd's saved-tensor hooks, through which "
        "ooc manages the step's activations (PyTorch's own save_on_cpu meets the same refusal). "
        "Call the transform outside `with engine.step()` (what it saves is then PyTorch's alone, outside "
        "the budget), or compute those gradients with torch.autograd inside the step. The step was rolled "
        f"back. PyTorch said: {exc}")


def refuse_compiled(model: torch.nn.Module, in_step: Callable[[], bool]) -> list[Any]:
    """Refuse ``torch.compile`` around ``model`` or in it: a compiled submodule now, a call of
    the model through a compiled wrapper when it happens inside a step (``in_step()``, a
    forward pre-hook that looks for dynamo's frame on the stack). Returns the hook handles."""
    from torch._dynamo.eval_frame import OptimizedModule

    inner = getattr(model, "_orig_mod", model)
    for name, m in inner.named_modules():
        if isinstance(m, OptimizedModule):
            raise OOCError(_COMPILED.format(what=f"submodule {name or '(the model)'} is compiled "
                                                 "(torch.compile), and would run eagerly"))

    def check(module: torch.nn.Module, args: Any) -> None:
        if in_step() and _through_dynamo():
            raise OOCError(_COMPILED.format(what=f"{type(module).__name__} was called through "
                                                 "torch.compile"))

    return [inner.register_forward_pre_hook(UserHook(check))]


def _through_dynamo(depth: int = 12) -> bool:
    """Whether one of the ``depth`` innermost callers is dynamo's entry (eval_frame.py) for
    compiling: not its ``DisableContext``, which runs a function with dynamo off (once
    ``torch.compile`` has run, LBFGS's ``step()``, and the model its closure calls inside the
    step, ran under one, and was refused as compiled)."""
    import sys

    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if (frame.f_code.co_filename.endswith(("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py"))
                and type(frame.f_locals.get("self")).__name__ != "DisableContext"):
            return True
        frame = frame.f_back
    return False


def has_sharded_params(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (FSDP2's ``fully_shard``, tensor
    parallelism): then the unsharded parameters the ops read are freed after each forward use
    and gathered again for the backward, out of ooc's sight."""
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor")


def check_sharded_params(model: torch.nn.Module, manage: frozenset[str]) -> None:
    """Refuse managed params/grads/optimizer state of a model whose parameters are DTensors
    (FSDP2's ``fully_shard``, tensor parallelism). A DTensor is a wrapper with no storage of
    its own: the engine releases and restores storages in place, and it sees only the ops on
    the wrapper (its dispatch mode runs before DTensor's, which then runs the ops on each
    rank's local shard out of its sight), so it could neither move the shard nor know when an
    op needs it. FSDP2 already frees the unsharded parameters after each use; ooc composes
    with it by managing activations."""
    kinds = sorted(manage & {"params", "grads", "optimizer_state"})
    if not kinds:
        return
    for name, p in model.named_parameters():
        if _is_dtensor(p):
            raise OOCError(
                f"manage={tuple(sorted(manage))}: parameter {name} is a DTensor (FSDP2's fully_shard "
                f"or tensor parallelism), whose shard ooc cannot release or see the ops of; "
                f"manage {', '.join(repr(k) for k in kinds)} only of a model without sharded "
                f"parameters, and manage=('activations',) here (FSDP2 already frees the unsharded "
                f"parameters after each use)")


def state_dict_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict()``/``load_state_dict()`` hooks cover every way to save
    or load ``model``: for a ``DistributedDataParallel`` wrapper, the module it wraps
    (``ddp.module``, which holds every parameter and buffer). A module's
    state-dict hooks also run when a parent's ``state_dict()`` recurses into it, but not the
    other way round: hooked on the wrapper, ``ddp.module.state_dict()`` (the usual way to
    save a DDP checkpoint without the ``module.`` prefix) read released, 0-byte storages."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


_STATE_DICT_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def check_optimizer_hooks(optimizer: torch.optim.Optimizer | None, manage: frozenset[str]) -> None:
    """Refuse managed params/grads/optimizer state with an optimizer that cannot take the
    state-dict hooks the engine brings them back with before a checkpoint is saved and
    manages loaded state with: one whose ``__init__`` does not run ``Optimizer.__init__``
    (timm's ``Lookahead``) lacks them, and registering them raised an ``AttributeError``
    that named neither ooc nor a way out."""
    kinds = sorted(manage & {"params", "grads", "optimizer_state"})
    missing = [a for a in _STATE_DICT_HOOKS if optimizer is not None and not hasattr(optimizer, a)]
    if kinds and missing:
        raise OOCError(
            f"manage={tuple(sorted(manage))}: {type(optimizer).__name__} has no state_dict hooks "
            f"({', '.join(missing)}: its __init__ does not run torch.optim.Optimizer.__init__), and ooc "
            f"brings {', '.join(repr(k) for k in kinds)} back through them before a checkpoint is saved; "
            f"manage=('activations',) with this optimizer (the default)")
