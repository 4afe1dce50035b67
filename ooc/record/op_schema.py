"""What an aten op's schema says about its tensors, worked out once per op and kept.

Both recorders' rules (``ooc.record.recorder``: which arguments a use reads and writes, which
ops are views) and the runtime's per-op path read these facts; they are computed here once.

Every op of every step passes through ``Stepper.on_op``, and most of them touch no managed
tensor: finding that out must cost little. A generic flatten of ``(args, kwargs)`` checks
every stride, padding and flag with ``isinstance`` (a convolution's backward has 11 arguments,
3 of them tensors), and a lookup keyed by the op itself calls ``OpOverload.__hash__`` in
Python. The schema says once and for all which positions may hold a tensor and which ones
the op writes in place; ops are looked up by ``id`` (each ``OpInfo`` keeps its op alive, so
the id cannot be reused by another object).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ooc.record.replay import replay_rule
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
    hold tensors, the (position, name) of those it writes in place, and, for a foreach op that
    can run one list entry at a time, the (position, name) of its lists (else None).

    For the recorder: ``skip`` (a ``profiler.*`` marker, not recorded), ``view`` (every result
    aliases an argument and nothing is written: ``view``, ``t``, ``detach``; it allocates
    nothing and touches no data) and ``flop`` (``torch.utils.flop_counter``'s formula, or
    None). For recomputation: ``replay``, whether a call may be replayed
    (``ooc.record.replay``'s rules)."""

    __slots__ = ("flop", "func", "lists", "name", "replay", "skip", "tensor_positions", "view",
                 "writes")

    def __init__(self, func: Any) -> None:
        self.func = func   # keeps the op alive: its id stays its own
        self.name = str(func)
        # Not recorded: the optimizers' ``record_function`` markers (``profiler.*``), and
        # ``lift_fresh``, with which ``torch.tensor(data)`` marks its new tensor on a real
        # device but not on meta (made there by an op no dispatch mode sees); it is an alias,
        # with no uses either way, and recording it would make the two recordings differ.
        self.skip = getattr(func, "namespace", "") == "profiler" or self.name.startswith("aten.lift_fresh.")
        self.view = False
        self.flop = _flop_formula(func)
        schema = getattr(func, "_schema", None)
        if schema is None:   # not an OpOverload: scan everything, write nothing
            self.tensor_positions: tuple[int, ...] | None = None
            self.writes: tuple[tuple[int, str], ...] = ()
            self.lists: tuple[tuple[int, str], ...] | None = None
            self.replay = replay_rule(func, False, ())
            return
        arguments = schema.arguments
        self.tensor_positions = tuple(i for i, a in enumerate(arguments) if str(a.type) not in _NO_TENSOR)
        self.writes = tuple((i, a.name) for i, a in enumerate(arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
        self.lists = _list_args(schema)
        returns = schema.returns
        self.view = (not self.writes and bool(returns)
                     and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))
        self.replay = replay_rule(func, self.view, self.writes)

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


def _list_args(schema: Any) -> tuple[tuple[int, str], ...] | None:
    """(position, name) of a foreach op's list arguments, or None if it is not one that can run
    one list entry at a time: a ``_foreach_*`` op (or GradScaler's unscale) that returns
    nothing or one list."""
    name = schema.name.split("::")[-1]
    if not (name.startswith("_foreach_") or name == "_amp_foreach_non_finite_check_and_unscale_"):
        return None
    if [str(r.type) for r in schema.returns] not in ([], ["List[Tensor]"]):
        return None
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if str(a.type).startswith("List[")) or None


def split_foreach(info: OpInfo, args: tuple, kwargs: dict,
                  managed: Callable[[torch.Tensor], Any]) -> list[tuple[tuple, dict]] | None:
    """A foreach op over managed tensors, as one call per list entry; None to run it whole.

    A foreach op needs every tensor of its lists at once: ``GradScaler.unscale_`` and
    ``clip_grad_norm_`` take all gradients, so with grads managed they needed the whole
    model's gradients resident, more than the budget whenever managing them mattered. Entry
    by entry, one gradient at a time is resident, and the arithmetic is the same: a foreach
    op computes each entry on its own (on the CPU it loops over them; CUDA's multi-tensor
    kernels also reduce each tensor apart, which ``test_amp.py``'s GPU test checks bitwise).
    Only when every other tensor argument is a scalar (0-dim: ``found_inf``, ``inv_scale``, a
    clip coefficient); a tensor of per-entry scalars stays whole. ``managed(t)`` is not None
    for a tensor the engine manages."""
    if info.lists is None:
        return None
    lists, n = [], None
    for pos, name in info.lists:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if value is None:
            continue
        if n is None:
            n = len(value)
        if len(value) != n:
            return None
        lists.append((pos, name))
    if n is None or n < 2:
        return None
    listed = {id(x) for pos, name in lists for x in (args[pos] if pos < len(args) else kwargs[name])}
    others = [t for t in tensors((args, kwargs)) if id(t) not in listed]
    if any(t.dim() != 0 for t in others):
        return None
    if not any(managed(t) is not None for pos, name in lists
               for t in (args[pos] if pos < len(args) else kwargs[name]) if isinstance(t, torch.Tensor)):
        return None
    pieces = []
    for i in range(n):
        a, k = list(args), dict(kwargs)
        for pos, name in lists:
            if pos < len(a):
                a[pos] = a[pos][i:i + 1]
            else:
                k[name] = k[name][i:i + 1]
        pieces.append((tuple(a), k))
    return pieces


_FLOPS: dict[Any, Callable[..., Any]] | None = None


def _flop_formula(func: Any) -> Callable[..., Any] | None:
    """``torch.utils.flop_counter``'s formula for ``func``'s overload packet, if it has one
    (imported on the first op, not with the runtime)."""
    global _FLOPS
    if _FLOPS is None:
        try:
            from torch.utils.flop_counter import flop_registry
            _FLOPS = dict(flop_registry)
        except ImportError:  # pragma: no cover - very old torch
            _FLOPS = {}
    packet = getattr(func, "_overloadpacket", None)
    return _FLOPS.get(packet) if packet is not None else None


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
