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
nothing it does not need and comes back synchronously at each use, within the budget.

Where each part lives, in the order a step meets them:

- ``step_context.py``: what the step gets from the engine (budget, chunk, tier, pool, ...);
- this module: the step's state and the per-op protocol above (``Stepper.on_op``);
- ``saved_tensors.py``: autograd's pack and unpack hooks (``Packed``);
- ``executor.py``: the plan's actions, as ``scheduler.actions`` defines them;
  ``recompute.py``: discard and recompute (capturing the ops a chain reruns, the replay);
- ``binding.py``: the storages born in the step bound to the plan's variables;
- ``on_demand_room.py``: on demand, room within the budget (victims chosen by
  ``scheduler.on_demand``); ``fresh_storages.py``: the optimizer's new storages there;
- ``step_recording.py``: what the engine plans the next steps from;
- ``rollback.py``: taking back a step that failed before its update.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ooc.record import roles
from ooc.record.managed import Birth, Recording
from ooc.record.op_schema import _OPS, op_info, split_foreach, tensors as _tensors
from ooc.record.recorder import StepRecorder
from ooc.record.storages import storage_of
from ooc.runtime.slots import given_back_error
from ooc.runtime.binding import Binding
from ooc.runtime.composition import check_hooks_inside, top_saved_tensors_hooks
from ooc.runtime.devices import cuda_runtime
from ooc.runtime.executor import PlanExecutor
from ooc.runtime.fresh_storages import FreshStorages
from ooc.runtime.on_demand_room import OnDemandRoom
from ooc.runtime.recompute import Recomputation
from ooc.runtime.rollback import StepRollback
from ooc.runtime.saved_tensors import Packed, SavedTensors
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_context import StepContext
from ooc.runtime.step_recording import StepRecording
from scheduler.ir import Access
from scheduler.schedule import Schedule
from vmm.errors import OutOfBudget
from vmm.units import format_size

__all__ = ["Packed", "StepContext", "Stepper"]

log = logging.getLogger(__name__)


class Stepper(SavedTensors, PlanExecutor, Recomputation, Binding, OnDemandRoom, FreshStorages, StepRecording):
    """The state of one step: op counter, plan cursor, recording, slots by storage.

    Made by the engine for each step from a ``StepContext``; it never sees the engine. The
    engine drives it through methods: ``on_op`` (from its dispatch mode),
    ``saved_tensors_hooks``, ``adopt_grad_of`` (its grad hook), ``close_node``,
    ``forgive_overflow``, ``wait_for_transfers``, ``update_starts``/``update_done`` (its
    optimizer hooks), and at the step's end ``writes_settled``, ``rollback.roll_back``, ``live_slot``,
    ``rename``, ``hand_back``, ``mark_live_out``, ``book_device_times``, ``saved_sizes``,
    ``whole_recording``; ``slot_of`` finds the slot of a tensor; when the model's forward shows
    another shape, ``quiet``, ``leave_plan``, ``resume`` (``step_recording.py``).

    Public attributes the engine reads (never writes):

    - ``schedule``, ``start_key``: the plan the step follows (None on demand) and the state it
      started in (the engine's key for plans);
    - ``planned``: still following the plan; ``diverged_at``: the op where it stopped (None
      if it did not); ``refused``: the plan action the transition table refused, if any;
    - ``rec``: the step's ``Recording`` (ops, managed variables, births), read through its
      own methods to plan the next steps;
    - ``slots``: var -> ``Slot`` of every managed tensor the step knows;
    - ``overflow``: an on-demand need the pool could not meet (the step fails with it);
    - ``peak``, ``stall_s``, ``events``: resident peak, time blocked on transfers, and the
      timeline's (track, name, start, end) events;
    - ``updating``: inside ``optimizer.step()``.
    """

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
        self.resident = 0                       # managed device bytes, as the plan counts them
        self.peak = 0
        self.stall_s = 0.0
        self.events: list[tuple[str, str, float, float]] = []  # (track, name, t0, t1)
        # On a GPU an op's host time is its launch, not its run: a step that will be planned
        # from (recording, on demand) times its ops with CUDA events instead, read at its end.
        self.gpu_timing = ctx.device.type == "cuda" and not self.planned
        self.gpu_events: list[tuple[int, Any, Any]] = []   # (op, start event, end event)
        # What a rollback needs if the step fails before its optimizer step (rollback.py).
        self.rollback = StepRollback(ctx.model)
        self.updating = False   # inside optimizer.step() (between the engine's pre and post hooks)
        persistent = list(ctx.persistent)
        for slot in persistent:
            self._register(slot)
            self.rec.add_persistent(slot.var, slot.nbytes, slot.kind, slot.name, live_out=True)
            if slot.state in (State.RESIDENT, State.IN, State.OUT):
                self.resident += slot.nbytes
        self.peak = self.resident   # the engine brought the start within the budget (_reconcile)
        self._init_room(persistent)
        self._init_fresh()
        self._init_saved()
        self._init_recompute(schedule)
        # A step that is not planned also records the whole step, every storage, with the
        # recorder ``ooc.trace`` uses (ooc/record/): ``engine.last_recording`` is the step as
        # ``ooc plan`` would plan it. A planned step does not pay for it.
        self.full: StepRecorder | None = None
        if not self.planned:
            self.full = StepRecorder()
            self.roles = roles.register_persistent(self.full, ctx.model, ctx.optimizer,
                                                   self._persistent_bytes)
        # A recording step that decides the chunk (the engine's default chunk adapts, see
        # scheduler/chunk_size.py) notes the storages its ops create below the threshold, and
        # which of those autograd saves (``small_saved``): would a smaller chunk manage them?
        self.small_born: dict[int, int] | None = {} if observe_small and not self.planned else None
        # The plan, per op, as lists the per-op path indexes (no attribute chains, no calls).
        functions = schedule.sequence.functions if schedule is not None else ()
        self._plan_names = [f.name for f in functions]
        self._before = schedule.before if schedule is not None else ()
        self._after = schedule.after if schedule is not None else ()

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
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # sparse: no storage, PyTorch's (see on_op)
            return None
        slot = self.by_storage.get(id(s))
        if slot is not None and slot.storage is not s:
            del self.by_storage[id(s)]   # a dead storage's id was reused
            return None
        return slot

    def _account(self, delta: int) -> None:
        self.resident += delta
        self.peak = max(self.peak, self.resident)

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
        if slot.given_back():
            raise given_back_error(slot, f"op {i} ({self._name(i)})")
        if slot.state is State.OUT and not slot.in_place:
            return  # the engine still holds the source: reading it while it is written is safe
        self._touch(slot)
        if slot.state is State.DISCARDED:   # no copy anywhere: its chain re-creates it
            self._make_room_for(slot.nbytes, keep, i, f"recomputing {slot.name}")
            self._account(slot.nbytes)
            self._recompute(slot, self.discarded_for[slot.var], i)
            return

        def account(delta: int) -> None:   # room first, for what the read takes
            if delta > 0:
                self._make_room_for(delta, keep, i, f"swapping in {slot.name}")
            self._account(delta)

        self.ctx.counters["bytes_in"] += slot.bring_back(
            self.ctx.tier, self._pool_for(slot, i), wait=self._wait, account=account,
            started=lambda s: self._trace_transfer(s, "swap-in"))
        self._register(slot)

    def _diverge(self, i: int, why: str, level: int | None = None) -> None:
        """Stop following the plan: the rest of the step runs on demand, the next re-plans."""
        if self.planned:
            # A fresh plan's first run often meets what its recording step could not see
            # (optimizer state the optimizer creates on its first step): routine, say it
            # quietly. A plan that ran before and now diverges is worth a warning.
            level = level or (logging.WARNING if self.ctx.plan_runs else logging.INFO)
            log.log(level, "step diverged from its plan at op %d (%s): %s; finishing on demand, "
                    "re-planning next step", i, self._name(i), why)
            self.planned = False
            self.diverged_at = i
            # The flags of the ops it ran as planned are the plan's (recorded the same way).
            planned_ops = self.schedule.sequence.functions[:i]
            self.rec.flags[:len(planned_ops)] = [(f.replayable, f.rng, f.updates_stats) for f in planned_ops]
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
        own_ref = self._own_pack
        if own_ref is not None and top_saved_tensors_hooks is not None and torch.is_grad_enabled():
            top = top_saved_tensors_hooks(False)   # only where autograd may save tensors
            if top is not None and top[0] is not (own := own_ref()):
                check_hooks_inside(own)
        info = _OPS.get(id(func))
        if info is None or info.func is not func:
            info = op_info(func)
        if info.lists is not None:
            pieces = split_foreach(info, args, kwargs, self.slot_of)
            if pieces is not None:   # one list entry at a time: see split_foreach
                outs = [self.on_op(func, a, k) for a, k in pieces]
                return None if outs[0] is None else [t for out in outs for t in out]
        rec = self.rec
        i = rec.begin_op(info.name)
        self.i = i
        if self.unpacked:
            self.used_unpacked(i)
        if not info.view:   # views are not a node's work: see SavedTensors.used_unpacked
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
        written = {id(s) for t in written_tensors if (s := storage_of(t)) is not None} if written_tensors else ()
        touched: list[Slot] = []
        keep: set[Slot | Birth] = set()   # what op i uses: on demand, never evicted for it
        in_ids = set()
        taken_back: list[tuple[Slot, torch.UntypedStorage]] = []
        by_storage, births = self.by_storage, rec.births
        rollback = self.rollback
        buffers = rollback.buffers if rollback.undo is not None else None
        for t in ins:
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # sparse: nothing to manage, PyTorch's
                continue
            key = id(s)
            in_ids.add(key)
            slot = by_storage.get(key)
            if slot is not None and slot.storage is s:
                rec.use(i, slot.var, Access.READ)
                touched.append(slot)
                if key in written and slot.state is State.OUT and not slot.in_place:
                    taken_back.append((slot, s))   # written while its copy goes out: stale
            elif s._cdata in births:
                b = rec.live_birth(s)
                if b is not None:
                    if b.var is None:
                        b.reads.append(i)      # replayed if it becomes managed later
                        rec.anonymous_reads.append((i, b))
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
                slot.written()
                rec.use(i, slot.var, Access.WRITE)
        gpu_timing = self.gpu_timing
        if gpu_timing:
            cuda = cuda_runtime()   # torch.cuda.Event, or host timing under the fake
            start, end = cuda.timing_event(), cuda.timing_event()
            cuda.keep_busy()   # else the events time the host's launches too (cuda_seam)
            start.record()
        recipe = i in self.recipe_ops and self.planned
        rng = self.rng_before(info, self.ctx.device) if recipe else None
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
        aliased = False   # a result in an input's storage, not written in place (replay.py)
        outs = (out,) if isinstance(out, torch.Tensor) else _tensors(out)
        for k, t in enumerate(outs):
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # a sparse result: left to PyTorch
                continue
            key = id(s)
            if key in in_ids:
                aliased = aliased or key not in written
                continue
            nbytes = s.nbytes()
            if nbytes >= min_bytes:
                if t.is_meta or t._is_zerotensor():   # no bytes to move (a ZeroTensor: sgn's grad)
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
        if not self.planned and not self.updating:   # replay flags; reads of no variable (managed.py)
            rec.outside(i, ins, written_tensors, self.slot_of)
            if info.replay.replayable and not aliased:
                rec.flags[i] = self._replay_flags(info, args, kwargs, written_tensors)
        if recipe:
            self.capture(i, info, func, args, kwargs, rng, len(outs))
        self.after(i, touched)
        return out

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
