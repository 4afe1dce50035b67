"""The engine's persistent tensors: parameters, gradients and optimizer state it manages.

They outlive a step (activations do not): the store adopts them (``adopt``), keeps one
variable id per name across steps (``_stable_vars``, which plans are keyed by), puts them where
a step's plan expects them at its start (``reconcile``), forgets those the model and the
optimizer let go of, and between steps brings them back (``bring_back_if_fits``,
``bring_back``: ``OutOfCore.resident()``, the ``state_dict`` hooks) or, where they exceed the
budget, has every use of one bring it back (``ooc/engine/between_steps.py``), and notices
writes made outside a step (``_note_writes_between``), whose copies on the tier then go stale.
"""

from __future__ import annotations

import itertools
import logging
from typing import Hashable

import torch
from torch._C import DisableTorchFunctionSubclass

from ooc.engine.between_steps import BetweenSteps, resizable_copy
from ooc.engine.memory import EngineMemory
from ooc.record.storages import storage_of
from ooc.host import cpu_allocator
from ooc.host.malloc import give_back_heap
from ooc.runtime.slots import Slot, State
from scheduler import on_demand
from scheduler.ir import Kind
from scheduler.schedule import Schedule
from vmm.units import format_size

log = logging.getLogger(__name__)


class PersistentStore:
    """The engine's persistent tensors (one part of ``OutOfCore``, over its ``EngineMemory``,
    model and optimizer). Its state: ``slots``, var -> ``Slot``; ``_between``, var -> tensor
    version at the end of the last step; ``_canon`` and ``_canon_name``, a persistent tensor's
    name -> its variable id, and back; ``reads``, their uses between steps
    (``between_steps.py``); ``closed``, set by the engine's ``close()``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 mem: EngineMemory) -> None:
        self._model, self._optimizer, self._mem = model, optimizer, mem
        self.closed = False
        self._ids = itertools.count()
        self.slots: dict[int, Slot] = {}
        self._between: dict[int, int] = {}   # var -> tensor version at the end of the last step
        # A persistent tensor's name -> its variable id, and back (``_stable_vars``).
        self._canon: dict[tuple[Kind, str], int] = {}
        self._canon_name: dict[int, tuple[Kind, str]] = {}
        self._warned_released = False
        self.reads = BetweenSteps(self)   # uses between steps of those left on the tier
        self._claimed: set[int] = set()   # vars whose storage allocates through ooc's CPU allocator

    @property
    def budget(self) -> int:
        return self._mem.budget

    def new_var(self) -> int:
        return next(self._ids)

    def keep(self, live: dict[int, Slot]) -> None:
        """A step ended: ``live`` are the managed tensors that outlive it, and no others."""
        for var in list(self.slots):
            if var not in live:
                del self.slots[var]
        self.slots.update(live)

    def adopt(self, t: torch.Tensor, kind: Kind, name: str) -> Slot | None:
        s = storage_of(t)
        if s is None:   # sparse: no storage to release, left to PyTorch
            return None
        for slot in self.slots.values():
            if slot.storage is s:
                return slot
        if s.nbytes() < self._mem.min_bytes:
            return None
        slot = Slot(self.new_var(), kind, s.nbytes(), name, in_place=True,
                    state=State.RESIDENT, storage=s)
        self.slots[slot.var] = slot
        return slot

    def state_loaded(self, optimizer: torch.optim.Optimizer, *, stepping: bool) -> None:
        """``optimizer.load_state_dict`` put new tensors in its state: manage those instead of
        the ones it replaced (whose tier copies go; one the user still holds gets its bytes
        back first), from the next step on, which re-plans."""
        held = self.reads.unwatch()
        for var, slot in list(self.slots.items()):
            if slot.kind is Kind.OPTIMIZER_STATE:
                self._let_go(slot, held.get(var))
                del self.slots[var]
        names = {p: n for n, p in self._model.named_parameters()}
        for p, state in optimizer.state.items():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    if t.layout is torch.strided and not t.untyped_storage().resizable():   # torch.load's
                        t = state[key] = t.clone()
                    self.adopt(t, Kind.OPTIMIZER_STATE, f"{names.get(p, '?')}.{key}")
        if not stepping:   # (versions stay: writes since the last were not written out)
            self._watch_released()

    def enter_step(self) -> None:
        """A step starts: its ops run on plain tensors (no longer watched), on the persistent
        tensors the model and the optimizer still hold, under the variable ids of their names."""
        if self.slots:   # (activations only: none, and a plain step makes no call for them)
            self._forget_dropped(self.reads.unwatch())
            self._own_storages()
        self._stable_vars()

    def _own_storages(self) -> None:
        """Storages exported between steps are not resizable: give their tensors a copy
        (``between_steps.resizable_copy``), so that the step can release it."""
        stuck = [s for s in self.slots.values() if s.storage is not None and not s.storage.resizable()]
        by_var = self._tensors_by_var() if stuck else {}
        for slot in stuck:
            slot.storage = resizable_copy(slot.storage, by_var.get(slot.var, []))
            self._claimed.discard(slot.var)

    def _forget_dropped(self, watched: dict[int, list[torch.Tensor]]) -> None:
        """Stop managing the gradients and optimizer state that the model and the optimizer
        let go of between steps (``zero_grad()`` before the step, ``opt.state.clear()``): the
        engine's reference would keep their bytes, and the tier their copies, for nothing;
        and the next step's plan would count tensors that no longer exist. ``watched``: the
        tensors watched until now, by var (one the user still holds gets its bytes back)."""
        with DisableTorchFunctionSubclass():
            held = {id(t.untyped_storage()) for t in self._persistent_tensors()}
        for var, slot in list(self.slots.items()):
            if slot.kind is Kind.PARAM or slot.storage is None or id(slot.storage) in held:
                continue
            self._let_go(slot, watched.get(var))
            slot.storage = None
            del self.slots[var]
            self._between.pop(var, None)

    def _let_go(self, slot: Slot, alive: list[torch.Tensor] | None) -> None:
        """Stop keeping ``slot``'s copy on the tier; a tensor of it that is still alive (the
        user's reference to a gradient ``zero_grad()`` dropped) gets its bytes back first."""
        if alive and slot.state is State.HOST:
            self.read_back(slot)
        slot.forget_copy(self._mem.tier)

    def _stable_vars(self) -> None:
        """Give each persistent tensor the variable id its name had when first managed.

        A gradient set to None and created again in the step (``zero_grad()`` at the top of
        the loop, inside the step, with grads managed) is a new variable at the step's end;
        with a fresh id each time, no step ever started in a state a plan was made for, and
        every step ran on demand and re-planned. Plans are keyed by these ids
        (``_start_key``), so the same tensors under the same names must keep their ids."""
        taken = set(self.slots)
        renamed: dict[int, Slot] = {}
        for var, slot in self.slots.items():
            name = (slot.kind, slot.name)
            canon = self._canon.get(name)
            if canon is None and var not in self._canon_name:   # one id per name, one name per id
                self._canon[name], self._canon_name[var] = var, name
                canon = var
            if canon is not None and canon != var and canon not in taken:   # never two slots with one id
                taken.discard(var)
                taken.add(canon)
                if var in self._between:
                    self._between[canon] = self._between.pop(var)
                slot.var = canon
            renamed[slot.var] = slot
        self.slots = renamed

    def start_key(self, kind: Hashable = None) -> tuple[frozenset[int], tuple[bool, ...], Hashable]:
        """The state a step starts in, which decides its ops: the managed persistent tensors,
        and which parameters have a gradient. Autograd creates a missing gradient (a detach)
        and adds to an existing one (``add_``): the first micro-batch of an accumulation
        window and the others run different ops. With grads unmanaged (the default) no
        persistent variable says which, and the two kinds of step replaced each other's plan
        at every step. (A step that also calls ``optimizer_step()`` extends the plan of its
        starting state: it diverges once at the plan's end, and the steps without an update
        run the longer plan's prefix.) ``kind`` is the caller's (``OutOfCore.step(kind)``), for
        steps that start alike and run other ops in turn: Lightning zeroes the gradients in a
        window's first micro-batch, after its forward, so all its micro-batches start with
        gradients, the first zeroes them and the last updates; without a kind each replaced
        the other's plan and every step ran on demand (``ooc/integrations/lightning.py``)."""
        return frozenset(self.slots), tuple([p.grad is not None for p in self._model.parameters()]), kind

    def reconcile(self, schedule: Schedule | None) -> None:
        """Bring persistent tensors to where the plan expects them at the start of a step;
        with no plan for this start (a step on demand), within the budget."""
        self._note_writes_between()
        self._claim_storages()
        try:
            if schedule is None:
                self._fit_persistent()
                return
            want = schedule.initial_resident
            for slot in self.slots.values():   # first what leaves, then what comes: in one pass, a
                if slot.var not in want and slot.state is State.RESIDENT:   # VAE's first planned
                    self.to_tier(slot)   # step started 12 MiB over its 30 MiB step budget
            for slot in self.slots.values():
                if slot.var in want and slot.state is State.HOST:
                    self._mem.counters["bytes_in"] += slot.bring_back(self._mem.tier, self._mem.pool)
        except BaseException:
            self.settle(self.slots.values())   # nothing changed yet: every slot consistent
            raise

    def _claim_storages(self) -> None:
        """On a CPU, have each persistent storage allocate through ooc's allocator when a
        swap-in resizes it (``cpu_allocator.claim``): parameters built before the engine keep
        PyTorch's default allocator, whose fresh pages the kernel zeroed at every swap-in. The
        resident ones move their bytes there too, and glibc's heap is trimmed after each: a
        parameter swapped out of the heap later would leave its pages resident until the step's
        end (VGG16's recording step, update inside the backward, 1/3 of its peak: 150 -> 99 MiB
        above the built model)."""
        if not self._mem.on_cpu:
            return
        for var, slot in self.slots.items():
            if var in self._claimed or slot.storage is None:
                continue
            got = cpu_allocator.claim(slot.storage, move=slot.state is State.RESIDENT)
            if got == 2:
                give_back_heap()
            if got:
                self._claimed.add(var)

    def _fit_persistent(self) -> None:
        """Before a step on demand, move resident persistent tensors to the tier until the rest
        fits the budget: the whole model is resident before the first step, the optimizer
        state the first update created may be after it. Which ones go is the scheduler's
        choice (``scheduler.on_demand.persistent_to_evict``); the step evicts the rest as
        needed."""
        resident = [(s, s.nbytes) for s in self.slots.values() if s.state is State.RESIDENT]
        for slot in on_demand.persistent_to_evict(resident, self._mem.budget):
            self.to_tier(slot)

    def to_tier(self, slot: Slot) -> int:
        """Give a resident persistent slot's memory back, writing it out first if needed;
        returns the bytes written."""
        written = slot.to_tier(self._mem.tier)
        self._mem.counters["bytes_out"] += written
        return written

    def settle(self, slots) -> list[BaseException]:
        """Wait for the transfers of ``slots``; leave each resident or on the tier. Returns the
        transfers' errors; a KeyboardInterrupt during the wait is raised once all are done."""
        errors: list[BaseException] = []
        interrupt: BaseException | None = None
        for slot in list(slots):
            try:
                e = slot.settle(self._mem.tier)
            except BaseException as exc:  # noqa: B036 - an interrupt: re-raised below
                interrupt = interrupt or exc
                continue
            if e is not None:
                errors.append(e)
        if interrupt is not None:
            try:
                raise interrupt
            finally:   # (held here, a cycle through the frame its traceback keeps)
                del interrupt
        return errors

    def bring_back_if_fits(self, *, between_steps: bool) -> None:
        """At a step's end or a new budget, bring the managed persistent tensors back if all
        of them fit the budget: within it that costs no memory the budget did not grant, and
        between steps they are plain tensors. Those of a model whose params, grads and state
        exceed the budget (the reason to manage them) stay where they are, all watched: a use
        of one from Python brings it back (``_watch_released``). Left plain, a released
        storage had 0 bytes under a tensor that keeps its shape, which PyTorch does not check:
        ``p.sum()`` read out of bounds, a segfault (issue 40). Brought back whole at a new
        budget, they lifted the process over it before its first step (a VAE with Adam at a
        30 MiB budget for the whole step: 41.6 MB)."""
        total = sum(s.nbytes for s in self.slots.values())
        if total <= self._mem.budget:
            try:
                self.bring_back(between_steps=between_steps)
            finally:   # a failed read leaves its tensor on the tier: watched, as below
                self._watch_released()
            return
        if not self._warned_released and any(s.state is State.HOST for s in self.slots.values()):
            self._warned_released = True
            log.info("managed params/grads/optimizer state (%s) exceed the %s budget: between "
                     "steps they stay on the slower tier, and each use brings back what it uses",
                     format_size(total), format_size(self._mem.budget))
        if between_steps:
            self._note_writes_between()
        self._between = self._versions()
        self._watch_released()

    def _watch_released(self) -> None:
        """Between steps, with some persistent tensors on the tier: watch them all, so that a
        use of one brings it back (``ooc/engine/between_steps.py``); one that a tensor not
        watched can read is read back now."""
        if any(s.state is State.HOST for s in self.slots.values()):
            self.reads.watch(self.slots, self._tensors_by_var(), self.read_back)

    def bring_back(self, *, between_steps: bool = True) -> None:
        """Read every managed persistent tensor the tier holds back into its storage (the
        tier's copies stay current: the next step lets go of them again without writing,
        unless they were written in between)."""
        if between_steps:   # a step's own writes are the stepper's to track
            self._note_writes_between()   # before the versions are taken again below
        for slot in self.slots.values():
            if slot.state is State.HOST:
                self.read_back(slot)   # a failure leaves the rest as they were: watched
        self.reads.unwatch()
        self._between = self._versions()

    def read_back(self, slot: Slot) -> None:
        """Read one persistent tensor back from the tier into its storage, between steps."""
        try:
            slot.bring_back(self._mem.tier, self._mem.pool)
        except BaseException:
            self.settle([slot])   # on the tier again, its copy intact
            raise
        self._mem.counters["bytes_in"] += slot.nbytes

    def release_between(self, slot: Slot, tensors: list[torch.Tensor]) -> int:
        """Give a resident persistent tensor's memory back between steps (a read of another
        one needs the room), writing it out if its bytes changed; returns the bytes written.
        ``tensors``: those that hold it, whose versions say whether they were written."""
        with DisableTorchFunctionSubclass():
            versions = {t._version for t in tensors}
        if versions - {self._between.get(slot.var)}:
            slot.forget_copy(self._mem.tier)   # written since it was read back: the copy is stale
        written = self.to_tier(slot)
        if versions:
            self._between[slot.var] = max(versions)
        return written

    def _note_writes_between(self) -> None:
        """A persistent tensor written between steps (load_state_dict's copy_, an in-place
        edit) has a stale copy on the tier: forget it, since releasing the bytes without
        writing them would lose the write. Runs before anything records new versions."""
        for var, version in self._versions().items():
            slot = self.slots[var]
            if slot.state is State.RESIDENT and self._between.get(var) != version:
                slot.forget_copy(self._mem.tier)

    def _versions(self) -> dict[int, int]:
        """The version counter of the tensor that holds each persistent variable (params,
        their grads, optimizer state): in-place writes between steps bump it."""
        with DisableTorchFunctionSubclass():   # watched ones too: their versions, no reads
            return {var: ts[-1]._version for var, ts in self._tensors_by_var().items()}

    def _tensors_by_var(self) -> dict[int, list[torch.Tensor]]:
        """The tensors the model and the optimizer hold now for each persistent variable."""
        if not self.slots:   # activations only: nothing to look for (twice a step)
            return {}
        by_storage = {id(s.storage): s for s in self.slots.values() if s.storage is not None}
        out: dict[int, list[torch.Tensor]] = {}
        with DisableTorchFunctionSubclass():   # a watched tensor's storage, not brought back
            for t in self._persistent_tensors():
                slot = by_storage.get(id(t.untyped_storage()))
                if slot is not None and slot.storage is t.untyped_storage():
                    ts = out.setdefault(slot.var, [])
                    if not any(x is t for x in ts):   # a tied parameter: once
                        ts.append(t)
        return out

    def _persistent_tensors(self) -> list[torch.Tensor]:
        """The tensors the model and the optimizer hold now: parameters, their grads, state
        (of every parameter the optimizer has state for). Not sparse ones (a sparse gradient
        of ``nn.Embedding(sparse=True)``): they have no storage, the engine leaves them be."""
        tensors = []
        for p in self._model.parameters():
            tensors += [p, p.grad] if p.grad is not None else [p]
        if self._optimizer is not None:
            for state in self._optimizer.state.values():
                tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return [t for t in tensors if t.layout is torch.strided]
