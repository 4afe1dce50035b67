"""What autograd's graph tells of how a tensor was made: all a hook-driven step sees of the ops.

A step watched by saved-tensor hooks alone sees each tensor autograd saves and, through its
``grad_fn``, the nodes that made it: their types and the numbers and flags each saved. The
template form (``templates.py``) compares these with what the per-op step it was captured
from saw, where a discarded activation is saved: another op, or another number, made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

VARIES = "varies"   # a number in a captured signature that changed between captures: any matches (``matches``)
_SHAPES = ("size", "stride", "storage_offset")   # a view's metadata: which view node depends on the dispatch
# Ops whose Python-number argument autograd may keep as a tensor (``_number``): only their
# nodes' saved tensors are looked at, each look ~1 us (all nodes: a GPT-2's walks took 65% longer).
_NUMBER_OPS = frozenset({"Mul", "Div", "Sub", "Rsub", "Pow", "Maximum", "Minimum", "Atan2", "Fmod", "Remainder",
                         "Hypot", "Xlogy", "Copysign", "Clamp", "Lerp", "Where"})
# node type -> what a walk makes of its nodes: None (a leaf's AccumulateGrad: not counted),
# "view", or its name, its saved arguments that are no tensor and those that may be a number
# (``_number``). Asked once a type: a step walks the graph at every discard, ~5,000 nodes a
# step of a 20-layer decoder.
_KINDS: dict[type, Any] = {}
_VIEW_HOPS = 4   # how many views deep a node's parameter is looked for (``_parameters``)
# The nodes of the view ops that a walk counts as nodes of their own (``_kind`` calls "view"
# only those whose view depends on the dispatch): a template reads any view of a parameter
# as the parameter (``b.unsqueeze(0)``, ``w.t()``, ``b.expand_as(x)``).
_VIEW_OPS = frozenset({"Unsqueeze", "Squeeze", "Expand", "Permute", "Transpose", "T", "Select", "Slice",
                       "Narrow", "AsStrided", "Diagonal", "Unfold", "Split", "SplitWithSizes", "Unbind"})
_VIEWS: dict[type, bool] = {}   # node type -> whether its op is a view (``_is_view``)


def _kind(node: Any) -> Any:
    kind = type(node)
    if kind in _KINDS:
        return _KINDS[kind]
    name = kind.__name__
    if name == "AccumulateGrad":
        said = None
    elif "View" in name or "Alias" in name or "Reshape" in name:
        said = "view"
    else:   # a tensor's saved argument has a ``_raw_saved_`` twin: reading it may unpack it
        saved = [a for a in dir(node) if a.startswith("_saved_") and not any(m in a for m in _SHAPES)]
        numbers = name.rstrip("0123456789").removesuffix("Backward") in _NUMBER_OPS
        said = (name, tuple(a for a in saved if not hasattr(node, "_raw" + a)),
                tuple(a for a in saved if numbers and hasattr(node, "_raw" + a)))
    _KINDS[kind] = said
    return said


def _value(node: Any, name: str) -> Any:
    try:
        return getattr(node, name)
    except RuntimeError:   # released, or not readable here: the same in every step
        return "?"


def _number(node: Any, name: str) -> Any:
    """A saved tensor argument that is a Python number the op was called with (``x / tau``,
    ``x * scale``: autograd keeps it as a 0-dim CPU tensor and saves it with no hook, so reading
    it unpacks nothing), else None. A temperature that changed after the template form settled
    was replayed as captured: a softmax at another temperature, every later step's parameters
    wrong (``tests/ooc/test_templates.py``)."""
    try:
        if getattr(node, "_raw" + name).unpack_hook is not None:
            return None   # the hooks saw it: a tensor of the step, not a number
        value = getattr(node, name)
    except RuntimeError:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        with torch._C._DisableTorchDispatch():   # read below the per-op path's mode: no op of the step
            return value.item()
    return None


def signature(t: torch.Tensor, depth: int, memo: dict[int, tuple] | None = None) -> tuple:
    """What made ``t``'s bytes as autograd's graph tells it, ``depth`` nodes back from ``t``'s:
    each node's type with the numbers and flags it saved (a ``pow``'s exponent, a
    ``leaky_relu``'s slope, a ``clamp``'s bounds: arguments that are no tensor, which a
    template replays as captured), and the parameters it read where it read any
    (``_parameters``). View nodes are "view" (which one depends on the dispatch: see
    ``node_of``). A schedule that changes such a number between steps changes this; a step
    that runs another layer reads other parameters.

    ``memo`` (one step's: ``id(node)`` -> the node, what it says, its next nodes) lets the walks
    of one step share what they read: a 20-layer decoder's step (benchmarks/bench_hook_host.py)
    walks 6 levels back at each of its 171 discards, 2,274 nodes of which 759 differ; on this
    CPU 6.4-7.3 ms a step alone, 3.8-4.3 ms sharing. A node's numbers are fixed when it is made;
    the memo holds the node, so its ``id`` is not reused while the memo lives."""
    out: list[Any] = []
    # Each node visited is held to the walk's end: a node's Python object may be made for this
    # walk and die with its level, and a later node's new one could take its address (its
    # ``id``) and be skipped as seen. A first walk differed from the next ones so on an H200.
    seen: dict[int, Any] = {}
    memo = {} if memo is None else memo
    frontier = [t.grad_fn]
    for _ in range(depth):
        nxt: list[Any] = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            entry = memo.get(id(node))
            if entry is None or entry[0] is not node:
                entry = memo[id(node)] = (node, *_described(node))
            if entry[1] is not None:
                out.append(entry[1])
                nxt += entry[2]
        frontier = nxt
    return tuple(out)


def _described(node: Any) -> tuple[Any, list[Any]]:
    """What a walk records of ``node`` (None: not counted, and not walked past) and its next
    nodes."""
    said = _kind(node)
    if said is None:
        return None, []
    nexts = [f for f, _ in node.next_functions]
    if said == "view":
        return said, nexts
    numbers = [_value(node, a) for a in said[1]] + [n for a in said[2] if (n := _number(node, a)) is not None]
    params = _parameters(nexts)
    return (said[0], tuple(numbers), *((params,) if params else ())), nexts


def _parameters(nexts: list[Any]) -> tuple[int, ...]:
    """The parameters a node read, itself or through views (``id``s, in its inputs' order;
    ``_VIEW_OPS``).

    Why: a template reads a parameter as itself, and one that no node saves (a bias added:
    ``t + self.b``) left no trace in what the hooks see. A step that skipped a layer
    (LayerDrop) saved the next layer's tensors where the skipped one's were, of the same
    sizes from the same nodes, and its chains were replayed with the skipped layer's bias:
    wrong gradients, the step's plan left or not (``tests/ooc/test_steps_that_change.py``)."""
    out = []
    for f in nexts:
        for _ in range(_VIEW_HOPS):
            if f is None:
                break
            kind = _kind(f)
            if kind is None:   # a leaf's AccumulateGrad
                if isinstance(v := f.variable, torch.nn.Parameter):
                    out.append(id(v))
                break
            if not _is_view(f) or not (up := f.next_functions):
                break
            f = up[0][0]
    return tuple(out)


def _is_view(node: Any) -> bool:
    """Whether ``node``'s op made a view: one a walk calls "view" (``_kind``), or of ``_VIEW_OPS``."""
    kind = type(node)
    view = _VIEWS.get(kind)
    if view is None:
        view = _VIEWS[kind] = (_kind(node) == "view"
                               or kind.__name__.rstrip("0123456789").removesuffix("Backward") in _VIEW_OPS)
    return view


def matches(got: tuple, want: tuple) -> int | None:
    """Where signature ``got`` first differs from the captured ``want`` (None: nowhere), a
    number ``VARIES`` in ``want`` matching any."""
    if got == want:
        return None
    for at, (a, b) in enumerate(zip(got, want)):
        if a != b and not (_numbered_alike(a, b) and all(x == y or y == VARIES for x, y in zip(a[1], b[1]))):
            return at
    return None if len(got) == len(want) else min(len(got), len(want))


def varied(sig: tuple, old: tuple) -> tuple:
    """Signature ``sig`` with the numbers that differ from ``old``'s, a capture of the same
    activation before, as ``VARIES`` (``Templates.vary_from``), where both hold as many nodes."""
    if sig == old or len(sig) != len(old):
        return sig
    return tuple((a[0], tuple(x if x == y else VARIES for x, y in zip(a[1], b[1])), *a[2:])
                 if _numbered_alike(a, b) else a for a, b in zip(sig, old))


def _numbered_alike(a: Any, b: Any) -> bool:
    """Whether signature entries ``a`` and ``b`` are nodes of one type with as many numbers
    that read the same parameters (never ``VARIES``: a step whose layers change reads others)."""
    return a != "view" and b != "view" and a[0] == b[0] and len(a[1]) == len(b[1]) and a[2:] == b[2:]


def said(sig: tuple, at: int, names: Mapping[int, str]) -> str:
    """Node ``at`` of signature ``sig`` in words, each parameter it read by its ``names``."""
    if at >= len(sig):
        return "nothing"
    node = sig[at]
    if node == "view":
        return "a view"
    read = f" reading {', '.join(names.get(i, 'a parameter') for i in node[2])}" if len(node) > 2 else ""
    return f"{node[0]}{list(node[1]) if node[1] else ''}{read}"


def node_of(t: torch.Tensor) -> str:
    """The type of the autograd node that made ``t``'s bytes: "view" for a view (its bytes are
    its base's, and which view node makes it depends on the dispatch: ``reshape`` gives
    ``ReshapeAliasBackward0`` without a Python mode and ``ViewBackward0`` under the per-op
    path's), "leaf" for none."""
    if t._is_view():
        return "view"
    fn = t.grad_fn
    return "leaf" if fn is None else type(fn).__name__
