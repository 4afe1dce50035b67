"""What a planned step's saved-tensor hooks saw: where an anchored step may act, and what it
must see there to be the same step (``ooc/runtime/anchored_step.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HookTrace:
    """What a planned per-op step's hooks saw (the anchored step's reference): ``packs``,
    (gap, bytes, variable or None) of each saved tensor of at least ``min_bytes``; ``unpacks``,
    (gap, variable) of each managed activation unpacked; ``update``, the gap where the
    optimizer step started (None without one). A gap is the number of ops begun before it."""

    packs: list[tuple[int, int, int | None]] = field(default_factory=list)
    unpacks: list[tuple[int, int]] = field(default_factory=list)
    update: int | None = None

    def gaps(self) -> set[int]:
        """Where an anchored step can act."""
        g = {p[0] for p in self.packs} | {u[0] for u in self.unpacks}
        return g if self.update is None else g | {self.update}

    def first_saved(self) -> dict[int, int]:
        """Each variable's first anchor: where the step first sees its storage."""
        first: dict[int, int] = {}
        for gap, _, var in self.packs:
            if var is not None:
                first.setdefault(var, gap)
        return first
