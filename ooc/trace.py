"""Record one training step as a ``scheduler.VariableSequence``.

``trace`` runs one full step (forward, loss, backward, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``) of a private copy of the model under a
``TorchDispatchMode`` that sees every aten op, and writes down, per op, which storages it
reads and writes. On ``meta`` no memory is used; on a real device each op is also timed.

The recorder is the one the engine's recording step uses (``ooc/record/``): storages are
variables keyed the same way (``ooc.record.storages``), and the uses per op follow the same
rules (``ooc.record.recorder``), so ``ooc plan`` plans the step the engine runs.

Kinds
-----
``PARAM`` (``live_in``, ``live_out``): storages of ``model.parameters()`` and of buffers
(BatchNorm running statistics live and change exactly like parameters).
``OPTIMIZER_STATE`` (``live_in``, ``live_out``): tensors in ``optimizer.state`` after an
untraced warm-up step (Adam's ``exp_avg`` exists only after a first step; the recorded step
is the steady state).
``INPUT`` (``live_in``): the example inputs and targets, and external storages.
``GRAD``: storages that are ``p.grad`` after the backward; created by a write in the
backward, dead after the optimizer reads them (``zero_grad(set_to_none=True)``).
``ACTIVATION``: storages autograd saves for the backward (seen by a
``saved_tensors_hooks`` pack hook) that are none of the above.
``TEMPORARY``: everything else.

Costs
-----
``Cost.flops`` from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
attention; 0 for ops without a formula, which are memory-bound anyway). ``Cost.bytes``:
bytes of the tensor arguments plus bytes of the results (views: 0), an estimate of the
traffic for a roofline. ``Cost.seconds``, when ``measure=True`` on a
real device: on a GPU, the device time between two CUDA events around the op's kernels (no
launch or host time: the simulator adds its own per-op overhead); on the CPU, the op's wall
time; else ``None``.

Replay flags
------------
``Function.replayable``, ``rng`` and ``updates_stats`` (may a plan recompute this function,
with the generator state restored, without updating BatchNorm's running statistics again)
are the recorder's, from each op's schema and tags: ``ooc.record.replay`` has the rules. The
engine's recording step sets the same flags.

Names: parameters and buffers by ``named_parameters()``/``named_buffers()`` paths, grads
``"<param>.grad"``, state ``"<param>.<key>"`` (``"fc.weight.exp_avg"``). Functions are
``"<scope>:<aten op>"`` where scope is the module path running the op in the forward
(``"layer1.0.conv1:aten.convolution.default"``), the module whose forward created the
autograd node in the backward (``"layer1.0.conv1:aten.convolution_backward.default"``;
gradient accumulation is named after the parameter's module), ``"loss"`` or
``"optimizer"``; the model's own top level is ``"model"``. A new variable is named after the
function that wrote it: ``"<function>#<index>"``, with ``.k`` for the k-th result.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from typing import Any, Callable

import torch
from torch import nn

from ooc.record.copies import (batch_size, copy_model, default_loss, make_optimizer,
                               resolve_device, to_device)
from ooc.record.trace_mode import Recorder, TraceError
from ooc.record.traced_step import record_step
from scheduler.ir import Kind, VariableSequence

__all__ = ["trace", "summary", "Recorder", "TraceError"]

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


def trace(
    model: nn.Module,
    example_inputs: Any,
    targets: Any = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | str | Callable[..., torch.optim.Optimizer] | None = None,
    device: str | torch.device | None = None,
    measure: bool = False,
    progress: bool = False,
    name: str | None = None,
) -> VariableSequence:
    """Record one steady-state training step of ``model`` as a variable sequence.

    The step is ``loss = loss_fn(model(*inputs), targets); loss.backward();
    optimizer.step(); optimizer.zero_grad(set_to_none=True)``, run on a private copy of the
    model and optimizer: the caller's model, optimizer state, gradients and RNG state are
    left exactly as they were. An untraced warm-up step runs first, so that lazily created
    optimizer state exists and the recorded step is the one training repeats.

    Args:
        model: the module to train, on any device (or on ``meta``).
        example_inputs: a tensor (``model(x)``), a tuple/list of positional arguments, or a
            dict of keyword arguments.
        targets: passed to ``loss_fn`` as its second argument (``None``: ``loss_fn(output)``).
        loss_fn: ``loss_fn(output, targets) -> scalar``. Default: cross-entropy when
            ``targets`` is given, else ``output.float().mean()``.
        optimizer: an optimizer over ``model``'s parameters (copied with its state and
            hyperparameters, including its ``foreach`` choice), a callable
            ``params -> Optimizer``, or ``"sgd"`` (momentum 0.9, lr 0.01), ``"adam"``,
            ``"adamw"`` (lr 1e-3). Default ``"sgd"``. Named optimizers are per-parameter
            (``foreach=False``), as the ooc runtime runs them; pass an optimizer or a
            factory to trace another choice.
        device: where to run the step. ``"meta"``: shapes only, no memory, no timings (the
            model is copied to ``meta`` without materializing it). A real device: the
            model is deep-copied there (memory for one more model and its optimizer state).
            ``None``: the device of the model's parameters.
        measure: on a real device, record each op's time in ``Cost.seconds`` (CUDA events
            on a GPU, read after the step; wall time on the CPU). Ignored, with a log
            message, on ``meta``.
        progress: show a tqdm bar of recorded ops on stderr (appears after half a second).
        name: ``meta["model"]``; default the model's class name.

    Returns:
        A validated ``VariableSequence``; ``meta`` holds ``model``, ``batch``, ``device``,
        ``optimizer``, ``forward_start`` (0), ``loss_start``, ``backward_start``,
        ``optimizer_start`` (function indices where those phases begin), ``trace_seconds``
        and ``torch`` (version). Module docstring: the rules for variables, uses and kinds.

    Raises:
        TraceError: an op failed during the step (on ``meta``, typically an op that needs
            tensor values, e.g. ``.item()`` on a model tensor or ``nonzero``: trace on a real
            device), or the loss is not a scalar.

    Example::

        >>> import torch, ooc
        >>> with torch.device("meta"):
        ...     model = ooc.models.resnet50()
        >>> x, y = ooc.models.example_batch("resnet50", 1440, "meta")
        >>> seq = ooc.trace(model, x, y, optimizer="sgd")
        >>> seq.in_core_peak_bytes > 100 * 2**30   # 116 GiB (125 GB) at batch 1440
        True
    """
    t_start = time.perf_counter()
    dev = resolve_device(model, device)
    on_meta = dev.type == "meta"
    if measure and on_meta:
        log.info("measure=True ignored: ops on meta have no running time")
        measure = False
    rng_devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=dev.type if rng_devices else "cuda"):
        work, memo = copy_model(model, dev)
        opt = make_optimizer(optimizer, work, memo, on_meta)
        copies: dict[int, torch.Tensor] = {}
        inputs = to_device(example_inputs, dev, copies)
        tgt = to_device(targets, dev, copies)
        loss = loss_fn if loss_fn is not None else default_loss(targets is not None)
        rec = record_step(work, opt, inputs, tgt, loss, dev, measure, progress)
    return rec.sequence({
        "model": name or type(model).__name__,
        "batch": batch_size(example_inputs),
        "device": str(dev),
        "optimizer": type(opt).__name__,
        "trace_seconds": round(time.perf_counter() - t_start, 4),
        "measured": measure,
        "torch": torch.__version__,
    })


def summary(seq: VariableSequence) -> dict[str, Any]:
    """Plain-data facts about a traced step, with stable keys (for tables and JSON)::

        {"model", "batch", "device", "functions", "forward", "backward", "optimizer",
         "variables": {kind: {"count", "bytes"}}, "total_bytes", "in_core_peak_bytes",
         "flops", "measured_seconds" (None unless measured), "trace_seconds"}

    ``forward`` counts loss functions too; a phase boundary missing from ``meta`` counts as
    the end of the sequence.
    """
    n = len(seq.functions)
    bwd = int(seq.meta.get("backward_start", n))
    opt = int(seq.meta.get("optimizer_start", n))
    kinds: dict[str, dict[str, int]] = {k.value: {"count": 0, "bytes": 0} for k in Kind}
    for v in seq.variables.values():
        kinds[v.kind.value]["count"] += 1
        kinds[v.kind.value]["bytes"] += v.nbytes
    secs = [f.cost.seconds for f in seq.functions if f.cost.seconds is not None]
    return {
        "model": seq.meta.get("model"),
        "batch": seq.meta.get("batch"),
        "device": seq.meta.get("device"),
        "functions": n,
        "forward": bwd,
        "backward": opt - bwd,
        "optimizer": n - opt,
        "variables": kinds,
        "total_bytes": seq.total_bytes,
        "in_core_peak_bytes": seq.in_core_peak_bytes,
        "flops": sum(f.cost.flops for f in seq.functions),
        "measured_seconds": sum(secs) if secs else None,
        "trace_seconds": seq.meta.get("trace_seconds"),
    }


# ``import ooc.trace`` binds this *module* as the attribute ``ooc.trace``, shadowing the
# function that ``ooc`` exports lazily under the same name. Making the module callable keeps
# ``ooc.trace(model, ...)`` working whatever was imported first.
class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> VariableSequence:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

