"""Record one training step as a ``scheduler.VariableSequence``.

``trace`` runs one full step (forward, loss, backward, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``) of a private copy of the model under a
``TorchDispatchMode`` that sees every aten op, and writes down, per op, which storages it
reads and writes. On ``meta`` no memory is used; on a real device each op is also timed.

How storages become variables
-----------------------------
A variable is a *storage*: every view of a storage is the same variable. The key is the
address of the C++ ``StorageImpl`` (``t.untyped_storage()._cdata``, also valid on ``meta``
where every ``data_ptr`` is 0). An address can be reused once a storage is freed, so the
recorder keeps a *weak* reference to every storage it has seen: a weak reference does not
keep the bytes alive (``StorageImpl::release_resources`` frees them) but it keeps the
``StorageImpl`` object itself allocated, so no later storage can get the same address while
the trace runs. Lifetimes then need no bookkeeping: the sequence's uses define them.

Uses per op (the rules, applied the same on every device)
---------------------------------------------------------
- every tensor argument is a read of its storage (once per op, even if passed twice);
- every result with a storage not seen before is a new variable, created by a write;
- an argument the schema marks as mutated (``Tensor(a!)``: in-place and ``out=`` ops) is a
  read *and* a write of its storage; results aliasing it add nothing more;
- a view op (every result aliases an argument, nothing mutated: ``view``, ``t``,
  ``transpose``, ``detach``, ...) allocates nothing and touches no data: it is kept in the
  sequence as a function with *no* uses, so function indices match the op stream;
- a storage first met as an argument (created outside the recorded step and not one of
  the registered parameters, buffers, state tensors or inputs) is an external input:
  kind ``INPUT``, ``live_in``;
- ``profiler.*`` ops (the optimizers' ``record_function`` markers) are not recorded.

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
traffic for a roofline. ``Cost.seconds``: wall time of the op when ``measure=True`` on a
real device, else ``None``.

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

import bisect
import copy
import itertools
import logging
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ooc.errors import OOCError
from scheduler.ir import Access, Cost, Function, Kind, Use, Variable, VariableSequence

__all__ = ["trace", "summary", "Recorder", "TraceError"]

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


class TraceError(OOCError):
    """The training step could not be recorded (the message names the op that failed)."""


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
        measure: on a real device, record each op's wall time in ``Cost.seconds``
            (synchronizing CUDA around each op). Ignored, with a log message, on ``meta``.
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
    dev = _resolve_device(model, device)
    on_meta = dev.type == "meta"
    if measure and on_meta:
        log.info("measure=True ignored: ops on meta have no running time")
        measure = False
    rng_devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=dev.type if rng_devices else "cuda"):
        work, memo = _copy_model(model, dev)
        opt = _make_optimizer(optimizer, work, memo, on_meta)
        inputs = _to_device(example_inputs, dev)
        tgt = _to_device(targets, dev)
        loss = loss_fn if loss_fn is not None else _default_loss(targets is not None)
        rec = _record(work, opt, inputs, tgt, loss, dev, measure, progress)
    return rec.sequence({
        "model": name or type(model).__name__,
        "batch": _batch_size(example_inputs),
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


# -- the recorder ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OpInfo:
    name: str
    skip: bool                        # not recorded at all (profiler markers)
    view: bool                        # results alias arguments, nothing written
    mutated: tuple[int | str, ...]    # positions (or keyword names) of Tensor(a!) arguments
    flop: Callable[..., Any] | None   # torch.utils.flop_counter formula, if any


def _op_info(func: Any) -> _OpInfo:
    name = str(func)
    if getattr(func, "namespace", "") == "profiler":
        return _OpInfo(name, True, False, (), None)
    schema = func._schema
    mutated: list[int | str] = []
    positional = True
    for i, arg in enumerate(schema.arguments):
        if arg.kwarg_only:
            positional = False
        if arg.alias_info is not None and arg.alias_info.is_write:
            mutated.append(i if positional else arg.name)
    returns = schema.returns
    view = (not mutated and bool(returns)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))
    flop = _FLOPS.get(func._overloadpacket) if _FLOPS else None
    return _OpInfo(name, False, view, tuple(mutated), flop)


def _flop_registry() -> dict[Any, Callable[..., Any]]:
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # pragma: no cover - very old torch
        return {}
    return dict(flop_registry)


_FLOPS = _flop_registry()


def _collect(values: Iterable[Any], out: list[torch.Tensor]) -> None:
    """Append the tensors among ``values`` (and inside list/tuple values) to ``out``."""
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    out.append(b)


class Recorder(TorchDispatchMode):
    """The op-level recorder behind :func:`trace`, usable around any code.

    Register the storages that exist before the step (``register``), enter the recorder
    (``with rec:``) around the step, tell it which storages ended up as gradients
    (``mark``), and call ``sequence()``. ``saved_tensors_hooks()`` returns the pack/unpack
    pair that classifies saved storages as activations; ``phase(name)`` records where the
    forward, loss, backward and optimizer begin. ``scope`` (a string, or a zero-argument
    callable returning one) prefixes function names.
    """

    def __init__(self, *, measure: bool = False, device: torch.device | None = None,
                 progress: bool = False) -> None:
        super().__init__()
        self._ops: dict[Any, _OpInfo] = {}
        self._var_of: dict[int, int] = {}          # StorageImpl address -> variable id
        self._pins: list[Any] = []                 # weak refs that keep those addresses unique
        self._nbytes: list[int] = []
        self._vname: list[str] = []
        self._kind: list[Kind | None] = []
        self._live_in: list[bool] = []
        self._live_out: list[bool] = []
        self._fname: list[str] = []
        self._fuses: list[tuple[tuple[int, bool], ...]] = []
        self._fflops: list[float] = []
        self._fbytes: list[int] = []
        self._fsecs: list[float | None] = []
        self._saved: set[int] = set()              # addresses autograd packed
        self._stash: dict[int, torch.Tensor] = {}
        self._external = 0
        self.scope: str | Callable[[], str] = ""
        self.marks: dict[str, int] = {}
        self.failed_at: tuple[int, str] | None = None
        self._sync = (lambda: torch.cuda.synchronize(device)) if (
            measure and device is not None and device.type == "cuda") else None
        self._measure = measure
        self._progress = progress
        self._bar: Any = None

    # -- set-up and results ------------------------------------------------------------

    def register(self, t: torch.Tensor, kind: Kind, name: str, *, live_in: bool = True,
                 live_out: bool = False) -> int | None:
        """Declare a storage that exists before the step; the first registration wins."""
        key = _key(t)
        if key is None:
            return None
        vid = self._var_of.get(key)
        if vid is None:
            vid = self._new(t.untyped_storage(), key, name)
            self._kind[vid], self._live_in[vid], self._live_out[vid] = kind, live_in, live_out
        return vid

    def mark(self, t: torch.Tensor, kind: Kind, name: str, *, live_out: bool = False) -> None:
        """Classify a storage the step created (a gradient, replaced state) unless a
        registration already classified it."""
        key = _key(t)
        vid = self._var_of.get(key) if key is not None else None
        if vid is not None and self._kind[vid] is None:
            self._kind[vid], self._vname[vid], self._live_out[vid] = kind, name, live_out

    def phase(self, name: str) -> None:
        """Note that phase ``name`` (e.g. ``"backward"``) starts at the next function."""
        self.marks[f"{name}_start"] = len(self._fname)

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that note every storage autograd saves; the tensors go to a stash (not
        into the graph, which would make a reference cycle) and leave it when unpacked."""
        stash, saved, handles = self._stash, self._saved, itertools.count()

        def pack(t: torch.Tensor) -> int:
            key = _key(t)
            if key is not None:
                saved.add(key)
            handle = next(handles)
            stash[handle] = t
            return handle

        def unpack(handle: int) -> torch.Tensor:
            return stash.pop(handle)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sequence(self, meta: dict[str, Any] | None = None) -> VariableSequence:
        """The recorded functions and variables (classification applied)."""
        saved = {self._var_of[k] for k in self._saved if k in self._var_of}
        variables: dict[int, Variable] = {}
        for vid in range(len(self._nbytes)):
            kind = self._kind[vid]
            if kind is None:
                kind = Kind.ACTIVATION if vid in saved else Kind.TEMPORARY
            variables[vid] = Variable(vid, self._nbytes[vid], kind, self._vname[vid],
                                      self._live_in[vid], self._live_out[vid])
        reads = [Use(v, Access.READ) for v in range(len(self._nbytes))]
        writes = [Use(v, Access.WRITE) for v in range(len(self._nbytes))]
        functions = tuple(
            Function(i, self._fname[i],
                     tuple(writes[v] if w else reads[v] for v, w in self._fuses[i]),
                     Cost(self._fflops[i], self._fbytes[i], self._fsecs[i]))
            for i in range(len(self._fname)))
        return VariableSequence(functions, variables, {**self.marks, **(meta or {})})

    # -- the per-op work (keep it small: it runs for every aten op) ---------------------

    def __enter__(self) -> "Recorder":
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(desc="tracing", unit=" ops", file=sys.stderr, delay=0.5,
                             mininterval=0.25, leave=False)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _new(self, storage: Any, key: int, name: str) -> int:
        vid = len(self._nbytes)
        self._var_of[key] = vid
        self._pins.append(storage._weak_ref())
        self._nbytes.append(storage.nbytes())
        self._vname.append(name)
        self._kind.append(None)
        self._live_in.append(False)
        self._live_out.append(False)
        return vid

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        index = len(self._fname)
        seconds = None
        try:
            if self._measure:
                if self._sync is not None:
                    self._sync()
                t0 = time.perf_counter()
                out = func(*args, **kwargs)
                if self._sync is not None:
                    self._sync()
                seconds = time.perf_counter() - t0
            else:
                out = func(*args, **kwargs)
        except BaseException:
            self.failed_at = (index, info.name)
            raise
        scope = self.scope if isinstance(self.scope, str) else self.scope()
        fname = f"{scope}:{info.name}" if scope else info.name
        self._fname.append(fname)
        self._fsecs.append(seconds)
        if self._bar is not None and not index & 127:
            self._bar.update(128 if index else 1)
        if info.view:
            self._fuses.append(())
            self._fflops.append(0.0)
            self._fbytes.append(0)
            return out

        var_of = self._var_of
        ins: list[torch.Tensor] = []
        _collect(args, ins)
        if kwargs:
            _collect(kwargs.values(), ins)
        uses: list[tuple[int, bool]] = []
        seen: set[int] = set()
        nbytes = 0
        for t in ins:
            nbytes += t.nbytes
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
                continue
            key = s._cdata
            vid = var_of.get(key)
            if vid is None:  # created outside the recorded step: an external input
                vid = self._new(s, key, f"external#{self._external}")
                self._external += 1
                self._kind[vid], self._live_in[vid] = Kind.INPUT, True
            if vid not in seen:
                seen.add(vid)
                uses.append((vid, False))
        for m in info.mutated:
            arg = args[m] if isinstance(m, int) and m < len(args) else kwargs.get(
                m if isinstance(m, str) else "", None)
            for t in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    vid = var_of.get(s._cdata)  # read above
                    if vid is None:
                        continue
                    uses.append((vid, True))
                    n = s.nbytes()
                    if n > self._nbytes[vid]:  # out= results may be resized
                        self._nbytes[vid] = n
        outs: list[torch.Tensor] = []
        if isinstance(out, torch.Tensor):
            outs.append(out)
        elif isinstance(out, (list, tuple)):
            _collect(out, outs)
        k = 0
        for t in outs:
            nbytes += t.nbytes
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = s._cdata
            if key not in var_of:
                vid = self._new(s, key, f"{fname}#{index}" if k == 0 else f"{fname}#{index}.{k}")
                uses.append((vid, True))
            k += 1
        self._fuses.append(tuple(uses))
        self._fbytes.append(nbytes)
        flops = 0.0
        if info.flop is not None:
            try:
                flops = float(info.flop(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not cover this overload
                flops = 0.0
        self._fflops.append(flops)
        return out


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


# -- the step -----------------------------------------------------------------------------------


def _record(model: nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: Any,
            loss_fn: LossFn, dev: torch.device, measure: bool,
            progress: bool) -> Recorder:
    opt.zero_grad(set_to_none=True)
    with _explain_failure(None, dev):
        _step(model, opt, inputs, targets, loss_fn)  # warm-up: lazy optimizer state appears

    rec = Recorder(measure=measure, device=dev, progress=progress)
    names = _register(rec, model, opt, inputs, targets)
    scopes = _Scopes(model, names)
    try:
        with _explain_failure(rec, dev), rec, rec.saved_tensors_hooks():
            rec.phase("forward")
            rec.scope = scopes.forward
            output = _call(model, inputs)
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
            for pname, p in names.params:
                if p.grad is not None:
                    rec.mark(p.grad, Kind.GRAD, f"{pname}.grad")
            rec.phase("optimizer")
            rec.scope = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        scopes.remove()
        rec._stash.clear()
    # Anything persistent the step replaced rather than updated in place stays alive.
    for pname, p in names.params:
        rec.mark(p, Kind.PARAM, pname, live_out=True)
    for bname, b in names.buffers:
        rec.mark(b, Kind.PARAM, bname, live_out=True)
    for pname, p in names.params:
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                rec.mark(value, Kind.OPTIMIZER_STATE, f"{pname}.{key}", live_out=True)
    return rec


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: Any,
          loss_fn: LossFn) -> None:
    output = _call(model, inputs)
    loss = loss_fn(output, targets) if targets is not None else loss_fn(output)
    del output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError(f"loss_fn must return a scalar tensor, got "
                         f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@dataclass
class _Names:
    params: list[tuple[str, nn.Parameter]]
    buffers: list[tuple[str, torch.Tensor]]


def _register(rec: Recorder, model: nn.Module, opt: torch.optim.Optimizer, inputs: Any,
              targets: Any) -> _Names:
    """Declare what exists before the step, in a fixed order (so ids are reproducible)."""
    names = _Names(list(model.named_parameters()), list(model.named_buffers()))
    pname = {id(p): n for n, p in names.params}
    for n, p in names.params:
        rec.register(p, Kind.PARAM, n, live_out=True)
    for n, b in names.buffers:
        rec.register(b, Kind.PARAM, n, live_out=True)
    extra = 0
    for group in opt.param_groups:
        for p in group["params"]:
            n = pname.get(id(p))
            if n is None:  # an optimized tensor that is not a model parameter
                n = f"param#{extra}"
                extra += 1
                rec.register(p, Kind.PARAM, n, live_out=True)
                names.params.append((n, p))
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    rec.register(value, Kind.OPTIMIZER_STATE, f"{n}.{key}", live_out=True)
    for n, t in _named_tensors("input", inputs):
        rec.register(t, Kind.INPUT, n)
    for n, t in _named_tensors("target", targets):
        rec.register(t, Kind.INPUT, n)
    return names


def _named_tensors(prefix: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [(f"{prefix}.{k}", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    if isinstance(value, (list, tuple)):
        return [(f"{prefix}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


class _Scopes:
    """Which module an op belongs to.

    Forward: module pre/post hooks keep a stack of module paths. Each autograd node gets a
    sequence number when the forward creates it (monotonic per thread), so the hooks also
    log (first sequence number, module path) change points; in the backward the node
    running the op (``torch._C._current_autograd_node()``) is looked up there. Gradient
    accumulation nodes have no number of their own (they hold the parameter instead).
    Only forward hooks are used: module *backward* hooks wrap outputs in an extra autograd
    function, which changes the ops and breaks in-place ReLU.
    """

    def __init__(self, model: nn.Module, names: _Names) -> None:
        self._stack: list[str] = []
        self._outside = "model"
        self._points: list[int] = []
        self._paths: list[str] = []
        self._param_path = {id(p): (n.rpartition(".")[0] or "model") for n, p in names.params}
        self._handles: list[Any] = []
        self._seq = torch._C._autograd._get_sequence_nr
        self._node = torch._C._current_autograd_node
        for path, module in model.named_modules():
            label = path or "model"
            self._handles.append(module.register_forward_pre_hook(self._pre(label)))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _pre(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(label)
            self._change(label)
        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stack.pop()
        self._change(self._stack[-1] if self._stack else self._outside)

    def _change(self, label: str) -> None:
        self._points.append(self._seq())
        self._paths.append(label)

    def enter(self, label: str) -> None:
        """Ops outside any module are now part of ``label`` (``"loss"``)."""
        self._stack = []
        self._outside = label
        self._change(label)

    def forward(self) -> str:
        return self._stack[-1] if self._stack else self._outside

    def backward(self) -> str:
        node = self._node()
        if node is None:
            return "backward"
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad
            return self._param_path.get(id(variable), "backward")
        i = bisect.bisect_right(self._points, node._sequence_nr()) - 1
        return self._paths[i] if i >= 0 else "backward"

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _explain_failure:
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


# -- copies of the model, optimizer and inputs -------------------------------------------------


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _copy_model(model: nn.Module, dev: torch.device) -> tuple[nn.Module, dict[int, Any]]:
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


def _make_optimizer(optimizer: Any, work: nn.Module, memo: dict[int, Any],
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


def _to_device(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        if dev.type == "meta":
            return torch.empty_like(value, device="meta")
        return value.to(dev)
    if isinstance(value, dict):
        return {k: _to_device(v, dev) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, dev) for v in value)
    return value


def _default_loss(has_targets: bool) -> LossFn:
    if has_targets:
        return torch.nn.functional.cross_entropy
    return lambda output: output.float().mean()


def _batch_size(inputs: Any) -> int | None:
    for _, t in _named_tensors("input", inputs):
        return int(t.shape[0]) if t.dim() else None
    return None


# ``import ooc.trace`` binds this *module* as the attribute ``ooc.trace``, shadowing the
# function that ``ooc`` exports lazily under the same name. Making the module callable keeps
# ``ooc.trace(model, ...)`` working whatever was imported first.
class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> VariableSequence:
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
