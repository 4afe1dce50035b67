"""Pins: the user's say, per tensor, in how the window planner lets it leave the device.

In the spirit of ``torch.utils.checkpoint.CheckpointPolicy`` (selective activation
checkpointing), with ooc's third way out, the swap:

- ``"keep"`` (MUST_SAVE): never evicted; a budget that cannot be met without evicting it
  fails with ``BudgetTooSmall``;
- ``"offload"``: when the budget forces it out, swapped, never recomputed;
- ``"prefer_recompute"`` (PREFER_RECOMPUTE): when the budget forces it out, recomputed if it
  has a replayable chain, whatever the price;
- ``"must_recompute"`` (MUST_RECOMPUTE): discarded after every use whose next use is not the
  next function, and recomputed before that use, even when the budget would keep it (the
  memory of checkpointing, at the price of the chain), if it has a replayable chain.

A tensor without a pin is the planner's to decide (``scheduler.recompute``). A plan made
with ``recompute="never"`` swaps only: recompute pins are then ignored, ``keep`` still holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from scheduler.ir import VariableSequence
from scheduler.replay import Chain, chain_for

__all__ = ["PINS", "Pins", "pinned_rule"]

PINS = ("keep", "offload", "prefer_recompute", "must_recompute")


@dataclass(frozen=True)
class Pins:
    """Variables by pin (``Pins.of`` builds it from ``{var: pin}``)."""

    keep: frozenset[int] = frozenset()
    offload: frozenset[int] = frozenset()
    prefer: frozenset[int] = frozenset()
    must: frozenset[int] = frozenset()

    @staticmethod
    def of(seq: VariableSequence, pins: Mapping[int, str] | None) -> Pins:
        """Check ``pins`` against ``seq`` (known variables, known pins) and group them."""
        groups: dict[str, set[int]] = {p: set() for p in PINS}
        for v, pin in (pins or {}).items():
            if pin not in PINS:
                raise ValueError(f"pin {pin!r} of variable {v} is not one of {', '.join(PINS)}")
            if v not in seq.variables:
                raise ValueError(f"pin {pin!r} names variable {v}, which the sequence does not have")
            groups[pin].add(v)
        return Pins(frozenset(groups["keep"]), frozenset(groups["offload"]),
                    frozenset(groups["prefer_recompute"]), frozenset(groups["must_recompute"]))

    def swap_only(self) -> Pins:
        """The pins a swap-only plan follows: ``keep`` (and ``offload``, which it does anyway)."""
        return Pins(keep=self.keep, offload=self.offload)

    def __bool__(self) -> bool:
        return bool(self.keep or self.offload or self.prefer or self.must)


def pinned_rule(seq: VariableSequence, pins: Pins, rule=None):
    """The window planner's swap-or-recompute rule with the pins applied over ``rule``
    (None: swap every unpinned victim)."""

    def choose(v: int, at: int, *absent, **priced) -> Chain | None:
        if v in pins.offload:
            return None
        if v in pins.prefer or v in pins.must:
            return chain_for(seq, v, at)
        return rule(v, at, *absent, **priced) if rule is not None else None

    choose.through = getattr(rule, "through", False)   # type: ignore[attr-defined]
    choose.shared = getattr(rule, "shared", False)     # type: ignore[attr-defined]
    choose.link = getattr(rule, "link", None)          # type: ignore[attr-defined]
    return choose
