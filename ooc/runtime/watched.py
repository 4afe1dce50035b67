"""Tensors whose bytes may be elsewhere, watched: any use of one from Python brings it back.

Between steps, a managed parameter, gradient or optimizer state tensor may be on the slower
tier: its storage is resized to 0 bytes (``ooc/runtime/slots.py``) under a tensor that keeps
its shape, so that the model and the optimizer keep their objects. PyTorch checks nothing
there: a kernel that reads such a tensor reads out of bounds (``p.sum()`` was a segfault) or
garbage. No dispatch mode is active outside a step, and a plain tensor has no hook; but the
Python class of a tensor can change in place. ``watch`` gives such a tensor (the same object:
the model's ``nn.Parameter``, the optimizer's ``exp_avg``) a twin of its class whose
``__torch_function__`` asks its owner to bring the bytes back before an op uses them
(``Owner.enter``), and runs the op on the plain class. Every PyTorch function, method, operator
and attribute reached from Python goes through ``__torch_function__``: ``p.sum()``, ``p.data``,
``torch._foreach_norm(grads)``, ``F.linear(x, w)``, ``torch.save``'s pickling, ``repr``.
What reads only metadata (shape, dtype, ``grad``, ``requires_grad_``, hashing as the
optimizer's state key) runs without bringing anything back. ``unwatch`` gives the plain class
back, so steps run on plain tensors and pay nothing.

What this cannot see: C++ that reads a tensor no Python call handed it. Autograd is the one
that matters: a backward's ``AccumulateGrad`` adds into ``p.grad``, and an op's saved tensors
are read by its backward. So a parameter used with grad mode on brings its watched gradient
back too, and the owner is told which tensors autograd saved (``Owner.enter``'s ``pinned``),
which it must not release again before the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

import torch
from torch.utils import _foreach_utils
from torch.utils._pytree import tree_leaves

__all__ = ["Owner", "is_watched", "unwatch", "watch", "watchable"]


class Owner(Protocol):
    """Who brings a watched tensor's bytes back: the engine's ``BetweenSteps``."""

    def enter(self, keys: list[Hashable]) -> None:
        """Before an op uses the tensors of ``keys``: make their bytes usable, and hold them
        until ``leave``. Raises ``OOCError`` naming a tensor that cannot come back."""

    def leave(self, keys: list[Hashable], pinned: set[Hashable]) -> None:
        """The op that ``enter`` was for returned (or raised). ``pinned``, of ``keys``: what
        autograd may read later, from C++ (a saved tensor, a gradient it adds into): keep
        those until the next step."""


# id(tensor) -> (the tensor, weakly; its owner; its key for the owner). A watched tensor is
# also an instance of a twin class; an instance of a twin that is not here (a copy made by
# ``type(self)(...)``) is plain and gets its plain class at its first use.
_WATCHED: dict[int, tuple[weakref.ref, Owner, Hashable]] = {}
_TWINS: dict[type, type] = {}


def watchable(t: torch.Tensor) -> bool:
    """Whether ``t``'s class can be given a watching twin: a plain tensor or parameter (or a
    subclass that leaves ``__torch_function__`` as they do), not a subclass with its own."""
    cls = getattr(type(t), "_ooc_plain", type(t))
    return cls is torch.Tensor or (issubclass(cls, torch.Tensor)
                                   and cls.__torch_function__ is torch._C._disabled_torch_function_impl)


def watch(t: torch.Tensor, owner: Owner, key: Hashable) -> None:
    """Have every use of ``t``'s bytes from Python call ``owner.enter`` with ``key`` first."""
    i = id(t)

    def gone(ref: weakref.ref) -> None:   # a gradient zero_grad() dropped: forget it
        if _WATCHED.get(i, (None,))[0] is ref:
            del _WATCHED[i]

    _WATCHED[i] = (weakref.ref(t, gone), owner, key)
    t.__class__ = _twin(type(t))


def unwatch(t: torch.Tensor) -> None:
    """Give ``t`` its plain class back (a no-op for a tensor that is not watched)."""
    entry = _WATCHED.get(id(t))
    if entry is not None and entry[0]() is t:
        del _WATCHED[id(t)]
    plain = getattr(type(t), "_ooc_plain", None)
    if plain is not None:
        t.__class__ = plain


def is_watched(t: Any) -> bool:
    entry = _WATCHED.get(id(t))
    return entry is not None and entry[0]() is t


def _twin(cls: type) -> type:
    plain = getattr(cls, "_ooc_plain", cls)
    twin = _TWINS.get(plain)
    if twin is None:
        namespace = {"__torch_function__": classmethod(_torch_function), "_ooc_plain": plain,
                     "__deepcopy__": _deepcopy, "__reduce_ex__": _reduce_ex, "__module__": __name__}
        twin = _TWINS[plain] = type(plain)(f"Watched{plain.__name__}", (plain,), namespace)
        # PyTorch's foreach utilities (clip_grad_norm_, GradScaler) take their multi-tensor
        # path only for the exact classes listed here: a watched gradient takes the path an
        # in-core one takes (its foreach ops then run entry by entry: ``_per_entry``).
        supported = getattr(_foreach_utils, "_foreach_supported_types", None)
        if isinstance(supported, list) and plain in supported:
            supported.append(twin)
    return twin


# What reads only a tensor's metadata or autograd's bookkeeping, never its bytes. Anything
# else brings the bytes back first: a function missing here costs a read, never a wrong one.
_GETTERS = ("shape", "dtype", "device", "layout", "requires_grad", "grad", "_grad", "grad_fn",
            "_grad_fn", "is_leaf", "_version", "ndim", "names", "name", "nbytes", "itemsize",
            "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized",
            "is_mkldnn", "is_nested", "is_xpu", "is_mps", "_base", "output_nr", "_backward_hooks",
            "_post_accumulate_grad_hooks")
_SETTERS = ("grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks", "name")
_METHODS = ("size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
            "element_size", "is_floating_point", "is_complex", "is_signed", "get_device",
            "requires_grad_", "detach_", "retain_grad", "register_hook",
            "register_post_accumulate_grad_hook", "_is_view", "is_inference", "has_names",
            "__len__", "__dir__", "__hash__")


def _metadata_functions() -> set[Any]:
    """What ``__torch_function__`` is given for those: a descriptor's ``__get__``/``__set__``
    (attributes), the method itself (methods). Names this PyTorch lacks are left out."""
    out = {getattr(torch.Tensor, n) for n in _METHODS if hasattr(torch.Tensor, n)}
    for names, accessor in ((_GETTERS, "__get__"), (_SETTERS, "__set__")):
        for name in names:
            f = getattr(getattr(torch.Tensor, name, None), accessor, None)
            if f is not None:
                out.add(f)
    return out


_METADATA = _metadata_functions()


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    pieces = _per_entry(func, args, kwargs)
    if pieces is not None:
        outs = [_use(_tensors(a), lambda a=a: func(*a, **kwargs)) for a in pieces]
        return None if outs[0] is None else type(outs[0])(x for out in outs for x in out)
    return _use(_tensors((args, kwargs)), lambda: func(*args, **kwargs))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _per_entry(func: Any, args: tuple, kwargs: dict) -> list[tuple] | None:
    """A foreach op (``torch._foreach_*``) over watched tensors, as one call per list entry;
    None to run it whole. As in a step (``ooc.record.op_schema.split_foreach``): a foreach op
    needs all its lists' tensors at once (``clip_grad_norm_``: every gradient), more than
    the budget where managing them matters; each entry is computed on its own either way.
    Only when every other tensor argument is a scalar (0-dim)."""
    if not getattr(func, "__name__", "").startswith("_foreach_"):
        return None
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    n = len(args[lists[0]]) if lists else 0
    if n < 2 or any(len(args[i]) != n for i in lists) or any(isinstance(v, (list, tuple)) for v in kwargs.values()):
        return None
    if not any(is_watched(t) for i in lists for t in args[i]):
        return None
    if any(t.dim() != 0 for t in _tensors(([a for i, a in enumerate(args) if i not in lists], kwargs))):
        return None
    return [tuple(a[k:k + 1] if i in lists else a for i, a in enumerate(args)) for k in range(n)]


def _deepcopy(self, memo):   # Parameter's builds the copy with type(self): the plain class
    return _use([self], lambda: self.__deepcopy__(memo))


def _reduce_ex(self, proto):   # pickling: torch.save, copy.copy
    return _use([self], lambda: self.__reduce_ex__(proto))


def _use(tensors: Iterable[torch.Tensor], call: Callable[[], Any]) -> Any:
    """Run ``call`` with the watched ones among ``tensors`` brought back by their owners and
    plain while it runs (so that it sees what PyTorch would show it, ``type(self)`` too)."""
    found: dict[int, tuple[torch.Tensor, Owner, Hashable]] = {}
    pinned: set[int] = set()   # ids of found tensors autograd may read later
    grad = torch.is_grad_enabled()
    for t in tensors:
        entry = _WATCHED.get(id(t))
        if entry is None or entry[0]() is not t:
            if hasattr(type(t), "_ooc_plain"):   # a copy of a watched tensor: plain
                t.__class__ = type(t)._ooc_plain
            continue
        found[id(t)] = (t, *entry[1:])
        if grad and t.requires_grad:   # a backward's AccumulateGrad adds into p.grad from C++
            with torch._C.DisableTorchFunctionSubclass():
                g = t.grad
            if g is not None and is_watched(g):
                found[id(g)] = (g, *_WATCHED[id(g)][1:])
                pinned.add(id(g))
    if not found:
        return call()
    by_owner: dict[int, tuple[Owner, list[Hashable]]] = {}
    for t, owner, key in found.values():
        by_owner.setdefault(id(owner), (owner, []))[1].append(key)
    entered: list[tuple[Owner, list[Hashable]]] = []
    try:
        for owner, keys in by_owner.values():
            owner.enter(keys)
            entered.append((owner, keys))
        for t, _, _ in found.values():   # (an owner may have unwatched it: plain already)
            t.__class__ = getattr(type(t), "_ooc_plain", type(t))
        try:
            if grad and any(t.requires_grad for t, _, _ in found.values()):
                return _noting_saved(found, call, pinned)
            return call()
        except BaseException:
            pinned.update(found)   # whatever the op left behind: keep it all
            raise
        finally:
            for t, _, _ in found.values():
                if is_watched(t):
                    t.__class__ = _twin(type(t))
    finally:
        for owner, keys in entered:
            owner.leave(keys, {key for i, (_, o, key) in found.items() if o is owner and i in pinned})


def _noting_saved(found: dict[int, tuple[torch.Tensor, Owner, Hashable]], call: Callable[[], Any],
                  pinned: set[int]) -> Any:
    """``call`` under grad mode: the ids of ``found`` whose storage autograd saves for a
    backward go into ``pinned`` (its backward reads them from C++, even after a release)."""
    by_storage = {id(t.untyped_storage()): i for i, (t, _, _) in found.items() if t.layout is torch.strided}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.layout is torch.strided:
            i = by_storage.get(id(x.untyped_storage()))
            if i is not None and found[i][0].untyped_storage() is x.untyped_storage():
                pinned.add(i)
        return x.data if x.grad_fn is not None else x   # (its own node's: saved_tensors.unlinked)

    hooks = torch._C._autograd
    if hooks._top_saved_tensors_default_hooks(False) is not None or not hooks._saved_tensors_hooks_is_enabled():
        pinned.update(found)   # the user's saved-tensor hooks are in charge: keep everything
        return call()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        return call()
