"""What an aten op's schema says about its tensors, worked out once per op and kept.

Every op of every step passes through ``Stepper.on_op``, and most of them touch no managed
tensor: finding that out must cost little. A generic flatten of ``(args, kwargs)`` checks
every stride, padding and flag with ``isinstance`` (a convolution's backward has 11 arguments,
3 of them tensors), and a lookup keyed by the op itself calls ``OpOverload.__hash__`` in
Python. The schema says once and for all which positions may hold a tensor and which ones
the op writes in place; ops are looked up by ``id`` (each ``OpInfo`` keeps its op alive, so
the id cannot be reused by another object).
"""

from __future__ import annotations

from typing import Any

import torch

# Schema argument types (as ``str(argument.type)`` spells them) that never hold a tensor:
# their positions are not scanned. ScalarType, Layout and MemoryFormat read as "int",
# Scalar as "number". Any other type (Tensor, Tensor?[], Tensor[], generic ones) is.
_NO_TENSOR = frozenset({
    "AnyEnumType", "Device", "Generator", "Storage", "bool", "complex", "float", "int", "number", "str",
    "List[bool]", "List[complex]", "List[float]", "List[int]", "List[str]",
    "Optional[Device]", "Optional[Generator]", "Optional[List[float]]", "Optional[List[int]]",
    "Optional[bool]", "Optional[float]", "Optional[int]", "Optional[number]", "Optional[str]",
})


class OpInfo:
    """An op's name (as recorded in the sequence), the positions of its arguments that may
    hold tensors, and the (position, name) of those it writes in place."""

    __slots__ = ("func", "name", "tensor_positions", "writes")

    def __init__(self, func: Any) -> None:
        self.func = func   # keeps the op alive: its id stays its own
        self.name = str(func)
        schema = getattr(func, "_schema", None)
        if schema is None:   # not an OpOverload: scan everything, write nothing
            self.tensor_positions: tuple[int, ...] | None = None
            self.writes: tuple[tuple[int, str], ...] = ()
            return
        arguments = schema.arguments
        self.tensor_positions = tuple(i for i, a in enumerate(arguments) if str(a.type) not in _NO_TENSOR)
        self.writes = tuple((i, a.name) for i, a in enumerate(arguments)
                            if a.alias_info is not None and a.alias_info.is_write)

    def inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors among the op's arguments, in order: positional ones first, then those
        passed by keyword (``out=``), as ``tensors((args, kwargs))`` lists them."""
        out: list[torch.Tensor] = []
        positions = self.tensor_positions
        if positions is None:
            return tensors((args, kwargs))
        n = len(args)
        for i in positions:
            if i >= n:
                break
            a = args[i]
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple, dict)):
                tensors(a, out)
        if kwargs:
            tensors(kwargs, out)
        return out

    def written(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors the op writes in place. Not only a ``Tensor(a!) self`` passed by
        position: an ``out=`` tensor is a keyword-only argument (it arrives in ``kwargs``),
        and the foreach ops (``clip_grad_norm_``'s default) write a ``Tensor(a!)[]`` list. A
        write the stepper does not see leaves the slower tier's stale copy marked current,
        and the write is lost."""
        out: list[torch.Tensor] = []
        for pos, name in self.writes:
            tensors(args[pos] if pos < len(args) else kwargs.get(name), out)
        return out


_OPS: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """The schema facts of ``func``, computed on its first call and kept."""
    info = _OPS.get(id(func))
    if info is None or info.func is not func:
        info = _OPS[id(func)] = OpInfo(func)
    return info


def tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in a nest of lists, tuples and dicts (an op's arguments or results), in
    order: a pytree flatten without pytree's generality, for the per-op path."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors(x, out)
    return out
