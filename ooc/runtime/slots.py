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

A ``Slot`` is the one place a managed tensor's bytes move and its state changes: every step
form, the engine between steps and the step's end call its methods, never assign its state
(``tests/ooc/test_slot_transitions.py`` reads the source to hold that).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from ooc.errors import OOCError, StorageError
from ooc.storage.device_bytes import byte_view_for
from ooc.runtime.labels import label
from ooc.runtime.pool import RangeSource
from ooc.storage.tier import SlowerTier, Transfer
from scheduler.actions import TRANSITIONS, Effect, Op, Residency, refusal
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

    __hash__ = object.__hash__   # identity, in C: scheduler.actions.Residency says why

    @property
    def residency(self) -> Residency:
        """This state in the transition table's words."""
        return _RESIDENCY[self]

    @staticmethod
    def of(residency: Residency) -> State:
        """The slot state for a state of the transition table."""
        return _STATE[residency]


_RESIDENCY = {State.ABSENT: Residency.ABSENT, State.RESIDENT: Residency.RESIDENT, State.IN: Residency.IN,
              State.OUT: Residency.OUT, State.HOST: Residency.HOST, State.DISCARDED: Residency.DISCARDED}
_STATE = {**{r: s for s, r in _RESIDENCY.items()}, Residency.DEAD: State.ABSENT}


class SlotError(OOCError):
    """A slot was asked for a transition its state does not allow: a bug of the runtime (the
    step forms check the table first, ``scheduler.actions.refusal``, and diverge), named."""


def _call(name: str, fn: Callable[[], None]) -> None:
    fn()


def _ignore(*_: object) -> None:
    pass


@dataclass(eq=False)
class Slot:
    """A managed variable: its plan id, bytes, where its bytes are, and its storage.

    The one owner of its state (as FSDP2's ``FSDPParam`` owns its sharded and unsharded
    states): every change of ``state`` is one of the methods below, each a row of the
    transition table (``scheduler.actions.TRANSITIONS``: ``start_swap_in``,
    ``finish_swap_in``, ``start_swap_out``, ``finish_swap_out``, ``drop``, ``free``,
    ``discard``, ``made_again``) or one of the moves outside any plan (``bring_back``,
    ``to_tier``, ``take_back``, ``settle``, ``forget``). A transition the state does not
    allow raises ``SlotError`` naming the tensor; byte moves, the tier's copy (``host_current``)
    and the storage follow the row. Callers count device bytes and time the waits; the slot
    moves bytes, knows where they are, and names each transfer it starts to profilers."""

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

    def given_back(self) -> bool:
        """The plan freed this tensor's bytes (it died in the recorded step) but the tensor
        lives on: a gradient read after ``optimizer.step()``, or kept past the step, where
        the recorded step had set it to None. Its storage is empty; no copy exists."""
        return (self.state is State.ABSENT and self.in_place and self.storage is not None
                and self.nbytes > 0 and self.storage.nbytes() == 0)

    # -- the transition table's rows ---------------------------------------------------------

    def _row(self, op: Op) -> Effect:
        """``op``'s row for the slot's state, or ``SlotError`` naming the tensor."""
        why = refusal(op, self.state.residency, self.host_current)
        if why is not None:
            raise SlotError(f"{op.value} of {self.name} ({self.kind.value}, {format_size(self.nbytes)}): {why}")
        return TRANSITIONS[op, self.state.residency]

    def _follow(self, eff: Effect, tier: SlowerTier | None) -> None:
        """The state and the tier's copy after a row (the bytes moved already)."""
        self.state = State.of(eff.to)
        if eff.tier is False and self.host_current and tier is not None:   # the tier's copy is forgotten
            tier.discard(self.key)
        if eff.tier is not None:
            self.host_current = eff.tier

    def start_swap_out(self, tier: SlowerTier) -> None:
        """Begin writing the slot's bytes to the tier; the storage stays until ``finish_swap_out``."""
        eff = self._row(Op.SWAP_OUT)
        view = byte_view_for(self.storage)
        self.pending = [self.storage, view]   # empty (an expert given no token): nothing to write
        with label("ooc.swap_out ", self.name):
            self.future = tier.write_async(self.key, view, self.nbytes) if self.nbytes else _done()
        self._follow(eff, tier)

    def finish_swap_out(self) -> None:
        """Wait for the write, then give the device bytes back.

        On a GPU the wait is the compute stream's, not the host's: every kernel queued after it
        (the only work that may reuse the bytes released here) runs after the copy."""
        eff = self._row(Op.WAIT_OUT)
        _result(self, "out")
        self.future = None
        self.pending = []
        self._release()
        self._follow(eff, None)

    def start_swap_in(self, tier: SlowerTier, pool: RangeSource) -> None:
        """Take device memory and begin reading the slot's bytes back into it (an
        ``OutOfBudget`` from ``pool`` leaves the slot as it was)."""
        eff = self._row(Op.SWAP_IN)
        if self.in_place:
            self.storage.resize_(self.nbytes)
        # an empty slot's storage was kept (``_release``): it holds no byte to take or read
        dest = self.storage if self.in_place or not self.nbytes else pool.take(self.nbytes).untyped_storage()
        view = byte_view_for(dest)
        self.pending = [dest, view]
        with label("ooc.swap_in ", self.name):
            self.future = tier.read_async(self.key, view) if self.nbytes else _done()
        if not self.in_place:
            self.storage = dest
        self._follow(eff, tier)

    def finish_swap_in(self) -> None:
        """The bytes are usable: by the host on the CPU; on a GPU by every kernel queued on the
        compute stream from now on (the stream waits for the copy, the host goes on)."""
        eff = self._row(Op.WAIT_IN)
        _result(self, "in")
        self.future = None
        self.pending = []
        self._follow(eff, None)

    def drop(self, tier: SlowerTier) -> None:
        """Give the device bytes back: the tier holds the current ones (no transfer)."""
        eff = self._row(Op.DROP)
        self._release()
        self._follow(eff, tier)

    def free(self, tier: SlowerTier) -> None:
        """A dead variable gives back whatever it holds, on the device and on the tier."""
        eff = self._row(Op.FREE)
        if self.state is State.RESIDENT:
            if not self.in_place:
                self.storage = None
            elif self.storage is not None and self.storage.resizable():
                # A gradient dead for the rest of the step (the plan frees only variables that
                # are not live-out and never used again): give its bytes back now. Otherwise
                # p.grad keeps them until zero_grad, and every gradient of the model piles up
                # through the optimizer step, outside the budget.
                self.storage.resize_(0)
        self._follow(eff, tier)

    def discard(self, tier: SlowerTier) -> None:
        """Give the bytes back with no copy anywhere: only ``made_again`` brings them back."""
        eff = self._row(Op.DISCARD)
        self.storage = None
        self._follow(eff, tier)

    def made_again(self, storage: torch.UntypedStorage, tier: SlowerTier | None = None) -> None:
        """A discarded slot's bytes, re-created by rerunning its chain (``recompute.py``)."""
        eff = self._row(Op.RECOMPUTE)
        self.storage = storage
        self._follow(eff, tier)

    # -- moves outside any plan (on demand, between steps, a step's end) ---------------------

    def bring_back(self, tier: SlowerTier, pool: RangeSource, *,
                   wait: Callable[[str, Callable[[], None]], None] = _call,
                   account: Callable[[int], None] = _ignore,
                   started: Callable[[Slot], None] = _ignore) -> int:
        """Make the slot resident now, from wherever its bytes are: a write in flight is
        waited for (its device bytes go back: ``account(-nbytes)``), the tier's copy is read
        into memory from ``pool`` (taken first: ``account(+nbytes)``, where the caller makes
        room) and waited for. ``wait(name, fn)`` runs each wait (the caller times it),
        ``started`` sees the read issued. Returns the bytes read from the tier. A slot with no
        copy anywhere (freed, discarded) is left as it is: what that means is the caller's."""
        if self.state is State.OUT:
            wait(f"wait_out {self.name}", self.finish_swap_out)
            account(-self.nbytes)
        read = 0
        if self.state is State.HOST:
            account(self.nbytes)
            self.start_swap_in(tier, pool)
            started(self)
            read = self.nbytes
        if self.state is State.IN:
            wait(f"swap_in {self.name}", self.finish_swap_in)
        return read

    def to_tier(self, tier: SlowerTier) -> int:
        """A resident slot's memory back now: dropped if the tier holds its bytes, else written
        out and waited for. Returns the bytes written."""
        if self.host_current:
            self.drop(tier)
            return 0
        self.start_swap_out(tier)
        self.finish_swap_out()
        return self.nbytes

    def take_back(self, storage: torch.UntypedStorage, tier: SlowerTier) -> None:
        """An op writes in place into the storage the slot was born in, after the engine let
        go of it (``binding.py``): that storage holds the bytes from now on (resident; counted
        as such already, it replaces the copy) and the tier's copy goes stale. A write in
        flight is waited for first (``finish_swap_out``)."""
        if self.state in (State.ABSENT, State.OUT):
            raise SlotError(f"{self.name} is {self.state.value}: nothing to take back")
        self.forget_copy(tier)
        self.storage = storage
        self.state = State.RESIDENT

    def written(self) -> None:
        """An op wrote the slot's bytes: the tier's copy, if any, is stale (kept until freed)."""
        self.host_current = False

    def forget_copy(self, tier: SlowerTier) -> None:
        """The tier's copy is of no use any more (stale, or nobody reads it again)."""
        if self.host_current:
            tier.discard(self.key)
            self.host_current = False

    def forget(self, tier: SlowerTier) -> None:
        """A step's activation at the step's end: settled, its tier copy and storage let go."""
        if self.state in (State.IN, State.OUT):
            raise SlotError(f"{self.name} is {self.state.value}: settle it before forgetting it")
        self.forget_copy(tier)
        self.storage = None
        self.state = State.ABSENT

    def settle(self, tier: SlowerTier) -> BaseException | None:
        """Wait for the transfer in flight, if any, and leave the slot consistent whatever
        happened: RESIDENT (its bytes in memory) or HOST (the tier holds them). Returns the
        transfer's error, named, or None. Used when a step ends, failed or not.

        The wait is not given up for a KeyboardInterrupt (or a signal handler's SystemExit):
        the I/O thread may still be copying into or out of the slot's buffer, which must stay
        alive until it is done (freeing it early is a segfault, not an exception). The
        interrupt is raised once the transfer is over; transfers never hang (the tier raises
        instead).
        """
        if self.future is None or self.state not in (State.IN, State.OUT):
            return None
        interrupt: BaseException | None = None
        while True:
            try:
                block(self.future)
                break
            except BaseException as e:  # noqa: B036 - re-raised below, after the buffer is free
                interrupt = interrupt or e
        error: BaseException | None = None
        try:
            (self.finish_swap_in if self.state is State.IN else self.finish_swap_out)()
        except Exception as e:
            error = e
            self.future = None
            self.pending = []
            if self.state is State.IN:
                # The read failed: the bytes in memory are not the variable's. The tier still
                # holds them (a retry reads them again), unless they are what was corrupted.
                self._release()
                self.state = State.HOST
            else:
                # The write failed: the bytes are still in memory, the tier's copy is not valid.
                self.host_current = False
                tier.discard(self.key)
                self.state = State.RESIDENT
        if interrupt is not None:
            try:
                raise interrupt
            finally:   # (held here, a cycle through the frame its traceback keeps)
                del interrupt
        return error

    def _release(self) -> None:
        """Give the device bytes back (the state is the caller's); an empty storage, which holds
        none, is kept for the swap-in to hand back."""
        if self.in_place and self.storage is not None:
            self.storage.resize_(0)
        elif self.nbytes:
            self.storage = None


def _done() -> Future:
    """The transfer of an empty slot: finished before it starts."""
    f: Future = Future()
    f.set_result(None)
    return f


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
