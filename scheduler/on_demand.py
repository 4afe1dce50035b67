"""The decisions of a step that runs without a plan: the recording step, and a step that left
its plan (a new batch shape, a branch the recording did not take).

Such a step cannot look ahead: it knows the tensors it has met so far, the order in which
ops last used them, and their sizes. The rules below choose from exactly that, and the
runtime carries them out (``ooc/runtime`` moves bytes and waits; it never chooses what to
move). A plan replaces them from the next step on.

1. **Victims** (``choose_victims``): when an op needs ``n`` more bytes than the budget leaves,
   evict the least recently used tensors the op does not use, until ``n`` fit. LRU is the
   on-demand policy of the seed paper's baseline and of every OS pager: without a future,
   the past is the best guess of what comes back last. Reads between steps of managed
   tensors over the budget (``ooc/engine/between_steps.py``) follow the same rule.
2. **Writes in flight** (``in_flight_limit``): evicted tensors are written out
   asynchronously, but their device bytes stay taken until the write completes. At most half
   the budget may be in flight, so that the other half always holds the op's own tensors.
3. **Persistent tensors before a step** (``persistent_to_evict``): the whole model is
   resident before the first step; what exceeds the budget goes to the slower tier, the
   last registered first, because a forward pass uses parameters roughly in registration
   order, so the last ones are needed last.
4. **Leaving a plan** (``to_write_out_on_leaving``): a step that leaves its plan keeps, from
   then on, only what it needs, as the recording step does: the saved activations it holds
   with no current copy on the slower tier are written out at once, except those the running
   backward node holds (autograd reads them until it returns). Persistent tensors stay: they
   leave after the next op that uses them, as on demand does for every op.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)

IN_FLIGHT_SHARE = 2   # at most budget // IN_FLIGHT_SHARE bytes of on-demand writes in flight


def choose_victims(recent: Iterable[T], excess: int, evictable: Callable[[T], int],
                   keep: Callable[[T], bool]) -> list[T]:
    """The tensors to evict, least recently used first, until ``excess`` bytes are freed.

    ``recent``: every tensor the step has met, least recently used first (entries already
    gone free 0 bytes and are chosen too, which drops them from the runtime's order);
    ``evictable(x)``: the bytes evicting ``x`` gives back; ``keep(x)``: ``x`` must stay (the
    op uses it, or the running backward node holds it). Fewer bytes than ``excess`` if that is
    all there is: the caller reports the shortfall."""
    victims: list[T] = []
    for x in recent:
        if excess <= 0:
            break
        if keep(x):
            continue
        victims.append(x)
        excess -= evictable(x)
    return victims


def in_flight_limit(budget: int) -> int:
    """The most bytes of on-demand writes that may be in flight at once (rule 2)."""
    return budget // IN_FLIGHT_SHARE


def persistent_to_evict(resident: Sequence[tuple[T, int]], budget: int) -> list[T]:
    """Of the resident persistent tensors (``(tensor, bytes)`` in registration order), those
    to move to the slower tier before a step on demand so that the rest fits ``budget``
    (rule 3): the last registered first."""
    excess = sum(n for _, n in resident) - budget
    out: list[T] = []
    for x, n in reversed(resident):
        if excess <= 0:
            break
        out.append(x)
        excess -= n
    return out


def to_write_out_on_leaving(tensors: Iterable[tuple[T, bool, bool, bool]]) -> list[T]:
    """Rule 4: of the tensors a step manages when it leaves its plan, as ``(tensor, saved,
    resident_only, held)`` (a saved activation, not a persistent tensor; resident with no
    current copy on the slower tier; held by the running backward node), those to write out
    now, in the order given."""
    return [x for x, saved, resident_only, held in tensors if saved and resident_only and not held]
