"""What an optimizer step needs resident at once, measured on ``meta`` twins before it runs.

The recording step runs the optimizer on demand: every managed tensor an op touches, and
every storage the optimizer creates while its state is managed (it may become state), must be
resident together. Before the first update nothing recorded says how much that is: Adam's
``addcdiv_`` holds the parameter, ``exp_avg`` and the denominator it just computed, SGD's
momentum update the parameter and its buffer, another optimizer something else. Guessing
("two states like the parameter") let a budget through that the update then overflowed,
after it had changed parameters. Running the same ``step()`` on ``meta`` twins of the
parameters, gradients and state measures it instead, with no memory and without touching the
real optimizer, so that a budget too small for the update fails before anything changes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpNeed:
    """The optimizer op that needs the most managed bytes resident at once."""

    index: int                 # the op's index in the step (``first`` + its position)
    name: str                  # the aten op
    nbytes: int
    tensors: tuple[str, ...]   # what it holds, largest first


def optimizer_need(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str],
                   counted: frozenset[str] | set[str], min_bytes: int, first: int = 0) -> OpNeed | None:
    """Dry-run ``optimizer.step()`` on ``meta`` twins; return its most demanding op.

    ``counted``: the managed kinds ("params", "grads", "optimizer_state"; with the state, the
    storages the step creates count too, as the on-demand step counts them). Tensors smaller
    than ``min_bytes`` stay with PyTorch and do not count. Returns None if the optimizer
    cannot run on ``meta`` (a closure, a data-dependent branch): nothing is known then.
    ``first``: the index the step's first op will have, to name new storages as the stepper
    does (``aten.zeros_like.default#53``) until they turn out to be state (``0.weight.exp_avg``).
    """
    with _disable_current_modes():   # the engine's mode must not see the twins' ops
        made = _shadow(optimizer, names)
        if made is None:
            return None
        shadow, twins, known = made
        counter = _Count(known, frozenset(counted), min_bytes, first)
        if not _run(shadow, optimizer, counter):
            return None
        if counter.most is None:
            return None
        index, name, held = counter.most
        states = {t.untyped_storage()._cdata: f"{names.get(p, '?')}.{key}"
                  for p, twin in twins.items() for key, t in shadow.state.get(twin, {}).items()
                  if _counts(t)}
        parts = sorted(((s.nbytes(), states.get(s._cdata, what)) for s, what in held), reverse=True)
        return OpNeed(index, name, sum(n for n, _ in parts), tuple(f"{w} ({n} B)" for n, w in parts))


def state_sizes(optimizer: torch.optim.Optimizer, every: bool = False) -> dict[torch.Tensor, tuple[int, ...]] | None:
    """Bytes of each state tensor the optimizer has for each parameter after one more step,
    measured on ``meta`` twins: what its first update will create and write (Adam two tensors
    like the parameter, SGD with momentum one, Adagrad one, Adafactor smaller ones), instead of
    assuming an optimizer. ``every``: as if every parameter that requires a gradient had one
    (an update inside the backward runs before most have theirs). None if it cannot run on
    ``meta``."""
    with _disable_current_modes():
        made = _shadow(optimizer, {}, every)
        if made is None:
            return None
        shadow, twins, _ = made
        if not _run(shadow, optimizer, contextlib.nullcontext()):
            return None
        return {p: tuple(t.untyped_storage().nbytes() for t in shadow.state.get(twin, {}).values()
                         if _counts(t))
                for p, twin in twins.items()}


def update_held(optimizer: torch.optim.Optimizer, held: Callable[[str, int], int]) -> tuple[int, int] | None:
    """(The most bytes one op of ``optimizer.step()`` finds live, its ops) measured on ``meta`` twins, as a
    recording of the whole step counts them: the parameters and the state (what the update
    makes too: the next step starts with it) at every op, each gradient to the update's end
    (``zero_grad`` lets go of it after), each temporary (Adam's denominators; a foreach
    update's lists of them) from its op until it died (Adam's ``denom`` lives until the next
    parameter's is made). ``held(kind, nbytes)``: what a storage of ``kind``
    ("params", "grads", "optimizer_state", which a temporary born in ``step()`` is too) and so
    many bytes counts (0: ooc manages it). None if the optimizer cannot run on ``meta``.

    Why: under a budget for the whole step the update's own temporaries may be the most the
    step holds beside its managed tensors; measured only once the update ran, a budget too small
    for them was refused after the step had changed the parameters."""
    with _disable_current_modes():
        made = _shadow(optimizer, {})
        if made is None:
            return None
        shadow, twins, known = made
        before = {t.untyped_storage()._cdata for t in _state(shadow)}
        uses = _Uses()
        if not _run(shadow, optimizer, uses):
            return None
    ops = max(uses.i, 1)
    # There at every op: the parameters, the state that was, and the state the update makes
    # by an op (its first step's scalar counters, made by ``torch.tensor``, no op the recording
    # sees, count as its inputs do: until their last use).
    always = {t.untyped_storage()._cdata: (t.untyped_storage().nbytes(), kind) for t, kind in
              [(t, "params") for t in twins.values()]
              + [(t, "optimizer_state") for t in _state(shadow)
                 if _counts(t) or t.untyped_storage()._cdata in before]}
    delta = [0] * (ops + 1)
    for cdata, nbytes in {**uses.nbytes, **{c: n for c, (n, _) in always.items()}}.items():
        if cdata in always:
            kind, first, last = always[cdata][1], 0, ops - 1
        else:   # a gradient there from the start, a temporary from its op; each until it died
            kind = known.get(cdata, ("optimizer_state", ""))[0]   # (a gradient: after the update)
            first, last, died = 0 if kind == "grads" else uses.first[cdata], uses.last[cdata], uses.died.get(cdata)
            if died is not None or kind == "grads":   # (a scalar the state keeps: to its last use, as recorded)
                last = max(last, min(ops if died is None else died, ops) - 1)
        n = held(kind, nbytes)
        delta[first] += n
        delta[last + 1] -= n
    return max(itertools.accumulate(delta[:ops])), uses.i


def _state(shadow: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The strided tensors of ``shadow``'s state."""
    return [t for st in shadow.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.layout is torch.strided]


class _Uses(TorchDispatchMode):
    """Per storage an op of the dry run touched (read, wrote or made): its bytes, its first and
    last op, and the ops run when it died (``died``; still held at the end: absent), as the
    recorder sees the real step's (``ooc.record.recorder``, "Deaths"). Each address stays
    pinned (a weak reference keeps the ``StorageImpl``, not its bytes), so that no other
    storage takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.i = 0
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.died: dict[int, int] = {}
        self._pins: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _leaves((args, kwargs or {}, out)):
            if t.layout is not torch.strided:
                continue
            s = t.untyped_storage()
            key = s._cdata
            if key not in self.nbytes:
                self.nbytes[key] = s.nbytes()
                self.first[key] = self.i
                self._pins += (StorageWeakRef(s), weakref.ref(s, functools.partial(self._gone, key)))
            self.last[key] = self.i
        self.i += 1
        return out

    def _gone(self, key: int, _: weakref.ref) -> None:
        self.died[key] = self.i


_Shadow = tuple[torch.optim.Optimizer, dict[torch.Tensor, torch.nn.Parameter], dict[int, tuple[str, str]]]


def _shadow(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str], every: bool = False) -> _Shadow | None:
    """An optimizer of the same type over ``meta`` twins of the parameters, their grads (with
    ``every``, of each parameter that requires one) and their state; the twins by parameter;
    the kind and name of each twin storage. None where the type cannot be made again
    (``_same_type``)."""
    known: dict[int, tuple[str, str]] = {}
    twins: dict[torch.Tensor, torch.nn.Parameter] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            twin = twins.get(p)
            if twin is None:
                # Shapes only: on demand a parameter on the tier has an empty storage.
                twin = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                name = names.get(p, "a parameter")
                known[twin.untyped_storage()._cdata] = ("params", name)
                if p.grad is not None or (every and p.requires_grad):
                    twin.grad = torch.empty_like(p if p.grad is None else p.grad, device="meta")
                    if _counts(twin.grad):
                        known[twin.grad.untyped_storage()._cdata] = ("grads", f"{name}.grad")
                twins[p] = twin
            params.append(twin)
        groups.append({**{k: _apart(v) for k, v in group.items() if k != "params"}, "params": params})
        if (group.get("foreach", False) is None and not group.get("fused") and group["params"]
                and all(p.device.type == "cuda" for p in group["params"])):
            groups[-1]["foreach"] = True   # as PyTorch picks for CUDA tensors (not for meta ones)
    shadow = _same_type(optimizer, groups)
    if shadow is None:
        return None
    for p, state in optimizer.state.items():
        if p not in twins:
            continue
        copied = {}
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                v = torch.empty_like(v, device="meta")
                if _counts(v):
                    known[v.untyped_storage()._cdata] = ("optimizer_state", f"{names.get(p, '?')}.{key}")
            else:   # Adam's step counter (read with .item()), and any list or dict of tensors
                v = _apart(v)
            copied[key] = v
        shadow.state[twins[p]] = copied
    return shadow, twins, known


def _apart(v: Any) -> Any:
    """``v`` for the shadow, sharing no tensor with the real optimizer: the shadow's ``step()``
    writes what it holds (timm's Lamb counts its steps in a tensor of each parameter group: the
    shared counter went up at each dry run, and training with the state managed was not
    bitwise). A tensor of one element is copied (read with ``.item()``), a larger one is a
    ``meta`` twin; lists, tuples and dicts of them alike; anything else is shared (PyTorch's
    optimizers hold numbers and strings there)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone() if v.numel() <= 1 else torch.empty_like(v, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_apart(x) for x in v) if type(v) in (list, tuple) else v
    if isinstance(v, dict):
        return {k: _apart(x) for k, x in v.items()}
    return v


def _same_type(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer | None:
    """An optimizer of ``optimizer``'s type over ``groups``, with its defaults, else without
    (a subclass whose constructor takes other arguments); None if neither makes one (timm's
    ``Lookahead`` takes the optimizer it wraps: its AttributeError stopped the training step)."""
    why: Exception | None = None
    for kwargs in (lambda: optimizer.defaults, dict):
        try:
            return type(optimizer)(groups, **kwargs())
        except Exception as exc:  # noqa: BLE001 - not made again: not measured, not an error
            why = exc
    log.info("%s is not made again over meta twins (%s): its update is not measured before it runs",
             type(optimizer).__name__, why)
    return None


def _run(shadow: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, mode: Any) -> bool:
    """``shadow.step()`` under ``mode``; False if it does not run on ``meta``."""
    try:
        with mode:
            shadow.step()
    except Exception as exc:  # noqa: BLE001 - not runnable on meta: no measurement, not an error
        log.info("%s.step() does not run on meta tensors (%s): its first update is not "
                 "measured before it runs", type(optimizer).__name__, exc)
        return False
    return True


class _Count(TorchDispatchMode):
    """Per op, the bytes of the distinct counted storages among its inputs and outputs; keeps
    the op with the most (its storages too: a meta storage costs no memory)."""

    def __init__(self, known: dict[int, tuple[str, str]], counted: frozenset[str], min_bytes: int,
                 first: int) -> None:
        super().__init__()
        self.known, self.counted, self.min_bytes, self.first = known, counted, min_bytes, first
        self.i = 0
        self.total = -1
        self.most: tuple[int, str, list[tuple[torch.UntypedStorage, str]]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        at = self.first + self.i
        for t in _leaves(out):   # a storage born here: named as the stepper names it
            if _counts(t):
                self.known.setdefault(t.untyped_storage()._cdata, ("optimizer_state", f"{func}#{at}"))
        held: dict[int, tuple[torch.UntypedStorage, str]] = {}
        for t in _leaves((args, kwargs, out)):
            if not _counts(t):
                continue
            s = t.untyped_storage()
            if s._cdata in held or s.nbytes() < self.min_bytes:
                continue
            kind, name = self.known.get(s._cdata, ("optimizer_state", f"{func}#{at}"))
            if kind in self.counted:
                held[s._cdata] = (s, name)
        total = sum(s.nbytes() for s, _ in held.values())
        if total > self.total:
            self.total, self.most = total, (at, str(func), list(held.values()))
        self.i += 1
        return out


def _counts(t: Any) -> bool:
    """A twin's tensor with a storage: on ``meta`` and strided. A sparse gradient (and SGD's
    sparse momentum for it) has no storage, and the engine leaves it to PyTorch."""
    return isinstance(t, torch.Tensor) and t.device.type == "meta" and t.layout is torch.strided


def _leaves(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x)
