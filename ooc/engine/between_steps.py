"""Reads and writes between steps of managed tensors the budget keeps on the slower tier.

Managed parameters, gradients and optimizer state that exceed the budget together end a step
partly on the tier: their storages have 0 bytes under tensors that keep their shapes, and a
read there was a segfault or garbage (issue 40). ``BetweenSteps`` watches every managed
persistent tensor from such a step's end to the next step's start (``ooc/runtime/watched.py``:
any use from Python brings the bytes back first) and keeps what it brings back within the
budget, as a step on demand does (``scheduler.on_demand.choose_victims``: the least recently
used go back to the tier first). A tensor is never released while something else may read
it from C++: an op is using it, autograd saved it or adds into it (pinned until the next
step), or another tensor shares its storage (a view the user took, ``p.data``, a
``state_dict`` entry). Those stay, over the budget if they must: counted in ``stats()``
(``between_steps.*``) and warned of once. Writes land in the bytes brought back; the next step
or an eviction writes them out again (``PersistentTensors._note_writes_between``).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ooc.errors import OOCError
from ooc.runtime import watched
from ooc.runtime.slots import Slot, State
from scheduler.on_demand import choose_victims
from vmm.units import format_size

log = logging.getLogger(__name__)

STAT_KEYS = ("bytes_in", "bytes_out", "peak_resident_bytes")


class BetweenSteps:
    """The engine's managed persistent tensors between two steps (an ``ooc.runtime.watched``
    owner). Its state: ``_tensors``, var -> the tensors watched for it (weakly); ``_recent``,
    the vars resident now, least recently used first; ``_held``, vars an op uses now;
    ``_pinned``, vars autograd may read later; ``_resident``, the bytes resident; ``_refs``,
    Python references to each storage object when watching began; and its counters."""

    def __init__(self, store: Any) -> None:   # a PersistentStore (it imports this module)
        self._store = weakref.ref(store)
        self._tensors: dict[int, list[weakref.ref]] = {}
        self._names: dict[int, str] = {}
        self._recent: dict[int, None] = {}
        self._held: Counter[int] = Counter()
        self._pinned: set[int] = set()
        self._resident = 0
        self._refs: dict[int, int] = {}
        self._warned = False
        self.counts: Counter[str] = Counter()

    def stats(self) -> dict[str, int]:
        """``between_steps.bytes_in``/``bytes_out``: what reads between steps brought back and
        what made room for them wrote out (totals); ``peak_resident_bytes``: the most managed
        persistent bytes resident at once between steps (over the budget only where one op's
        tensors, or tensors held elsewhere, needed more)."""
        return {f"between_steps.{k}": self.counts[k] for k in STAT_KEYS}

    def watch(self, slots: dict[int, Slot], tensors: dict[int, list[torch.Tensor]],
              read_back: Callable[[Slot], None]) -> None:
        """A step ended with some of ``slots`` on the tier: watch every tensor that holds one
        (``tensors``, var -> tensors). One on the tier that a tensor not watched can read gets
        its bytes back now (``read_back``): a tensor that shares its storage (a ``state_dict()``
        entry or a ``p.detach()`` kept across the step), or one whose class has a
        ``__torch_function__`` of its own."""
        self.unwatch()
        for var, ts in tensors.items():
            slot = slots.get(var)
            if slot is None:
                continue
            can = all(watched.watchable(t) for t in ts)
            if can:
                for t in ts:
                    watched.watch(t, self, var)
                self._tensors[var] = [weakref.ref(t) for t in ts]
                self._names[var] = slot.name
                self._refs[var] = sys.getrefcount(slot.storage)
            if slot.state is State.HOST and (not can or _shared(slot, len(ts))):
                read_back(slot)
        self._recent = {v: None for v, s in slots.items() if s.state is State.RESIDENT}
        self._resident = sum(s.nbytes for s in slots.values() if s.state is State.RESIDENT)
        self._peak()

    def unwatch(self) -> dict[int, list[torch.Tensor]]:
        """Give every watched tensor its plain class back (a step starts, or everything came
        back). Returns var -> the watched tensors still alive."""
        alive = {}
        for var, refs in self._tensors.items():
            ts = [t for t in (r() for r in refs) if t is not None]
            for t in ts:
                watched.unwatch(t)
            alive[var] = ts
        self._tensors.clear()
        self._recent.clear()
        self._held.clear()
        self._pinned.clear()
        self._refs.clear()
        return alive

    def enter(self, keys: list[Hashable], /) -> None:
        """An op is about to use the tensors of ``keys`` (vars): bring those on the tier back,
        after making room among the resident ones it does not use, and hold them. The bytes
        move outside any dispatch mode: the op may run inside another engine's step."""
        store = self._store()
        if store is None or store.closed:
            self._without_engine(keys)
            return
        for var in keys:
            if var not in store.slots:
                raise OOCError(f"{self._names.get(var, 'a managed tensor')} was on the tier, but "
                               "the optimizer's state was replaced since: its bytes are gone")
        slots = [store.slots[v] for v in keys]
        need = [s for s in slots if s.state is State.HOST]
        if need:
            with _disable_current_modes():
                fits = self._make_room(store, sum(s.nbytes for s in need), set(keys))
                for slot in need:
                    store.read_back(slot)
                    self._resident += slot.nbytes
                    self.counts["bytes_in"] += slot.nbytes
            self._peak()
            if not fits and not self._warned:
                self._warned = True
                log.warning("a read between steps holds %s of managed tensors, over the %s budget: "
                            "the tensors one op uses, and those autograd saved or other tensors "
                            "share, stay (stats()['between_steps.peak_resident_bytes']); under "
                            "torch.no_grad() and without views kept, reads stay within it",
                            format_size(self._resident), format_size(store.budget))
        self._held.update(keys)
        for var in keys:
            self._recent.pop(var, None)
            self._recent[var] = None

    def _without_engine(self, keys: list[Hashable]) -> None:
        """The engine was collected without ``close()`` (or closed while this watched on): a
        tensor whose bytes are in memory becomes plain; one on the tier lost them with it."""
        for var in keys:
            tensors = self._alive(var)
            with torch._C.DisableTorchFunctionSubclass():
                gone = [t for t in tensors if t.untyped_storage().nbytes() < t.nbytes]
            if gone:
                raise OOCError(
                    f"{self._names.get(var, 'a managed tensor')} was on the tier of an engine that "
                    "was collected without close(): its bytes went with it. Close the engine before "
                    "letting go of it (close() brings everything back)")
            for t in tensors:
                watched.unwatch(t)

    def leave(self, keys: list[Hashable], pinned: set[Hashable], /) -> None:
        self._held.subtract(keys)
        self._held = +self._held   # drop the zeros
        self._pinned |= pinned

    def _make_room(self, store: Any, need: int, keep: set[int]) -> bool:
        """Release least recently used resident tensors but ``keep`` until ``need`` more bytes
        fit the budget; False if they do not (none is left that may go)."""
        persistent = store.slots
        excess = self._resident + need - store.budget
        if excess <= 0:
            return True
        for var in choose_victims(list(self._recent), excess, lambda v: persistent[v].nbytes,
                                  lambda v: v in keep or not self._may_release(persistent.get(v))):
            slot = persistent[var]
            self.counts["bytes_out"] += store.release_between(slot, self._alive(var))
            self._resident -= slot.nbytes
            excess -= slot.nbytes
            del self._recent[var]
        return excess <= 0

    def _may_release(self, slot: Slot | None) -> bool:
        """Whether nothing but its watched tensors can read ``slot``'s bytes: no op uses it
        now, autograd did not save it, no other tensor shares its storage, and no more Python
        references to its storage object than at the step's end (``torch.save`` keeps the
        storages it writes after pickling, the slot's own object)."""
        if slot is None or slot.state is not State.RESIDENT or slot.storage is None:
            return False
        if self._held[slot.var] or slot.var in self._pinned or slot.var not in self._tensors:
            return False
        return not _shared(slot, len(self._alive(slot.var))) and sys.getrefcount(slot.storage) <= self._refs[slot.var]

    def _alive(self, var: int) -> list[torch.Tensor]:
        return [t for t in (r() for r in self._tensors.get(var, ())) if t is not None]

    def _peak(self) -> None:
        self.counts["peak_resident_bytes"] = max(self.counts["peak_resident_bytes"], self._resident)


def _shared(slot: Slot, tensors: int) -> bool:
    """Whether more than ``slot``'s own storage object and its ``tensors`` known tensors hold
    its storage (each holds one reference; the engine holds no other between steps)."""
    return torch._C._storage_Use_Count(slot.storage._cdata) > 1 + tensors


def resizable_copy(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """A persistent storage exported between steps (``p.detach().numpy()``, DLPack) is no
    longer resizable: PyTorch refuses to free bytes the export may read, and the next step's
    release raised. ``tensors`` (those that hold it) move to a resizable copy, returned; the
    export keeps the old bytes (it does not see later updates, as in core it would)."""
    copy = storage.clone()
    with torch.no_grad():
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                copy, t.storage_offset(), t.size(), t.stride())
    return copy
