"""The commit point's wait, the same in every step form: before ``optimizer.step()`` changes
anything, every transfer of the step's slots in flight completes, and a failed one raises
naming its variable, while the step can still be rolled back (``ooc/runtime/rollback.py``).
One wait for all of them: on a GPU, one host synchronization."""

from __future__ import annotations

from collections.abc import Iterable

from ooc.runtime.slots import Slot, State
from ooc.runtime.step_protocol import Timeline, waited
from ooc.storage.tier import SlowerTier


def wait_for_transfers(on: Timeline, slots: Iterable[Slot], tier: SlowerTier, drain: bool = True) -> None:
    """Every transfer in flight among ``slots`` completes (the wait is ``on``'s stall); the
    first that failed raises. ``drain=False``: no wait, only those already failed raise."""
    busy = in_flight(slots)
    if busy and drain:
        waited(on, "commit point", tier.drain)
    raise_failed(busy)


def in_flight(slots: Iterable[Slot]) -> list[Slot]:
    """The slots with a transfer issued and not yet waited for."""
    return [s for s in slots if s.future is not None and s.state in (State.IN, State.OUT)]


def raise_failed(slots: Iterable[Slot]) -> None:
    """After a drain: the first failed transfer among ``slots`` raises, naming its variable."""
    for s in slots:
        if failed(s):
            (s.finish_swap_in if s.state is State.IN else s.finish_swap_out)()


def failed(slot: Slot) -> bool:
    """The slot's transfer has finished and failed (its ``finish_*`` would raise)."""
    return slot.future is not None and slot.future.done() and slot.future.exception() is not None
