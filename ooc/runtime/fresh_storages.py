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

from ooc.record.managed import Birth, Recording
from ooc.runtime.overflow import Unbudgeted
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import StepBook
from ooc.runtime.step_context import StepContext
from scheduler.ir import Kind


def storage_users(s: torch.UntypedStorage) -> int | None:
    """How many references hold ``s``'s bytes (tensors and the one of the Python storage);
    None when this PyTorch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(s._cdata) if count is not None else None


def _use_count(s: torch.UntypedStorage) -> int:
    """``storage_users``, or 2 when this PyTorch cannot say, which errs towards keeping the bytes."""
    users = storage_users(s)
    return 2 if users is None else users


RECENT = 8   # adopted storages an op of the update looks at (``FreshStorages.let_go``)


class FreshStorages:
    """The optimizer's new storages of a step on demand. Its state: ``fresh``, the new
    storages not managed yet (counted in the step's resident bytes); ``adopted``, those
    written out to make room (see ``hand_back``). The on-demand room decides when they count
    and which leave (``OnDemandRoom.track_fresh``, ``evict``)."""

    def __init__(self, ctx: StepContext, book: StepBook, rec: Recording) -> None:
        self.ctx, self.book, self.rec = ctx, book, rec
        self.fresh: dict[Birth, None] = {}
        self.adopted: list[Slot] = []
        self._kept = 0   # adopted[:_kept] outlived an update's end (``let_go``)

    def tracking(self, planned: bool, updating: bool) -> bool:
        """Whether new storages count as managed from birth: on demand, during the optimizer
        step, with its state managed. The optimizer creates its state there (Adam all of it
        before its first update; SGD's momentum buffers join ``optimizer.state`` only when
        ``step()`` returns), and it is managed memory the budget must hold from the start.
        Inside ``step()`` only: with the update in the backward (one ``step()`` per gradient,
        from a post-accumulate-grad hook), what the backward makes between two updates is
        not the optimizer's."""
        return not planned and updating and "optimizer_state" in self.ctx.manage

    def add(self, b: Birth) -> None:
        """Count a storage the optimizer just created (room was made for it)."""
        self.fresh[b] = None
        self.book.account(b.nbytes)

    def died(self) -> list[Birth]:
        """Forget the optimizer's new storages that died (its temporaries): bytes given back."""
        dead = [b for b in self.fresh if b.ref.expired()]
        for b in dead:
            del self.fresh[b]
            self.book.account(-b.nbytes)
        return dead

    def adopt(self, b: Birth) -> Slot | None:
        """A storage the optimizer created, to be written out to make room: it becomes a
        managed variable now (``_live_out`` names it as the state it turns out to be,
        ``hand_back`` returns it if it is not state but something still holds it). None if it
        just died (its bytes given back)."""
        del self.fresh[b]
        s = torch.UntypedStorage._new_with_weak_ptr(b.ref.cdata)   # None if it just died
        if s is None:
            self.book.account(-b.nbytes)
            return None
        var = self.ctx.new_var()
        name = f"{self.rec.names[b.op]}#{b.op}"
        self.rec.promote(b, var, Kind.OPTIMIZER_STATE, name)
        slot = Slot(var, Kind.OPTIMIZER_STATE, b.nbytes, name, in_place=True,
                    state=State.RESIDENT, storage=s)
        self.book.register(slot)
        self.adopted.append(slot)
        return slot

    def let_go(self, *, ended: bool = True) -> None:
        """Forget what the update adopted that the program let go of (only the slot holds the
        storage: a temporary of the update, ``denom``'s square root, written out to make room),
        its copy on the tier and its bytes, at each of the update's ops and at its end
        (``ended``: what is kept then outlived it). Its storage dies when the program lets go
        of it, as it would without ooc, not at the update's or the step's end: until then the
        step's recording counted it as held by the program, beside every gradient that
        followed (an update inside the backward: each parameter's temporaries piled up; Adam's
        first update of four 16 MiB weights: the eight denominators at its last op, and a
        least step budget of 330 MiB named where 202 MiB holds), and the least step budget it
        named depended on how much the step had evicted. At an op, only the ``RECENT`` last
        adopted are looked at (a Python name lets go of a temporary at the next parameter's;
        the state, adopted too, never goes, and every op asking each of a large model's state
        tensors would cost its number squared); the update's end looks at all."""
        first = self._kept if ended else max(self._kept, len(self.adopted) - RECENT)
        kept = []
        for slot in self.adopted[first:]:
            if (slot.storage is not None and slot.state in (State.RESIDENT, State.HOST)
                    and _use_count(slot.storage) == 1):
                if slot.state is State.RESIDENT:
                    self.book.account(-slot.nbytes)
                slot.forget(self.ctx.tier)
            else:
                kept.append(slot)
        self.adopted[first:] = kept
        if ended:
            self._kept = len(self.adopted)

    def rename(self, slot: Slot, name: str) -> None:
        """Give a variable adopted before it had a name (``adopt``) its real one."""
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
                self.ctx.counters["bytes_in"] += slot.bring_back(self.ctx.tier, Unbudgeted(self.ctx.device))
