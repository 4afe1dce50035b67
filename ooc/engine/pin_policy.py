"""``OutOfCore(pin=...)``: the user's say, per op, in how the outputs it saves leave the device.

torch.utils.checkpoint's selective checkpointing asks a policy per op (``CheckpointPolicy``:
MUST_SAVE, PREFER_SAVE, PREFER_RECOMPUTE, MUST_RECOMPUTE); ooc has one more way out, the
swap, so the pins are ``scheduler.pins.PINS``: "keep", "offload", "prefer_recompute",
"must_recompute". ``pin`` is a mapping from ops to pins, or a function of the op returning
a pin or None; ops are ``torch.ops.aten.x.overload``, ``torch.ops.aten.x`` (every overload)
or their names (``"aten.convolution"``), and ``CheckpointPolicy`` values stand for the pins
they mean (PREFER_SAVE: no pin, the planner decides). A pin applies to the activations the op
writes first (its outputs that autograd saves and the engine manages).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from ooc.errors import OOCError
from scheduler.ir import Kind, VariableSequence
from scheduler.pins import PINS

__all__ = ["PinFn", "pin_function", "pins_of"]

PinFn = Callable[[str], "str | None"]


@functools.lru_cache(maxsize=1)
def _checkpoint_policies() -> dict[Any, str | None]:
    try:
        from torch.utils.checkpoint import CheckpointPolicy
    except ImportError:   # older PyTorch: the names only
        return {}
    return {CheckpointPolicy.MUST_SAVE: "keep", CheckpointPolicy.PREFER_SAVE: None,
            CheckpointPolicy.PREFER_RECOMPUTE: "prefer_recompute",
            CheckpointPolicy.MUST_RECOMPUTE: "must_recompute"}


def _as_pin(value: Any, where: str) -> str | None:
    policies = _checkpoint_policies()
    if value is None:
        return None
    if not isinstance(value, str) and value in policies:
        return policies[value]
    if value in PINS:
        return value
    raise OOCError(f"pin: {where} gave {value!r}; expected one of {', '.join(PINS)}, None, or a "
                   "torch.utils.checkpoint.CheckpointPolicy")


def _op_name(op: Any) -> str:
    """``"aten.convolution.default"`` for an overload, ``"aten.convolution"`` for a packet."""
    if isinstance(op, str):
        return op[len("torch.ops."):] if op.startswith("torch.ops.") else op
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    raise OOCError(f"pin: {op!r} is not an op (use torch.ops.aten.x, torch.ops.aten.x.overload or its name)")


def _overload(name: str) -> Any:
    """The OpOverload a recorded function name stands for (None if not an aten/prims op)."""
    obj: Any = torch.ops
    try:
        for part in name.split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


def pin_function(pin: Mapping[Any, Any] | Callable[[Any], Any] | None) -> PinFn | None:
    """Check ``pin`` now (a wrong pin fails at construction, not at the first plan) and turn
    it into a function of a recorded op name."""
    if pin is None:
        return None
    if isinstance(pin, Mapping):
        table = {_op_name(op): _as_pin(value, f"the entry for {op}") for op, value in pin.items()}

        def by_table(name: str) -> str | None:
            if name in table:
                return table[name]
            return table.get(name.rsplit(".", 1)[0])   # the packet: every overload

        return by_table
    if callable(pin):
        @functools.lru_cache(maxsize=None)
        def by_call(name: str) -> str | None:
            op = _overload(name)
            return None if op is None else _as_pin(pin(op), f"pin({name})")

        return by_call
    raise OOCError(f"pin must be a mapping from ops to pins or a function of the op, got {type(pin).__name__}")


def pins_of(seq: VariableSequence, fn: PinFn) -> dict[int, str]:
    """The pin of each managed activation of ``seq``: its producer's (the first function
    that writes it)."""
    out: dict[int, str] = {}
    for v, var in seq.variables.items():
        if var.kind is not Kind.ACTIVATION:
            continue
        writers = seq.writers[v]
        if not writers:
            continue
        pin = fn(seq.functions[writers[0]].name)
        if pin is not None:
            out[v] = pin
    return out
