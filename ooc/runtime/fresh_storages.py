"""On demand: the storages the optimizer creates, counted from birth.

During the optimizer step of a step on demand, with optimizer state managed, every new storage
of the optimizer counts as managed memory: the optimizer creates its state there (Adam all of
it before its first update; SGD's momentum buffers join ``optimizer.state`` only when
``step()`` returns), and the budget must hold it from the start. Those that die are its
temporaries (their bytes go back); those evicted to make room become managed variables, and
those that turn out not to be state are handed back at the step's end.
"""

from __future__ import annotations

import dataclasses

import torch

from ooc.record.managed import Birth
from ooc.runtime.executor import _Unbudgeted
from ooc.runtime.slots import Slot, State
from scheduler.ir import Kind


def _use_count(s: torch.UntypedStorage) -> int:
    """How many references hold ``s``'s bytes (tensors and the one of the Python storage);
    2 when this PyTorch cannot say, which errs towards keeping the bytes."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(s._cdata) if count is not None else 2


class FreshStorages:
    """The ``Stepper``'s tracking of the optimizer's new storages (a mixin). Its state
    (``_init_fresh``): ``fresh``, the new storages not managed yet; ``adopted``, those
    written out to make room (see ``hand_back``)."""

    def _init_fresh(self) -> None:
        self.fresh: dict[Birth, None] = {}
        self.adopted: list[Slot] = []

    def _tracking(self) -> bool:
        """Whether new storages count as managed from birth: on demand, during the optimizer
        step, with its state managed. The optimizer creates its state there (Adam all of it
        before its first update; SGD's momentum buffers join ``optimizer.state`` only when
        ``step()`` returns), and it is managed memory the budget must hold from the start.
        Inside ``step()`` only: with the update in the backward (one ``step()`` per gradient,
        from a post-accumulate-grad hook), what the backward makes between two updates is
        not the optimizer's."""
        return not self.planned and self.updating and "optimizer_state" in self.ctx.manage

    def _track_fresh(self, b: Birth, keep: set, i: int) -> Birth:
        """Count a storage the optimizer just created, after making room for it."""
        self._make_room_for(b.nbytes, keep, i, f"a new tensor of {self.rec.names[i]}")
        self.fresh[b] = None
        self._account(b.nbytes)
        self._touch(b)
        return b

    def _prune_fresh(self) -> None:
        """Forget the optimizer's new storages that died (its temporaries): bytes given back."""
        for b in [b for b in self.fresh if b.ref.expired()]:
            del self.fresh[b]
            self.recent.pop(b, None)
            self._account(-b.nbytes)

    def _evict_fresh(self, b: Birth) -> None:
        """Write out a storage the optimizer created: it becomes a managed variable now
        (``_live_out`` names it as the state it turns out to be, ``hand_back`` returns it
        if it is not state but something still holds it)."""
        del self.fresh[b]
        s = torch.UntypedStorage._new_with_weak_ptr(b.ref.cdata)   # None if it just died
        if s is None:
            self._account(-b.nbytes)
            return
        var = self.ctx.new_var()
        name = f"{self.rec.names[b.op]}#{b.op}"
        self.rec.promote(b, var, Kind.OPTIMIZER_STATE, name)
        slot = Slot(var, Kind.OPTIMIZER_STATE, b.nbytes, name, in_place=True,
                    state=State.RESIDENT, storage=s)
        self._register(slot)
        self.adopted.append(slot)
        self._evict(slot)

    def rename(self, slot: Slot, name: str) -> None:
        """Give a variable adopted before it had a name (``_evict_fresh``) its real one."""
        slot.name = name
        v = self.rec.variables.get(slot.var)
        if v is not None:
            self.rec.variables[slot.var] = dataclasses.replace(v, name=name)

    def hand_back(self, live: dict[int, Slot]) -> None:
        """At the end of the step: bring back the optimizer's new storages that were written
        out to make room but are not managed after the step (not its state), if anything
        still holds them. The engine must not keep bytes nobody will ask it for."""
        for slot in self.adopted:
            if slot.var in live or slot.state is not State.HOST or slot.storage is None:
                continue
            if _use_count(slot.storage) > 1:   # more than the slot holds it
                self.ctx.counters["bytes_in"] += slot.bring_back(self.ctx.tier, _Unbudgeted(self.ctx.device))
