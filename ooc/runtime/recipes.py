"""A captured call of a chain function, and rerunning a chain of them below autograd.

A chain reruns exactly what ran: each call (``Recipe``, captured by the per-op path in
``recompute.py``; or ``templates.Template``, its form for a hook-driven step) is the aten op
with its arguments, each managed tensor a ``Ref`` (its slot and how to rebuild the view) and
each unmanaged result of the chain a ``Made``. ``rerun`` replays a chain below autograd
(nothing of it is recorded for a backward) but with the grad mode each op ran under (kernels
read it: the CPU's LSTM, ``mkldnn_rnn_layer``, returns no workspace under ``no_grad``), with
autocast off (the op was recorded after autocast had cast its inputs: replaying it as recorded
is exactly what ran), with the generator state restored around random ops, and with copies of
BatchNorm's running statistics, so the replay does not update them twice (torch.utils.
checkpoint does: pytorch#96136; its output does not depend on them). A chain's own results
live only until the last call that reads them (``lifetimes``), as the plan counted them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ooc.errors import OOCError
from ooc.record.op_schema import tensors
from ooc.runtime.slots import Slot
from ooc.runtime.views import View
from vmm.units import format_size


@dataclass(frozen=True, slots=True)
class Ref:
    """A managed tensor among a recipe's arguments: rebuilt on its slot's storage at replay."""

    slot: Slot
    view: View

    def tensor(self, storage: torch.UntypedStorage | None = None) -> torch.Tensor:
        """The view on the slot's storage, or on ``storage`` (the same bytes, made by a replay)."""
        return self.view.on(self.slot.storage if storage is None else storage)


@dataclass(frozen=True, slots=True)
class Made:
    """An unmanaged result of this step among a recipe's arguments: output ``out`` of chain
    function ``op``, rebuilt at replay from what that function's replay returned."""

    op: int
    out: int
    view: View

    def tensor(self, made: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """The view on what the replay of ``op`` returned."""
        return self.view.of_tensor(made[(self.op, self.out)])


@dataclass(slots=True)
class Recipe:
    """One captured call of a chain function: ``func(*args, **kwargs)`` with ``Ref``s for
    managed tensors; ``held`` the other tensors and their versions then; ``rng`` the generator
    state before it ran (random ops only); ``stats``: the positions of BatchNorm's running
    statistics, copied for the replay (None if the call does not update them); ``grad``: the
    grad mode it ran under; ``outputs``: how many tensors it returned."""

    func: Any
    args: tuple
    kwargs: dict
    held: list[tuple[torch.Tensor, int]]
    rng: torch.Tensor | None
    stats: tuple[int, int] | None
    grad: bool
    outputs: int
    outside: bool = False   # ran outside every forward of the model (``forward_numbers.loose_numbers``)

    def changed(self) -> torch.Tensor | None:
        """A held tensor written since the capture (its bytes are not what the op read)."""
        for t, version in self.held:
            if t._version != version:
                return t
        return None


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


Key = tuple[int, int]   # (chain function, output): a result of the chain's replay


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """Which results of a chain's calls a later call of it reads (``kept``: the others are let
    go as they come), and, by call index, those read there for the last time (``last``)."""

    kept: frozenset[Key]
    last: Mapping[int, tuple[Key, ...]]


def lifetimes(calls: list[tuple[int, Any]], key_of: Callable[[Any], Key | None]) -> Lifetimes:
    """How long a replay of ``calls`` holds each result of its own: to the last call that
    reads it (``key_of(argument)``: the result an argument is rebuilt from, None if none,
    exactly as the caller's ``materialize`` reads ``made``). The plan counts a chain's
    temporaries so (``scheduler.replay``: each freed after the last chain function that reads
    it); held to the chain's end, a chain through a whole bottleneck kept every output it made
    again at once: ResNet-50 at 1/4 on an H200 held 7.2 GiB of replay results that no slot
    held at the step's peak, over a plan that counted 6.75 GiB in all."""
    last: dict[Key, int] = {}
    for i, (_, r) in enumerate(calls):
        for x in _arguments(r):
            key = key_of(x)
            if key is not None:
                last[key] = i
    by_call: dict[int, list[Key]] = {}
    for key, i in last.items():
        by_call.setdefault(i, []).append(key)
    return Lifetimes(frozenset(last), {i: tuple(keys) for i, keys in by_call.items()})


def _arguments(r: Any) -> list[Any]:
    """The leaves of a call's arguments that ``_rerun`` fills (a template's spots where it has
    them), found by the same walk (``_fill``)."""
    spots = getattr(r, "spots", None)
    if spots is not None:
        return [x for _, x in spots]
    leaves: list[Any] = []
    _fill(r.args, leaves.append)
    if r.kwargs:
        _fill(r.kwargs, leaves.append)
    return leaves


def rerun(calls: list[tuple[int, Any]], materialize: Callable[[Any, dict], Any], *, slot: Slot, producer: int,
          out_index: int, born: Callable[[torch.UntypedStorage], None], rng_device: torch.device | None,
          name_of: Callable[[int], str], lives: Lifetimes) -> None:
    """Replay a chain, ``calls`` ((function, ``Recipe`` or ``templates.Template``) in step
    order), below autograd, autocast off, each call under its grad mode and, for a random op,
    its generator state; ``materialize(x, made)`` gives each argument its tensor (``made``:
    the tensors the chain's earlier calls returned, by (function, output), each only as long as
    ``lives`` says). ``born(storage)`` gets the producer's output the moment it exists: the
    chain's in-place writers after it write into the slot. Raises ``OOCError`` where a call
    returns other tensors than when it ran."""
    made: dict[Key, torch.Tensor] = {}   # results of the chain's makers that a later call reads
    fill = lambda x: materialize(x, made)  # noqa: E731
    # Each context only where it changes something: on a step with no mode and no autocast
    # (a hook-driven step's backward) entering them cost ~40 us a chain (ooc/runtime/templates.py).
    modes = _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()
    grad = torch.is_grad_enabled()
    with modes, torch._C._AutoDispatchBelowAutograd(), _no_autocast():
        try:
            _rerun(calls, fill, made, slot, producer, out_index, born, rng_device, name_of, lives)
        finally:
            torch._C._set_grad_enabled(grad)


def _rerun(calls: list[tuple[int, Any]], fill: Callable[[Any], Any], made: dict, slot: Slot, producer: int,
           out_index: int, born: Callable[[torch.UntypedStorage], None], rng_device: torch.device | None,
           name_of: Callable[[int], str], lives: Lifetimes) -> None:
    """``rerun``'s loop, inside its contexts."""
    kept, last = lives.kept, lives.last
    for i, (w, r) in enumerate(calls):
        spots = getattr(r, "spots", None)   # a template's slots, where all are positional
        if spots is not None:
            args = list(r.args)
            for pos, x in spots:
                args[pos] = fill(x)
            kwargs = r.kwargs
        else:
            args = _fill(r.args, fill)
            kwargs = _fill(r.kwargs, fill) if r.kwargs else r.kwargs
        if r.stats is not None:
            args = list(args)
            for pos in r.stats:
                if pos < len(args) and isinstance(args[pos], torch.Tensor):
                    args[pos] = args[pos].clone()
            args = tuple(args)
        torch._C._set_grad_enabled(r.grad)   # what ``rerun`` restores at its end
        if r.rng is not None:
            saved = _rng_state(rng_device)
            _set_rng_state(rng_device, r.rng)
            try:
                out = r.func(*args, **kwargs)
            finally:
                _set_rng_state(rng_device, saved)
        else:
            out = r.func(*args, **kwargs)
        outs = (out,) if isinstance(out, torch.Tensor) else tensors(out)
        if len(outs) != r.outputs:   # its outputs are counted as on_op counted them
            raise OOCError(
                f"recomputing {slot.name}: {name_of(w)} returned {len(outs)} tensors "
                f"where it returned {r.outputs} when it ran; pass recompute=\"never\" to swap")
        del args, kwargs
        for key in last.get(i, ()):   # read for the last time: its bytes go back now
            made.pop(key, None)
        if w != producer:
            for k, t in enumerate(outs):
                if (w, k) in kept and t.layout is torch.strided:   # a sparse result is no Made
                    made[(w, k)] = t
        else:
            s = outs[out_index].untyped_storage()
            if s.nbytes() != slot.nbytes:
                raise OOCError(
                    f"recomputing {slot.name}: its producer {name_of(w)} gave "
                    f"{format_size(s.nbytes())} ({s.nbytes()} B), not {slot.nbytes} B")
            born(s)
        del out, outs


def _fill(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` with ``fn`` applied to each leaf of its tuples, lists and dicts: ``tree_map`` for
    an op's arguments, at a tenth of its cost (pytree's ~80 us a call was most of a replay)."""
    t = type(x)
    if t is tuple or t is list:
        return t([_fill(v, fn) for v in x])
    if t is dict:
        return {k: _fill(v, fn) for k, v in x.items()}
    return fn(x)


_AUTOCAST_DEVICES: list[tuple[str, ...]] = []


def _no_autocast() -> contextlib.AbstractContextManager:
    """Autocast off for every device type while a chain replays (see the module docstring);
    nothing to enter where it is off already (a backward outside the user's autocast)."""
    if not _AUTOCAST_DEVICES:   # asked once: torch.cuda.is_available() costs ~5 us a call
        _AUTOCAST_DEVICES.append(("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    on = [d for d in _AUTOCAST_DEVICES[0] if torch.is_autocast_enabled(d)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for d in on:
        stack.enter_context(torch.autocast(d, enabled=False))
    return stack
