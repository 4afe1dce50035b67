"""One managed storage at run time, and the byte moves that swap it.

Two kinds of slot, because PyTorch holds them differently:

- *Saved activations* are held only through autograd's saved-tensor hooks: the engine owns
  the one reference that matters. Swapping out writes the bytes and drops that reference
  (the memory goes back the moment the forward no longer holds the tensor); swapping in
  reads into a fresh pool range, and unpack rebuilds each saved view on it. The original
  storage is never modified, so a swap can never corrupt what the forward still uses.
- *Persistent tensors* (parameters, gradients, optimizer state) are held by the model and
  the optimizer, and views of them sit in the autograd graph. They keep their storage
  object: swapping out writes the bytes and resizes the storage to 0 bytes in place,
  swapping in resizes it back and reads into it (what FSDP does). Every view follows.
  PyTorch does not check a 0-byte storage under a real shape (a kernel reads out of bounds),
  so between steps such tensors are watched (``ooc/runtime/watched.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from ooc.errors import OOCError, StorageError
from ooc.runtime.byte_views import byte_view_for
from ooc.runtime.pool import RangeSource
from ooc.storage.tier import SlowerTier, Transfer
from scheduler.actions import Effect, Residency
from scheduler.ir import Kind
from vmm.units import format_size


class State(enum.Enum):
    """A slot's residency: the states of ``scheduler.actions.Residency`` (the transition
    table every plan action follows), with one ABSENT for "not created yet" and "freed"."""

    ABSENT = "absent"      # not created yet in this step, or freed
    RESIDENT = "resident"  # bytes on the device, usable
    IN = "in"              # swap-in in flight: memory taken, not usable yet
    OUT = "out"            # swap-out in flight: memory still taken, not usable
    HOST = "host"          # only the slower tier holds the bytes
    DISCARDED = "discarded"  # nowhere: its chain re-creates it (ooc/runtime/recompute.py)

    @property
    def residency(self) -> Residency:
        """This state in the transition table's words."""
        return _RESIDENCY[self]

    @staticmethod
    def of(residency: Residency) -> "State":
        """The slot state for a state of the transition table."""
        return _STATE[residency]


_RESIDENCY = {State.ABSENT: Residency.ABSENT, State.RESIDENT: Residency.RESIDENT, State.IN: Residency.IN,
              State.OUT: Residency.OUT, State.HOST: Residency.HOST, State.DISCARDED: Residency.DISCARDED}
_STATE = {**{r: s for s, r in _RESIDENCY.items()}, Residency.DEAD: State.ABSENT}


@dataclass(eq=False)
class Slot:
    """A managed variable: its plan id, bytes, where its bytes are, and its storage."""

    var: int
    kind: Kind
    nbytes: int
    name: str
    in_place: bool                             # held by model/optimizer: resize in place
    state: State = State.ABSENT
    storage: torch.UntypedStorage | None = None
    host_current: bool = False                 # the slower tier holds the current bytes
    future: Transfer | None = None
    pending: list = field(default_factory=list)  # keeps sources/destinations alive during I/O

    @property
    def key(self) -> int:
        return id(self)

    def usable(self) -> bool:
        return self.state is State.RESIDENT

    def given_back(self) -> bool:
        """The plan freed this tensor's bytes (it died in the recorded step) but the tensor
        lives on: a gradient read after ``optimizer.step()``, or kept past the step, where
        the recorded step had set it to None. Its storage is empty; no copy exists."""
        return (self.state is State.ABSENT and self.in_place and self.storage is not None
                and self.nbytes > 0 and self.storage.nbytes() == 0)


def given_back_error(slot: Slot, where: str) -> OOCError:
    """What reading a tensor whose bytes the plan gave back raises (never a read of freed
    memory: a segfault or garbage)."""
    return OOCError(
        f"{where} reads {slot.name} ({format_size(slot.nbytes)}, {slot.nbytes} B), whose bytes the plan "
        f"gave back after its last use in the step it was recorded from (nothing read it later "
        f"there). Read gradients before optimizer.step() (clip_grad_norm_ returns the norm), do the "
        f"same reads in every step, or leave 'grads' out of manage")


def start_swap_out(slot: Slot, tier: SlowerTier) -> None:
    """Begin writing the slot's bytes to the tier; the storage stays until ``finish_swap_out``."""
    view = byte_view_for(slot.storage)
    slot.pending = [slot.storage, view]
    slot.future = tier.write_async(slot.key, view, slot.nbytes)
    slot.state = State.OUT


def finish_swap_out(slot: Slot) -> None:
    """Wait for the write, then give the device bytes back.

    On a GPU the wait is the compute stream's, not the host's: every kernel queued after it
    (the only work that may reuse the bytes released here) runs after the copy."""
    _result(slot, "out")
    slot.future = None
    slot.pending = []
    slot.host_current = True
    release(slot)
    slot.state = State.HOST


def release(slot: Slot) -> None:
    """Give the device bytes back (the caller knows the slower tier or nobody needs them)."""
    if slot.in_place and slot.storage is not None:
        slot.storage.resize_(0)
    else:
        slot.storage = None


def start_swap_in(slot: Slot, tier: SlowerTier, pool: RangeSource) -> None:
    """Take device memory and begin reading the slot's bytes back into it."""
    if slot.in_place:
        slot.storage.resize_(slot.nbytes)
        dest = slot.storage
    else:
        dest = pool.take(slot.nbytes).untyped_storage()
    view = byte_view_for(dest)
    slot.pending = [dest, view]
    slot.future = tier.read_async(slot.key, view)
    if not slot.in_place:
        slot.storage = dest
    slot.state = State.IN


def finish_swap_in(slot: Slot) -> None:
    """The bytes are usable: by the host on the CPU; on a GPU by every kernel queued on the
    compute stream from now on (the stream waits for the copy, the host goes on)."""
    _result(slot, "in")
    slot.future = None
    slot.pending = []
    slot.state = State.RESIDENT


def _result(slot: Slot, direction: str) -> None:
    """The transfer's outcome; a tier failure comes back naming the variable (the tier only
    knows its key). A future that can order the device's compute stream after its copy
    (``CopyFuture.wait_on_device``) does that instead of blocking the host: the copy's own
    failure, if any, then surfaces at the next host wait (commit point or step end)."""
    try:
        wait_on_device = getattr(slot.future, "wait_on_device", None)
        if wait_on_device is not None:
            wait_on_device()
        else:
            slot.future.result()
    except StorageError as e:
        err = StorageError(f"swap-{direction} of {slot.name} ({slot.kind.value}, "
                           f"{format_size(slot.nbytes)}) failed: {e}")
        err.errno = e.errno
        raise err from e


def block(future: Transfer) -> None:
    """Block the host until ``future``'s transfer is over, whatever kind of future the tier
    returned (a ``concurrent.futures.Future`` or a ``CopyFuture``); never raises its error."""
    if isinstance(future, Future):
        wait([future])
    else:
        future.exception()


def follow(slot: Slot, eff: Effect, tier: SlowerTier) -> None:
    """The slot's state and tier copy after an action, as the table's row ``eff`` says (the
    bytes moved by the caller, who also counts the device bytes)."""
    slot.state = State.of(eff.to)
    if eff.tier is False and slot.host_current:   # the slower tier's copy is forgotten
        tier.discard(slot.key)
    if eff.tier is not None:
        slot.host_current = eff.tier


def in_flight(slots: Iterable[Slot]) -> list[Slot]:
    """The slots with a transfer issued and not yet waited for."""
    return [s for s in slots if s.future is not None and s.state in (State.IN, State.OUT)]


def raise_failed(slots: Iterable[Slot]) -> None:
    """After a drain: the first failed transfer among ``slots`` raises, naming its variable."""
    for s in slots:
        if failed(s):
            (finish_swap_in if s.state is State.IN else finish_swap_out)(s)


def failed(slot: Slot) -> bool:
    """The slot's transfer has finished and failed (its ``finish_*`` would raise)."""
    return slot.future is not None and slot.future.done() and slot.future.exception() is not None


def settle(slot: Slot, tier: SlowerTier) -> BaseException | None:
    """Wait for the slot's transfer in flight, if any, and leave the slot consistent whatever
    happened: RESIDENT (its bytes in memory) or HOST (the tier holds them). Returns the
    transfer's error, named, or None. Used when a step ends, failed or not.

    The wait is not given up for a KeyboardInterrupt (or a signal handler's SystemExit): the
    I/O thread may still be copying into or out of the slot's buffer, which must stay alive
    until it is done (freeing it early is a segfault, not an exception). The interrupt is
    raised once the transfer is over; transfers never hang (the tier raises instead).
    """
    if slot.future is None or slot.state not in (State.IN, State.OUT):
        return None
    interrupt: BaseException | None = None
    while True:
        try:
            block(slot.future)
            break
        except BaseException as e:  # noqa: B036 - re-raised below, after the buffer is free
            interrupt = interrupt or e
    error: BaseException | None = None
    try:
        (finish_swap_in if slot.state is State.IN else finish_swap_out)(slot)
    except Exception as e:
        error = e
        slot.future = None
        slot.pending = []
        if slot.state is State.IN:
            # The read failed: the bytes in memory are not the variable's. The tier still
            # holds them (a retry reads them again), unless they are what was corrupted.
            release(slot)
            slot.state = State.HOST
        else:
            # The write failed: the bytes are still in memory, the tier's copy is not valid.
            slot.host_current = False
            tier.discard(slot.key)
            slot.state = State.RESIDENT
    if interrupt is not None:
        raise interrupt
    return error
