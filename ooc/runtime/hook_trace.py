"""What a planned step's saved-tensor hooks saw: where a hook-driven step may act, and what it
must see there to be the same step (``ooc/runtime/anchored_step.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class HookTrace:
    """What a planned per-op step's hooks saw (the hook-driven step's reference): ``packs``,
    (gap, bytes, variable or None) of each saved tensor of at least ``min_bytes``; ``unpacks``,
    (gap, variable) of each managed activation unpacked; ``update``, the gap where the
    optimizer step started (None without one). A gap is the number of ops begun before it.

    ``counted``: for a plan that moves nothing (``from_signature``), the bytes of each pack that
    count in the budget (activations and inputs; parameters do not): no slot stands for them,
    and a step that leaves the plan counts what it kept so far from these. ``bounded``: each
    pack's bytes are the most a save there may have (a plan whose sizes vary,
    ``scheduler/widening.py``: its variable's room), not the bytes it must have, and every
    save is a pack, small ones too."""

    packs: list[tuple[int, int, int | None]] = field(default_factory=list)
    unpacks: list[tuple[int, int]] = field(default_factory=list)
    update: int | None = None
    counted: list[int] = field(default_factory=list)
    bounded: bool = False

    @classmethod
    def from_signature(cls, signature: Sequence[tuple[int, int, bool]], bounded: bool = False) -> HookTrace:
        """The trace of a verified step of a plan that moves nothing, from what it saved:
        (bytes, the op that saved it, whether it counts in the budget) of each saved tensor of
        at least ``min_bytes`` (``Stepper.signature``; ``bounded``: the bytes are the most a
        save there may have). No variable: nothing is bound."""
        return cls(packs=[(op, n, None) for n, op, _ in signature],
                   counted=[n if counts else 0 for n, _, counts in signature], bounded=bounded)

    def gaps(self) -> set[int]:
        """Where a hook-driven step can act."""
        g = {p[0] for p in self.packs} | {u[0] for u in self.unpacks}
        return g if self.update is None else g | {self.update}

    def first_saved(self) -> dict[int, int]:
        """Each variable's first anchor: where the step first sees its storage."""
        first: dict[int, int] = {}
        for gap, _, var in self.packs:
            if var is not None:
                first.setdefault(var, gap)
        return first

    def counted_before(self, k: int) -> int:
        """The budget's bytes of the first ``k`` saves (0 for a trace with variables)."""
        return sum(self.counted[:k])


def loose_view(t: torch.Tensor, min_bytes: int) -> bool:
    """A save that no gradient flows through, a view smaller than ``min_bytes`` itself, however
    large the storage it views: an unmanaged one is left out of the trace as small, the same in
    every step. Why: a decoder fed the targets saves a column of them (a view of their storage,
    9 KiB for 48 sequences of 24 tokens) where, fed its own ``argmax``, it saves a tensor of
    its own (128 B); counted by their storages, the two steps' saves did not line up, and each
    step of the other kind left its anchored plan."""
    return t._is_view() and not t.requires_grad and t.numel() * t.element_size() < min_bytes
