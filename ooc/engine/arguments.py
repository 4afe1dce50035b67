"""``OutOfCore``'s arguments checked, each refusal naming the argument and what to do.

Everything here is decided before the engine touches the process (a pool, a swap file,
PyTorch's allocator, the optimizer's flags): a wrong argument leaves nothing behind. What
follows from the arguments together is settled here too: the device with its index (a
parameter says "cuda:0", never "cuda"), the chunk (adaptive unless ``Options`` fixes it; a
small CPU budget starts smaller) and the threshold of a managed tensor.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
from torch.nn.parameter import is_lazy

from ooc.engine.memory import DEFAULT_CHUNK, start_chunk
from ooc.engine.options import Options, recompute_word
from ooc.engine.pin_policy import PinFn, pin_function
from ooc.errors import OOCError
from ooc.runtime.composition import check_optimizer_hooks, check_sharded_params
from ooc.runtime.devices import cuda_runtime
from vmm.units import format_size, parse_size

KINDS = ("activations", "params", "grads", "optimizer_state")


class Arguments(NamedTuple):
    """What the engine is built from: ``budget`` in bytes, ``device`` with its index, the
    kinds it ``manage``s, ``recompute``'s word, ``pin``'s function, the ``chunk`` it starts
    with, ``min_bytes`` (the least managed tensor), whether the chunk is ``adaptive``, and
    whether it manages tensors kept across steps (``per_parameter``); ``optimizer``, the one
    whose ``step()`` it hooks (``stepped_optimizer``)."""

    budget: int
    device: torch.device
    manage: frozenset[str]
    recompute: str
    pin: PinFn | None
    chunk: int
    min_bytes: int
    adaptive: bool
    per_parameter: bool
    optimizer: torch.optim.Optimizer | None


def checked(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, budget: int | str,
            device: str | torch.device, manage: tuple[str, ...] | list[str] | str, recompute: str,
            pin: Any, options: Any) -> Arguments:
    """The arguments of ``OutOfCore(...)``, checked (``OOCError`` naming the one at fault)."""
    if not isinstance(model, torch.nn.Module):
        raise OOCError(f"model must be a torch.nn.Module, got {type(model).__name__}: the engine "
                       f"records and moves what its parameters, buffers and forward hold")
    optimizer = stepped_optimizer(optimizer)
    if not isinstance(options, Options):
        raise OOCError(f"options must be an ooc.Options, got {type(options).__name__}")
    budget = parse_size(budget, what="budget")
    # Neither chunk nor min_bytes given: the chunk adapts to what the first recording saves (chunk_choice.py).
    adaptive = options.chunk is None and options.min_bytes is None
    chunk = DEFAULT_CHUNK if options.chunk is None else options.chunk
    manage = (manage,) if isinstance(manage, str) else tuple(manage)
    unknown = [m for m in manage if m not in KINDS]
    if unknown:
        raise OOCError(f"manage: unknown kind(s) {unknown}; choose from {list(KINDS)}")
    kinds = frozenset(manage)
    check_sharded_params(model, kinds)   # FSDP2: activations only
    check_optimizer_hooks(optimizer, kinds)   # timm's Lookahead: activations only
    recompute, pin_fn, device = recompute_word(recompute), pin_function(pin), torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise OOCError(f"device {device}: the runtime runs on 'cpu' or 'cuda'")
    # torch.cuda through one seam (ooc.runtime.devices.CudaRuntime): ooc.testing.fake_cuda() swaps it
    # to run this CUDA path over a fake driver, with the model on the CPU.
    cuda = cuda_runtime() if device.type == "cuda" else None
    if cuda is not None and not cuda.is_available():
        raise OOCError(f"device {device}: this PyTorch has no usable CUDA (torch "
                       f"{torch.__version__}); install a CUDA build and 'ooc[cuda]', or use device='cpu'")
    if cuda is not None and device.index is None:
        # Parameters say "cuda:0", never "cuda": compare (and allocate) with the index.
        device = torch.device("cuda", cuda.current_device())
    if adaptive and device.type == "cpu":
        chunk = start_chunk(budget)   # a budget under 2 MiB starts smaller
    if budget < chunk:
        raise OOCError(f"budget {format_size(budget)} is smaller than one chunk "
                       f"({format_size(chunk)}); raise the budget or lower chunk")
    min_bytes = chunk // 2 if options.min_bytes is None else options.min_bytes
    home = cuda.tensor_device(device) if cuda is not None else device
    lazy = [name for name, p in itertools.chain(model.named_parameters(), model.named_buffers()) if is_lazy(p)]
    if lazy:   # no storage yet: what would the engine record, move or roll back?
        raise OOCError(f"{len(lazy)} parameter(s) and buffer(s) of lazy modules are not made yet "
                       f"({', '.join(lazy[:4])}{', ...' if len(lazy) > 4 else ''}): run one forward "
                       f"first (model.eval(), a batch under torch.no_grad(), model.train(): BatchNorm's "
                       f"statistics stay as they were), then make the engine")
    for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
        if p.device != home:
            raise OOCError(f"{name} is on {p.device}, but the engine manages {home}: "
                           f"move the model with model.to('{home}') first")
    per_parameter = optimizer is not None and bool(kinds & {"params", "grads", "optimizer_state"})
    if per_parameter and any(group.get("fused") for group in optimizer.param_groups):
        raise OOCError("a fused optimizer updates every parameter in one op; "
                       "create it with fused=False to manage params/grads/state")
    return Arguments(budget, device, kinds, recompute, pin_fn, chunk, min_bytes, adaptive, per_parameter, optimizer)


def stepped_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` the engine hooks: ``optimizer``, or, where its ``__init__``
    skipped ``Optimizer.__init__`` (no step hooks to register), the optimizer it wraps and steps
    (the one ``Optimizer`` among its attributes).

    Why: Accelerate's ``AcceleratedOptimizer`` (what ``accelerator.prepare`` returns, and the
    Trainer's optimizer) is an ``Optimizer`` that wraps the user's (as ``.optimizer``) and calls
    its ``step()``; given to the engine, registering the step hooks raised ``AttributeError:
    'AcceleratedOptimizer' object has no attribute '_optimizer_step_pre_hooks'``. Opacus's
    ``DPOptimizer`` wraps it as ``.original_optimizer`` and clips and noises the per-sample
    gradients before it steps it. The inner optimizer's ``step()`` is the update, where the
    hooks must be; one that wraps none, or more than one, is refused, saying so. The same for a
    wrapper that is no ``Optimizer`` (schedulefree's ``ScheduleFreeWrapper``, whose ``step()``
    moves the weights to where the gradient is taken and back around its ``.base``'s)."""
    inner = optimizer
    while inner is not None and not hasattr(inner, "_optimizer_step_pre_hooks"):
        wrapped = _wrapped(inner)
        if len(wrapped) != 1 and inner is optimizer and not isinstance(optimizer, torch.optim.Optimizer):
            raise OOCError(f"optimizer must be a torch.optim.Optimizer, an object that wraps one, or None, got "
                           f"{type(optimizer).__name__}: the engine hooks its step(), the update. With several "
                           f"optimizers (a GAN's two) give none and manage activations only (the default)")
        if len(wrapped) != 1:
            raise OOCError(f"{type(optimizer).__name__} has no step hooks (its __init__ does not run "
                           "torch.optim.Optimizer.__init__) and wraps " + (
                               "no optimizer" if not wrapped else f"{len(wrapped)} optimizers, not one")
                           + ": the engine hooks optimizer.step(), the update; give it the optimizer whose "
                           "step() updates")
        inner = wrapped[0]
    return inner


def _wrapped(wrapper: object) -> list[torch.optim.Optimizer]:
    """The optimizers among ``wrapper``'s attributes, each once."""
    found = {id(v): v for v in getattr(wrapper, "__dict__", {}).values()
             if isinstance(v, torch.optim.Optimizer) and v is not wrapper}
    return list(found.values())
