"""Running one training step: every aten op passes through here.

The step is a sequence of functions (aten ops, as a ``TorchDispatchMode`` sees them, forward,
backward and optimizer alike). Op i runs as:

1. the schedule's actions *before* op i (swap-in, wait for swap-in, wait for swap-out);
2. a residency check of every managed storage op i touches (a mismatch with the plan is a
   divergence: the rest of the step runs on demand, and the engine re-plans);
3. op i itself, timed;
4. the schedule's actions *after* op i (swap-out, drop, free), and the binding of the
   variables op i created to their plan ids.

Autograd's unpack hook for the node about to run happens *before* that node's first op,
so unpack runs step 1 early for the next op: nothing else happens in between.

Two ways to run: ``planned`` executes a checked ``Schedule``; ``on demand`` (the recording
step, a step with no plan for the state it starts in, and the rest of a diverged step) keeps
nothing it does not need: saved activations and gradients are written out as soon as
autograd saves or accumulates them, persistent tensors leave after each op, and everything
comes back synchronously at its use. On demand is slow, never wrong, and within the budget
too: before anything becomes resident, the least recently used managed tensors the op does
not need make room (``Stepper._make_room``). Only an op whose own tensors exceed the budget
goes over it, counted as such, and fails its step at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

import scheduler
from ooc.runtime import slots as sl
from ooc.runtime.composition import check_hooks_inside, top_saved_tensors_hooks
from ooc.runtime.devices import cuda_runtime
from ooc.runtime.labels import label
from ooc.record import roles
from ooc.record.managed import Birth, Recording
from ooc.record.op_schema import _OPS, op_info, split_foreach, tensors as _tensors
from ooc.record.recorder import StepRecorder
from ooc.runtime.rollback import StepRollback
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_context import StepContext
from scheduler import on_demand
from scheduler.actions import TRANSITIONS, Names, refusal
from scheduler.ir import Access, Kind
from scheduler.schedule import Op, Schedule
from vmm.errors import OutOfBudget
from vmm.units import format_size

log = logging.getLogger(__name__)

def _use_count(s: torch.UntypedStorage) -> int:
    """How many references hold ``s``'s bytes (tensors and the one of the Python storage);
    2 when this PyTorch cannot say, which errs towards keeping the bytes."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(s._cdata) if count is not None else 2


class _Unbudgeted:
    """Memory outside the pool, on the engine's device, for an on-demand step that has
    already failed its budget."""

    def __init__(self, device: torch.device) -> None:
        # where the device's tensors live (the CPU under ooc.testing.fake_cuda)
        self.device = cuda_runtime().tensor_device(device) if device.type == "cuda" else device

    def take(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class Packed:
    """What autograd keeps for a saved activation: the slot and how to rebuild the view."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset", "tensor")

    def __init__(self, slot: Slot, t: torch.Tensor) -> None:
        self.slot = slot
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset()


class Stepper:
    """The state of one step: op counter, plan cursor, recording, slots by storage."""

    def __init__(self, ctx: StepContext, schedule: Schedule | None, binding: dict, *,
                 observe_small: bool = False) -> None:
        self.ctx = ctx
        self.start_key = ctx.start_key
        self.schedule = schedule
        self.planned = schedule is not None
        self.binding = binding            # (op, out) -> var, for variables born in the step
        self.rec = Recording()
        self.i = 0                        # index of the next op
        self.done_before = -1             # last op whose before-actions ran
        self.by_storage: dict[int, Slot] = {}   # id(storage) -> slot, for this step
        self.slots: dict[int, Slot] = {}        # var -> slot
        self.diverged_at: int | None = None
        self.refused = None                     # the plan action the table refused, if any
        self.in_flight_out: list[Slot] = []     # on-demand writes, oldest first
        self.resident = 0                       # managed device bytes, as the plan counts them
        self.peak = 0
        self.stall_s = 0.0
        self.events: list[tuple[str, str, float, float]] = []  # (track, name, t0, t1)
        self.unpacked: list[int] = []            # vars unpacked for the next op
        # On a GPU an op's host time is its launch, not its run: a step that will be planned
        # from (recording, on demand) times its ops with CUDA events instead, read at its end.
        self.gpu_timing = ctx.device.type == "cuda" and not self.planned
        self.gpu_events: list[tuple[int, Any, Any]] = []   # (op, start event, end event)
        self.overflow: OutOfBudget | None = None # an on-demand need the pool could not meet
        # On demand: what may hold managed memory, least recently used first (slots, and the
        # optimizer's new storages in ``fresh``); the activations the running backward node
        # unpacked (autograd holds them until it returns: never evicted); the optimizer's new
        # storages not managed yet (counted: they are its state, or die as temporaries); and
        # those written out to make room (see ``hand_back``).
        self.recent: dict[Slot | Birth, None] = {}
        self.held: dict[Slot, None] = {}
        self.fresh: dict[Birth, None] = {}
        self.adopted: list[Slot] = []
        self.node_vars: list[int] = []           # vars unpacked by the backward node now running
        self.ops_since_unpack = 0
        # What a rollback needs if the step fails before its optimizer step (ooc/runtime/rollback.py).
        self.rollback = StepRollback(ctx.model)
        self.updating = False   # inside optimizer.step() (between the engine's pre and post hooks)
        persistent = list(ctx.persistent)
        for slot in persistent:
            self._register(slot)
            self.rec.add_persistent(slot.var, slot.nbytes, slot.kind, slot.name, live_out=True)
            if slot.state in (State.RESIDENT, State.IN, State.OUT):
                self.resident += slot.nbytes
        if not self.planned:   # the last registered leave first: a forward uses them in order
            for slot in reversed(persistent):
                if slot.state in (State.RESIDENT, State.IN, State.OUT):
                    self.recent[slot] = None
        self.peak = self.resident   # the engine brought the start within the budget (_reconcile)
        # A step that is not planned also records the whole step, every storage, with the
        # recorder ``ooc.trace`` uses (ooc/record/): ``engine.last_recording`` is the step as
        # ``ooc plan`` would plan it. A planned step does not pay for it.
        self.full: StepRecorder | None = None
        self.full_vars: dict[int, int] = {}   # saved activation's var -> its recorder variable
        if not self.planned:
            self.full = StepRecorder()
            self.roles = roles.register_persistent(self.full, ctx.model, ctx.optimizer,
                                                   self._persistent_bytes)
        # A recording step that decides the chunk (the engine's default chunk adapts, see
        # scheduler/chunk_size.py) notes the storages its ops create below the threshold, and
        # which of those autograd saves: would a smaller chunk manage them?
        self.small_born: dict[int, int] | None = {} if observe_small and not self.planned else None
        self.small_saved: dict[int, int] = {}
        self._own_pack: Any = None   # the pack hook this step pushed (see saved_tensors_hooks)
        # The plan, per op, as lists the per-op path indexes (no attribute chains, no calls).
        functions = schedule.sequence.functions if schedule is not None else ()
        self._plan_names = [f.name for f in functions]
        self._before = schedule.before if schedule is not None else ()
        self._after = schedule.after if schedule is not None else ()
        self._pool_excess = ctx.pool_excess

    # -- bookkeeping -----------------------------------------------------------------------

    def _register(self, slot: Slot) -> None:
        self.slots[slot.var] = slot
        if slot.storage is not None:
            self.by_storage[id(slot.storage)] = slot

    def _persistent_bytes(self, t: torch.Tensor) -> int | None:
        """A managed persistent tensor's size (its storage may be empty: on the tier)."""
        slot = self.slot_of(t)
        return slot.nbytes if slot is not None else None

    def slot_of(self, t: torch.Tensor) -> Slot | None:
        s = t.untyped_storage()
        slot = self.by_storage.get(id(s))
        if slot is not None and slot.storage is not s:
            del self.by_storage[id(s)]   # a dead storage's id was reused
            return None
        return slot

    def _account(self, delta: int) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)

    # -- what the engine asks of the step ----------------------------------------------------

    def adopt_grad_of(self, grad: torch.Tensor, name: str) -> None:
        """A parameter's gradient autograd has finished accumulating (the engine's post-
        accumulate hook): manage it, if this step created its storage and nothing manages it."""
        s = grad.untyped_storage()
        b = self.rec.live_birth(s)
        if b is not None and b.var is None and self.slot_of(grad) is None:
            var = self.ctx.new_var()
            self.rec.promote(b, var, Kind.GRAD, f"{name}.grad")
            self.adopt_grad(Slot(var, Kind.GRAD, b.nbytes, f"{name}.grad", in_place=True,
                                 state=State.RESIDENT, storage=s))

    def forgive_overflow(self) -> OutOfBudget | None:
        """The on-demand overflow so far, forgotten: the engine decided it does not fail the
        step (a plan will keep later steps within the budget)."""
        overflow, self.overflow = self.overflow, None
        return overflow

    def wait_for_transfers(self) -> None:
        """The commit point's wait: every transfer in flight completes; a failed one raises
        here, naming its variable."""
        busy = [s for s in self.slots.values() if s.future is not None and s.state in (State.IN, State.OUT)]
        if busy:   # one wait for all of them (on a GPU, one host synchronization)
            self._timed("wait", "commit point", self.ctx.tier.drain)
        for s in busy:
            if sl.failed(s):   # raises the transfer's error, named
                (sl.finish_swap_in if s.state is State.IN else sl.finish_swap_out)(s)

    def update_starts(self) -> None:
        """``optimizer.step()`` begins, past the commit point: its ops are the optimizer
        phase, and from here on the step is not rolled back (the undo copies go)."""
        if self.rec.optimizer_start is None:   # a second update in the step: the first one began it
            self.rec.optimizer_start = len(self.rec.names)
            if self.full is not None:
                self.full.phase("optimizer")
                roles.mark_grads(self.full, self.roles)
        self.rollback.commit()
        self.updating = True

    def update_done(self) -> None:
        self.updating = False

    def writes_settled(self) -> None:
        """The engine waited for every transfer of the step (``OutOfCore._settle``): no
        on-demand write is in flight any more."""
        self.in_flight_out.clear()

    def live_slot(self, s: torch.UntypedStorage, kind: Kind, name: str) -> Slot | None:
        """A slot for storage ``s``, born in this step and managed from now on as ``name``
        (a gradient or optimizer state that outlives the step); None if the step did not
        create it or it is too small to manage."""
        b = self.rec.live_birth(s)
        if b is None or b.nbytes < self.ctx.min_bytes:
            return None
        var = b.var if b.var is not None else self.ctx.new_var()
        if b.var is None:
            self.rec.promote(b, var, kind, name)
        return Slot(var, kind, b.nbytes, name, in_place=True, state=State.RESIDENT, storage=s)

    def mark_live_out(self, live: dict[int, Slot]) -> None:
        """Record which variables outlive the step (``live``), as the plan must know."""
        for var, v in self.rec.variables.items():
            if v.live_out != (var in live):
                self.rec.set_live_out(var, var in live)

    def whole_recording(self) -> scheduler.VariableSequence | None:
        """The step as ``ooc.trace`` records it (every storage, every kind), if it was not
        planned; None for a planned step, which records only its managed variables."""
        if self.full is None:
            return None
        roles.mark_grads(self.full, self.roles)   # a step without an update: grads it left
        roles.mark_persistent(self.full, self.roles, self.ctx.optimizer)
        return self.full.sequence({"device": str(self.ctx.device)})

    # -- schedule actions --------------------------------------------------------------------

    def _timed(self, track: str, name: str, fn, *args) -> None:
        """Block on a transfer; the time counts as stall and shows on the timeline."""
        t0 = time.perf_counter()
        with label(f"ooc.{name}"):
            fn(*args)
        t1 = time.perf_counter()
        self.stall_s += t1 - t0
        self.events.append((track, name, t0, t1))

    def run_actions(self, actions, where: int, phase: str = "before") -> None:
        for a in actions:
            if not self.planned:
                return   # diverged: the rest of the step runs on demand
            slot = self.slots.get(a.var)
            if slot is None:
                self._diverge(where, f"variable {a.var} of the plan is not bound")
                return
            self.apply(a.op, slot, where, phase)

    def apply(self, op: Op, slot: Slot, where: int, phase: str = "before") -> None:
        """Run plan action ``op`` on ``slot`` as the transition table (``scheduler.actions``)
        defines it: its precondition on the slot's state, its new state and device bytes are
        the table's; only the byte moves are this method's. A refused action means the step
        is not where its plan is: it diverges, with the error ``scheduler.check`` gives for
        the same action (``Refused``), and finishes on demand."""
        state = slot.state.residency
        why = refusal(op, state, slot.host_current)
        if why is not None:
            self.refused = Names(self.schedule.sequence).refused(op, slot.var, where, phase, state, why)
            self._diverge(where, str(self.refused))
            return
        eff = TRANSITIONS[op, state]
        ctx = self.ctx
        if op is Op.SWAP_IN:
            self._account(eff.device * slot.nbytes)   # the destination is taken at issue
            with label(f"ooc.swap_in {slot.name}"):
                self._swap_in(slot, where)
            ctx.counters["bytes_in"] += slot.nbytes
        elif op is Op.WAIT_IN:
            self._timed("wait", f"wait_in {slot.name}", sl.finish_swap_in, slot)
            self._register(slot)
        elif op is Op.SWAP_OUT:
            with label(f"ooc.swap_out {slot.name}"):
                self._start_out(slot)
            ctx.counters["bytes_out"] += slot.nbytes
        elif op is Op.WAIT_OUT:
            self._timed("wait", f"wait_out {slot.name}", sl.finish_swap_out, slot)
        elif op is Op.DROP:
            sl.release(slot)
        elif op is Op.FREE:
            self._free(slot)
        slot.state = State.of(eff.to)
        if eff.tier is False and slot.host_current:   # the slower tier's copy is forgotten
            ctx.tier.discard(slot.key)
        if eff.tier is not None:
            slot.host_current = eff.tier
        if op is not Op.SWAP_IN and eff.device:
            self._account(eff.device * slot.nbytes)

    def _start_out(self, slot: Slot) -> None:
        sl.start_swap_out(slot, self.ctx.tier)
        self._trace_transfer(slot, "swap-out")

    def _trace_transfer(self, slot: Slot, track: str) -> None:
        """Put the transfer on the timeline from issue to completion (the I/O threads do it,
        so only their completion callback knows when it ended)."""
        future = slot.future
        if future is None or not hasattr(future, "add_done_callback"):
            return
        t0, name, events = time.perf_counter(), f"{track} {slot.name}", self.events
        future.add_done_callback(lambda _: events.append((track, name, t0, time.perf_counter())))

    def _swap_in(self, slot: Slot, where: int) -> None:
        try:
            sl.start_swap_in(slot, self.ctx.tier, self.ctx.pool)
        except OutOfBudget as exc:
            error = OutOfBudget(
                f"op {where} ({self._name(where)}): swapping in {slot.name} ({format_size(slot.nbytes)}, "
                f"{slot.nbytes} B) does not fit the {format_size(self.ctx.budget)} pool: {exc}")
            if self.planned:
                raise error from None
            # On demand (no plan yet, or a diverged step) the bytes are needed now: take them
            # outside the pool, finish the step, and fail it at its end with the plan's verdict
            # (BudgetTooSmall with the minimum) or this error.
            if self.overflow is None:
                self.overflow = error
            sl.start_swap_in(slot, self.ctx.tier, _Unbudgeted(self.ctx.device))
        self._trace_transfer(slot, "swap-in")

    def _free(self, slot: Slot) -> None:
        """Give a dead variable's device bytes back (the table allows resident or host only)."""
        if slot.state is State.RESIDENT:
            if not slot.in_place:
                slot.storage = None
            elif slot.storage is not None and slot.storage.resizable():
                # A gradient dead for the rest of the step (the plan frees only variables that
                # are not live-out and never used again): give its bytes back now. Otherwise
                # p.grad keeps them until zero_grad, and every gradient of the model piles up
                # through the optimizer step, outside the budget.
                slot.storage.resize_(0)

    def _name(self, i: int) -> str:
        if self.schedule is not None and i < len(self.schedule.sequence.functions):
            return self.schedule.sequence.functions[i].name
        return self.rec.names[i] if i < len(self.rec.names) else "end of step"

    # -- the per-op protocol -----------------------------------------------------------------

    def before(self, i: int) -> None:
        """Run the plan's actions before op ``i`` once (from unpack or from the op itself)."""
        if self.done_before >= i:
            return
        self.done_before = i
        if self.planned and i < len(self._before) and self._before[i]:
            self.run_actions(self._before[i], i)

    def ensure(self, slot: Slot, i: int, keep: set | tuple = ()) -> None:
        """Make ``slot`` usable for op ``i``; if the plan did not, the step has diverged.
        On demand, room is made first, evicting nothing in ``keep`` (the op's other inputs)."""
        if slot.state is State.RESIDENT:
            if not self.planned:
                self._touch(slot)
            return
        if self.planned:
            self._diverge(i, f"{slot.name} is {slot.state.value} at its use")
        if slot.state is State.OUT:
            if not slot.in_place:
                return  # the engine still holds the source: reading it while it is written is safe
            self._timed("wait", f"wait_out {slot.name}", sl.finish_swap_out, slot)
            self._account(-slot.nbytes)
        self._touch(slot)
        if slot.state is State.HOST:
            self._make_room_for(slot.nbytes, keep, i, f"swapping in {slot.name}")
            self._account(slot.nbytes)
            self._swap_in(slot, i)
            self.ctx.counters["bytes_in"] += slot.nbytes
        if slot.state is State.IN:
            self._timed("wait", f"swap_in {slot.name}", sl.finish_swap_in, slot)
            self._register(slot)

    def _diverge(self, i: int, why: str) -> None:
        """Stop following the plan: the rest of the step runs on demand, the next re-plans."""
        if self.planned:
            # A fresh plan's first run often meets what its recording step could not see
            # (optimizer state the optimizer creates on its first step): routine, say it
            # quietly. A plan that ran before and now diverges is worth a warning.
            level = logging.WARNING if self.ctx.plan_runs else logging.INFO
            log.log(level, "step diverged from its plan at op %d (%s): %s; finishing on demand, "
                    "re-planning next step", i, self._name(i), why)
            self.planned = False
            self.diverged_at = i
            self.gpu_timing = self.ctx.device.type == "cuda"
            self.recent = {s: None for s in self.slots.values()
                           if s.state in (State.RESIDENT, State.IN, State.OUT)}
            for slot in self.slots.values():   # on demand keeps no activation it need not
                if (not slot.in_place and slot.state is State.RESIDENT and not slot.host_current
                        and slot not in self.held):
                    self._write_out(slot)

    def on_op(self, func, args, kwargs) -> Any:
        """Op ``i`` as the module docstring says. Most ops of a planned step touch no managed
        storage and have no plan action: that path is a few dict lookups per tensor (what it
        costs: benchmarks/results/overhead.md)."""
        own_pack = self._own_pack
        if own_pack is not None and top_saved_tensors_hooks is not None and torch.is_grad_enabled():
            top = top_saved_tensors_hooks(False)   # only where autograd may save tensors
            if top is not None and top[0] is not own_pack:
                check_hooks_inside(own_pack)
        info = _OPS.get(id(func))
        if info is None or info.func is not func:
            info = op_info(func)
        if info.lists is not None:
            pieces = split_foreach(info, args, kwargs, self.slot_of)
            if pieces is not None:   # one list entry at a time: see split_foreach
                outs = [self.on_op(func, a, k) for a, k in pieces]
                return None if outs[0] is None else [t for out in outs for t in out]
        if self._pool_excess is not None:
            excess = self._pool_excess()
            if excess:   # the last op's allocations met the pool's idle chunks: shed them
                self.ctx.pool.trim(excess)
        rec = self.rec
        i = rec.begin_op(info.name)
        self.i = i
        if self.unpacked:
            for var in self.unpacked:
                rec.use(i, var, Access.READ)
            self.unpacked.clear()
        self.ops_since_unpack += 1
        if self.planned:
            expected = self._plan_names[i] if i < len(self._plan_names) else None
            if expected != info.name:
                self._diverge(i, f"expected {expected}, got {info.name}")
        if self.done_before < i:   # before(i), inline: most ops have no action before them
            self.done_before = i
            if self.planned and i < len(self._before) and self._before[i]:
                self.run_actions(self._before[i], i)
        if self.fresh:
            self._prune_fresh()
        ins = info.inputs(args, kwargs)
        written_tensors = info.written(args, kwargs) if info.writes else ()
        written = {id(t.untyped_storage()) for t in written_tensors} if written_tensors else ()
        touched: list[Slot] = []
        keep: set[Slot | Birth] = set()   # what op i uses: on demand, never evicted for it
        in_ids = set()
        taken_back: list[tuple[Slot, torch.UntypedStorage]] = []
        by_storage, births = self.by_storage, rec.births
        rollback = self.rollback
        buffers = rollback.buffers if rollback.undo is not None else None
        for t in ins:
            s = t.untyped_storage()
            key = id(s)
            in_ids.add(key)
            slot = by_storage.get(key)
            if slot is not None and slot.storage is s:
                rec.use(i, slot.var, Access.READ)
                touched.append(slot)
            elif s._cdata in births:
                b = rec.live_birth(s)
                if b is not None:
                    if b.var is None:
                        b.reads.append(i)      # replayed if it becomes managed later
                        if key in written:
                            b.writes.append(i)
                        if b in self.fresh:
                            keep.add(b)
                            self._touch(b)
                    else:
                        rec.use(i, b.var, Access.READ)   # managed; the engine let go of it
                        slot = self.slots.get(b.var)
                        if key in written and slot is not None and slot.state is not State.ABSENT:
                            touched.append(slot)
                            taken_back.append((slot, s))
        if touched:
            keep.update(touched)
            for slot in touched:
                self.ensure(slot, i, keep)
        for slot, s in taken_back:
            self._take_back(slot, s, i)
        if buffers:   # copied before the step's first op that uses them, for a rollback
            for key in in_ids & buffers.keys():
                rollback.save_before_write(key)
        for t in written_tensors:
            slot = self.slot_of(t)
            if slot is not None:
                slot.host_current = False
                rec.use(i, slot.var, Access.WRITE)
        gpu_timing = self.gpu_timing
        if gpu_timing:
            cuda = cuda_runtime()   # torch.cuda.Event, or host timing under the fake
            start, end = cuda.timing_event(), cuda.timing_event()
            start.record()
        t0 = time.perf_counter()
        out = func(*args, **kwargs) if kwargs else func(*args)
        t1 = time.perf_counter()
        rec.seconds[i] = t1 - t0
        if self.full is not None and not info.skip:
            self.full.op(info, args, kwargs, out, info.name, t1 - t0)
        if gpu_timing:
            end.record()
            self.gpu_events.append((i, start, end))
        self.events.append(("compute", info.name, t0, t1))
        tracked = set() if not self.planned and self._tracking() else None
        min_bytes = self.ctx.min_bytes
        for k, t in enumerate((out,) if isinstance(out, torch.Tensor) else _tensors(out)):
            s = t.untyped_storage()
            key = id(s)
            if key in in_ids:
                continue
            nbytes = s.nbytes()
            if nbytes >= min_bytes:
                if t.is_meta:
                    continue
                b = rec.birth(s, i, k, nbytes)
                var = self.binding.get((i, k)) if self.planned else None
                if var is not None:
                    self._bind_born(var, s, nbytes, i)
                elif tracked is not None and key not in tracked:   # once per storage
                    tracked.add(key)
                    keep.add(self._track_fresh(b, keep, i))
            elif self.small_born is not None and not t.is_meta:
                self.small_born[key] = nbytes
        self.after(i, touched)
        return out

    def book_device_times(self) -> None:
        """Replace the recorded ops' launch times by their run times on the GPU (one host
        synchronization, at the end of a step the engine plans from)."""
        if self.ctx.device.type != "cuda":
            return
        if self.diverged_at is not None and self.schedule is not None:
            # The ops before the divergence ran planned, untimed: they are the plan's ops,
            # whose run times its own recording step measured.
            functions = self.schedule.sequence.functions
            for i in range(min(self.diverged_at, len(functions))):
                if functions[i].cost.seconds is not None:
                    self.rec.seconds[i] = functions[i].cost.seconds
        if not self.gpu_events:
            return
        self.gpu_events[-1][2].synchronize()
        for i, start, end in self.gpu_events:
            self.rec.seconds[i] = start.elapsed_time(end) / 1e3
        self.gpu_events.clear()

    def _take_back(self, slot: Slot, s: torch.UntypedStorage, i: int) -> None:
        """Op ``i`` writes in place into the storage activation ``slot`` was born in, after the
        engine let go of it (wrote it out; maybe read a copy back into the pool). The forward
        still holds that storage (ResNet's ``out += identity; relu_(out)`` before autograd
        saves ``out``), so the op's bytes land there, not in the engine's copies: the slot
        takes the storage back, drops its copy in memory (same bytes until now) and forgets
        the tier's, which goes stale. Else unpack hands the backward the pre-write bytes."""
        if slot.storage is s:
            return   # the storage appears twice among the op's arguments
        if slot.state is State.OUT:   # its copy is being written out (ensure leaves that to run)
            self._timed("wait", f"wait_out {slot.name}", sl.finish_swap_out, slot)
        if slot.host_current:
            self.ctx.tier.discard(slot.key)
            slot.host_current = False
        slot.storage = s   # counted as resident already: it replaces the copy, or the copy in flight
        slot.state = State.RESIDENT
        self._register(slot)

    def roll_back(self) -> str | None:
        """Take back what the failed step did to the model (``StepRollback.roll_back``)."""
        return self.rollback.roll_back()

    def _bind_born(self, var: int, s: torch.UntypedStorage, nbytes: int, i: int) -> None:
        v = self.schedule.sequence.variables[var]
        planned_bytes = -(-nbytes // self.ctx.chunk) * self.ctx.chunk if v.kind is Kind.ACTIVATION else nbytes
        if planned_bytes != v.nbytes:   # same ops, other shapes (a new batch size)
            self._diverge(i, f"op {i} created {nbytes} B where the plan has {v.name} of {v.nbytes} B")
            return
        slot = Slot(var, v.kind, nbytes, v.name, in_place=v.kind is not Kind.ACTIVATION,
                    state=State.RESIDENT, storage=s)
        self._account(nbytes)
        self._register(slot)
        b = self.rec.live_birth(s)
        if b is not None:   # recorded too, in case the step diverges later and is re-planned
            self.rec.promote(b, var, v.kind, v.name)

    def after(self, i: int, touched: list[Slot]) -> None:
        if self.planned:
            if self._after[i]:
                self.run_actions(self._after[i], i, "after")
        else:
            self._on_demand_after(touched)
        if self.resident > self.ctx.budget and self.planned:
            raise OutOfBudget(
                f"op {i} ({self._name(i)}): managed tensors take {format_size(self.resident)} "
                f"({self.resident} B), over the {format_size(self.ctx.budget)} budget")
        self.ctx.pool.reap()

    # -- on demand ---------------------------------------------------------------------------

    def _on_demand_after(self, touched: list[Slot]) -> None:
        """Keep nothing: persistent tensors leave after the op that used them."""
        for slot in dict.fromkeys(touched):
            if slot.in_place and slot.state is State.RESIDENT:
                if slot.host_current:
                    sl.release(slot)
                    slot.state = State.HOST
                    self._account(-slot.nbytes)
                else:
                    self._write_out(slot)
        self._reap_writes(block=False)

    def _write_out(self, slot: Slot) -> None:
        """On demand: start writing ``slot`` out; its bytes count until the write is reaped."""
        self._start_out(slot)
        self.ctx.counters["bytes_out"] += slot.nbytes
        self.in_flight_out.append(slot)

    def adopt(self, slot: Slot, what: str) -> None:
        """A storage of this step becomes managed (a saved activation, a gradient): count its
        bytes, after making room for them on demand."""
        if not self.planned:
            self._make_room_for(slot.nbytes, (), self.i, what)
            self._touch(slot)
        self._register(slot)
        self._account(slot.nbytes)

    def adopt_grad(self, slot: Slot) -> None:
        """A gradient autograd has finished accumulating becomes managed. On demand it is
        written out at once, like a saved activation: its next use is the optimizer step,
        after the rest of the backward, and keeping every gradient until then is what took
        on-demand steps over their budget."""
        self.adopt(slot, f"the gradient {slot.name}")
        if not self.planned:
            self._write_out(slot)
            self._reap_writes(block=False)

    # -- on demand: the budget ----------------------------------------------------------------

    def _touch(self, x: Slot | Birth) -> None:
        """On demand: ``x`` was just used; eviction takes the least recently used first."""
        if not self.planned:
            self.recent.pop(x, None)
            self.recent[x] = None

    def _make_room_for(self, nbytes: int, keep: set | tuple, where: int, what: str) -> None:
        """On demand: make ``nbytes`` fit the budget before they become resident.

        If evicting everything that may go still leaves too little (op ``where``'s own
        tensors exceed the budget), the step carries on over the budget, counted as such
        (``peak``), and fails at its end with ``overflow`` or the plan's BudgetTooSmall: an
        unplanned step cannot take back an op half done, but it must not hide the excess.
        """
        if self._make_room(nbytes, keep):
            return
        why = (f"what it cannot do without already takes {format_size(self.resident)} "
               f"({self.resident} B: {self._kept_names()})" if self.resident else "alone it is larger")
        error = OutOfBudget(
            f"op {where} ({self._name(where)}): {what} ({format_size(nbytes)}, {nbytes} B) does "
            f"not fit the {format_size(self.ctx.budget)} budget: {why}; raise the budget to at "
            f"least {format_size(self.resident + nbytes)}")
        if self.overflow is None:
            log.warning("%s", error)
            self.overflow = error

    def _make_room(self, nbytes: int, keep: set | tuple) -> bool:
        """Evict until ``nbytes`` more fit the budget; False if they cannot.

        The victims are the scheduler's choice (``scheduler.on_demand.choose_victims``) among
        the managed tensors the op does not use (``keep``) and the running backward node does
        not hold (``held``), in the order ops last used them. Carrying it out: finished writes
        are reaped, a write in flight is waited for, a tensor the slower tier holds is
        released, any other is written out and waited for (the waits count as stall).
        """
        budget = self.ctx.budget
        if self.resident + nbytes <= budget:
            return True
        self._reap_writes(block=False)
        held = self.held
        victims = on_demand.choose_victims(self.recent, self.resident + nbytes - budget, self._evictable_bytes,
                                           lambda x: x in keep or x in held)
        for x in victims:
            del self.recent[x]
            if isinstance(x, Birth):
                self._evict_fresh(x)
            else:
                self._evict(x)
        return self.resident + nbytes <= budget

    def _evictable_bytes(self, x: Slot | Birth) -> int:
        """The bytes evicting ``x`` gives back (0 for an entry already gone)."""
        if isinstance(x, Birth):
            return x.nbytes if x in self.fresh else 0
        return x.nbytes if x.state in (State.RESIDENT, State.IN, State.OUT) else 0

    def _evict(self, slot: Slot) -> None:
        """Give a slot's memory back: wait for its write in flight, release it if the slower
        tier holds its bytes, else write it out and wait."""
        if slot.state is State.IN:
            self._timed("wait", f"swap_in {slot.name}", sl.finish_swap_in, slot)
        if slot.state is State.RESIDENT and slot.host_current:
            sl.release(slot)
            slot.state = State.HOST
            self._account(-slot.nbytes)
            return
        if slot.state is State.RESIDENT:
            self._start_out(slot)
            self.ctx.counters["bytes_out"] += slot.nbytes
        if slot.state is State.OUT:
            self._timed("wait", f"evict {slot.name}", sl.finish_swap_out, slot)
            self._account(-slot.nbytes)

    def _kept_names(self) -> str:
        """What stayed resident after evicting all that could go, for an overflow message."""
        names = [x.name if isinstance(x, Slot) else f"{self.rec.names[x.op]}#{x.op}"
                 for x in self.recent if self._evictable_bytes(x)]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    # -- on demand: the optimizer's new storages ---------------------------------------------

    def _tracking(self) -> bool:
        """Whether new storages count as managed from birth: on demand, during the optimizer
        step, with its state managed. The optimizer creates its state there (Adam all of it
        before its first update; SGD's momentum buffers join ``optimizer.state`` only when
        ``step()`` returns), and it is managed memory the budget must hold from the start."""
        return (not self.planned and self.rec.optimizer_start is not None
                and "optimizer_state" in self.ctx.manage)

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
                sl.start_swap_in(slot, self.ctx.tier, _Unbudgeted(self.ctx.device))
                sl.finish_swap_in(slot)
                self.ctx.counters["bytes_in"] += slot.nbytes

    def _reap_writes(self, block: bool) -> None:
        """Finish on-demand writes, oldest first; block while too many bytes are in flight."""
        limit = on_demand.in_flight_limit(self.ctx.budget)
        while self.in_flight_out:
            slot = self.in_flight_out[0]
            if slot.state is not State.OUT:
                self.in_flight_out.pop(0)
                continue
            in_flight = sum(s.nbytes for s in self.in_flight_out)
            if not (block or slot.future.done() or in_flight > limit):
                break
            self.in_flight_out.pop(0)
            self._timed("wait", f"wait_out {slot.name}", sl.finish_swap_out, slot)
            self._account(-slot.nbytes)

    def saved_sizes(self) -> list[int] | None:
        """Bytes of every distinct storage born in this step that autograd saved, managed or
        not; None unless the step observed them (``observe_small``)."""
        if self.small_born is None:
            return None
        managed = [v.nbytes for v in self.rec.variables.values() if v.kind is Kind.ACTIVATION]
        return managed + list(self.small_saved.values())

    # -- autograd hooks ----------------------------------------------------------------------

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks through which this step manages saved activations. Remembers its pack
        hook: an op that finds other hooks innermost (``save_on_cpu`` entered inside the
        step) is refused, since the activations saved under them would bypass the engine."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._own_pack = hooks.pack_hook
        return hooks

    def pack(self, t: torch.Tensor) -> Any:
        if self.planned:
            # A planned step only looks its storage up: no op runs, so the dispatch modes
            # need not be taken off the stack and put back (what most of the time went to).
            s = t.untyped_storage()
            slot = self.by_storage.get(id(s))
            if slot is None or slot.storage is not s:
                b = self.rec.births.get(s._cdata)
                if b is None or b.var is None:
                    return t   # not managed in this step: _pack returns it as it is too
            elif slot.kind is not Kind.ACTIVATION or isinstance(t, torch.nn.Parameter) or t.is_meta:
                return t
            else:
                return Packed(slot, t)
        full = self.full
        if full is None:
            with _disable_current_modes():
                return self._pack(t)
        full.saved(t)
        with _disable_current_modes():
            p = self._pack(t)
        if isinstance(p, Packed):   # unpack brings it back in another storage: same variable
            var = full.var(t)
            if var is not None:
                self.full_vars.setdefault(p.slot.var, var)
        return p

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        slot = self.slot_of(t)
        if slot is None:
            s = t.untyped_storage()
            b = self.rec.live_birth(s)
            if b is not None and b.var is not None and b.var in self.slots:
                slot = self.slots[b.var]   # saved again after the engine let go of its bytes
                return Packed(slot, t) if slot.kind is Kind.ACTIVATION else t
            if b is None or self.planned:
                if b is None and self.small_born is not None and id(s) in self.small_born:
                    self.small_saved[id(s)] = self.small_born[id(s)]
                return t   # not born in this step (input, buffer), too small, or not in the plan
            var = self.ctx.new_var()
            name = f"{self.rec.names[b.op]}#{b.op}"
            self.rec.promote(b, var, Kind.ACTIVATION, name)
            slot = Slot(var, Kind.ACTIVATION, b.nbytes, name, in_place=False,
                        state=State.RESIDENT, storage=s)
            self.adopt(slot, f"the saved activation {name}")
        if slot.kind is not Kind.ACTIVATION:
            return t
        if not self.planned and slot.state is State.RESIDENT and not slot.host_current:
            self._write_out(slot)     # on demand: write it out at once
        return Packed(slot, t)

    def close_node(self) -> None:
        """The backward node that unpacked ``node_vars`` has returned by the time the next
        node unpacks: autograd held those tensors until then, so they count as used up to
        the last op that ran (the plan must not give their memory back earlier)."""
        last = len(self.rec.names) - 1
        if last >= 0:
            for var in self.node_vars:
                self.rec.use(last, var, Access.READ)
        self.node_vars.clear()
        self.ops_since_unpack = 0
        if not self.planned:
            self._release_held()
        self.held.clear()

    def _release_held(self) -> None:
        """On demand: the node's unpacked activations count until it returns (autograd held
        them); then their bytes go back, the slower tier keeps a copy."""
        for slot in self.held:
            if slot.kind is Kind.ACTIVATION and slot.state is State.RESIDENT and slot.host_current:
                sl.release(slot)
                slot.state = State.HOST
                self._account(-slot.nbytes)

    def unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, Packed):
            return p
        with _disable_current_modes():
            return self._unpack(p)

    def _unpack(self, p: Packed) -> torch.Tensor:
        nxt = len(self.rec.names)          # the unpacked tensor is used by the next op
        if self.ops_since_unpack:
            self.close_node()
        self.before(nxt)
        slot = p.slot
        self.unpacked.append(slot.var)
        self.node_vars.append(slot.var)
        self.ensure(slot, nxt)
        # On demand keeps nothing, but the tensor handed to autograd holds the bytes as long
        # as the backward node runs: they count until it returns (close_node releases them).
        self.held[slot] = None
        if self.full is not None and slot.var in self.full_vars:
            self.full.alias(slot.storage, self.full_vars[slot.var])
        return torch.empty(0, dtype=p.dtype, device=slot.storage.device).set_(
            slot.storage, p.offset, p.size, p.stride)
