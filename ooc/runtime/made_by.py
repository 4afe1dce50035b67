"""What autograd's graph tells of how a tensor was made: all a hook-driven step sees of the ops.

A step watched by saved-tensor hooks alone sees each tensor autograd saves and, through its
``grad_fn``, the nodes that made it: their types and the numbers and flags each saved. The
template form (``templates.py``) compares these with what the per-op step it was captured
from saw, where a discarded activation is saved: another op, or another number, made it.
"""

from __future__ import annotations

from typing import Any

import torch

_SCALARS: dict[type, tuple[str, ...]] = {}   # node type -> its saved arguments that are no tensor
_SHAPES = ("size", "stride", "storage_offset")   # a view's metadata: which view node depends on the dispatch


def _scalar_names(node: Any) -> tuple[str, ...]:
    """The saved arguments of an autograd node that are not tensors (a tensor's has a
    ``_raw_saved_`` twin; reading it would unpack it, through the step's own hooks)."""
    kind = type(node)
    names = _SCALARS.get(kind)
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_") and not hasattr(node, "_raw" + a)
                      and not any(m in a for m in _SHAPES))
        _SCALARS[kind] = names
    return names


def _value(node: Any, name: str) -> Any:
    try:
        return getattr(node, name)
    except RuntimeError:   # released, or not readable here: the same in every step
        return "?"


def signature(t: torch.Tensor, depth: int) -> tuple:
    """What made ``t``'s bytes as autograd's graph tells it, ``depth`` nodes back from ``t``'s:
    each node's type with the numbers and flags it saved (a ``pow``'s exponent, a
    ``leaky_relu``'s slope, a ``clamp``'s bounds: arguments that are no tensor, which a
    template replays as captured). View nodes are "view" (which one depends on the dispatch:
    see ``node_of``). A schedule that changes such a number between steps changes this."""
    out: list[Any] = []
    # Each node visited is held to the walk's end: a node's Python object may be made for this
    # walk and die with its level, and a later node's new one could take its address (its
    # ``id``) and be skipped as seen. A first walk differed from the next ones so on an H200.
    seen: dict[int, Any] = {}
    frontier = [t.grad_fn]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            name = type(node).__name__
            if name == "AccumulateGrad":
                continue
            view = "View" in name or "Alias" in name or "Reshape" in name
            out.append("view" if view else (name, tuple(_value(node, a) for a in _scalar_names(node))))
            nxt.extend(f for f, _ in node.next_functions)
        frontier = nxt
    return tuple(out)


def said(sig: tuple, at: int) -> str:
    if at >= len(sig):
        return "nothing"
    node = sig[at]
    return "a view" if node == "view" else f"{node[0]}{list(node[1]) if node[1] else ''}"


def node_of(t: torch.Tensor) -> str:
    """The type of the autograd node that made ``t``'s bytes: "view" for a view (its bytes are
    its base's, and which view node makes it depends on the dispatch: ``reshape`` gives
    ``ReshapeAliasBackward0`` without a Python mode and ``ViewBackward0`` under the per-op
    path's), "leaf" for none."""
    if t._is_view():
        return "view"
    fn = t.grad_fn
    return "leaf" if fn is None else type(fn).__name__
