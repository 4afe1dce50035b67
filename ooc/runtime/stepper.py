"""Running one training step: every aten op passes through here.

The step is a sequence of functions (aten ops, as a ``TorchDispatchMode`` sees them, forward,
backward and optimizer alike). Op i runs as:

1. the schedule's actions *before* op i (swap-in, wait for swap-in, wait for swap-out);
2. a residency check of every managed storage op i touches (a mismatch with the plan is a
   divergence: the rest of the step runs on demand, and the engine re-plans);
3. op i itself, timed;
4. the schedule's actions *after* op i (swap-out, drop, free), and the binding of the
   variables op i created to their plan ids.

A planned op the plan gives no role (most: ``schedule.quiet_functions``) is run and recorded.
Autograd's unpack hook for the node about to run happens *before* that node's first op,
so unpack runs step 1 early for the next op: nothing else happens in between.

Two ways to run: ``planned`` executes a checked ``Schedule``; ``on demand`` (a step with no plan,
the rest of a diverged one) keeps only what it needs, each use brought back at once.

The ``Stepper`` is composed of parts, each with its own state, given what it needs when it is
made (never the ``Stepper``: a finished step is garbage at once, with no reference cycle).
Where each part lives, in the order a step meets them:

- ``step_context.py``: what the step gets from the engine (budget, chunk, tier, pool, ...);
- ``step_book.py``: what every part shares: ``Course`` (on its plan or not) and ``StepBook``;
- this module: the per-op protocol above (``Stepper.on_op``) and divergence;
- ``saved_tensors.py``: autograd's pack and unpack hooks (``Packed``);
- ``executor.py``: the plan's actions (``scheduler.actions``), moved by the slots (``slots.py``);
  ``recompute.py``: discard and recompute, ``templates.py`` the chains' templates for the
  anchored form; ``binding.py``: the storages born in the step bound to the plan's variables;
- ``on_demand_room.py``: on demand, room within the budget (``scheduler.on_demand``'s
  choices); ``fresh_storages.py``: the optimizer's new storages there;
- ``step_recording.py``: what the engine plans the next steps from;
- ``rollback.py``: taking back a step that failed before its update.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ooc.record.managed import Birth, Recording, current_node
from ooc.record.op_schema import _OPS, op_info, split_foreach, tensors as _tensors
from ooc.record.storages import storage_of
from ooc.runtime.binding import Binding
from ooc.runtime.composition import check_hooks_inside, top_saved_tensors_hooks
from ooc.runtime.executor import PlanExecutor
from ooc.runtime.fresh_storages import FreshStorages
from ooc.runtime.on_demand_room import OnDemandRoom
from ooc.runtime.recompute import Recomputation
from ooc.runtime.rollback import StepRollback
from ooc.runtime.saved_tensors import Packed, SavedTensors
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from ooc.runtime.step_recording import StepRecording
from scheduler.ir import Access
from scheduler.schedule import Schedule
from vmm.errors import OutOfBudget
from vmm.units import format_size

__all__ = ["Packed", "StepContext", "Stepper"]

log = logging.getLogger(__name__)
_ITEM = torch.ops.aten._local_scalar_dense.default   # ``.item()``, ``int(t)``, ``float(t)``


def _part(part: str, name: str, doc: str) -> property:
    """A read-only attribute of the ``Stepper`` that is a part's (``st.peak``, ``st.hand_back``)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Stepper:
    """One training step, run op by op over its parts; made by the engine for each step from
    a ``StepContext`` (it never sees the engine).

    Its protocol with the engine (``ooc/engine/``, ``step_forms.py``), all it may use:

    - driving it: ``on_op`` (from its dispatch mode), ``saved_tensors_hooks``, ``adopt_grad_of`` (its
      grad hook), ``close_node``, ``forgive_overflow``, ``wait_for_transfers``, ``update_starts``/
      ``update_done`` (its optimizer hooks); at the step's end ``writes_settled``, ``rollback.roll_back``,
      ``live_slot``, ``rename``, ``hand_back``, ``mark_live_out``, ``hold_unread``,
      ``book_device_times``, ``saved_sizes``, ``whole_recording``; ``slot_of``; until the model's
      forward shows its shape, ``wait_for_shape``, then ``quiet``, ``leave_plan``, ``resume``, ``end_wait``;
    - reading it: ``schedule``, ``start_key`` (its plan, None on demand; the state it started in, the
      engine's key for plans); ``planned``, ``diverged_at``, ``refused``; ``rec`` (its ``Recording``);
      ``slots`` (var -> ``Slot``); ``overflow`` (an on-demand need the pool could not meet: the step
      fails with it); ``peak``, ``stall_s``, ``events``; ``updating`` (inside ``optimizer.step()``);
      ``signature``, ``hook_trace``, ``templates()`` (for the plain and anchored forms of the next steps).

    Its parts: ``course``, ``book``, ``recording``, ``recompute``, ``plan``, ``fresh``, ``room``,
    ``binder``, ``saved``, ``rollback``.
    """

    planned = _part("course", "planned", "Still following the plan.")
    diverged_at = _part("course", "diverged_at", "The op where the step left its plan, or None.")
    refused = _part("course", "refused", "The plan action the transition table refused, or None.")
    overflow = _part("book", "overflow", "An on-demand need the pool could not meet, or None.")
    peak = _part("book", "peak", "The most managed device bytes the step held.")
    stall_s = _part("book", "stall_s", "Seconds the step blocked on transfers.")
    slot_of = _part("book", "slot_of", "The slot of a tensor's storage, if managed.")
    forgive_overflow = _part("book", "forgive_overflow", "Forget the overflow; returns it.")
    wait_for_transfers = _part("plan", "wait_for_transfers", "The commit point's wait.")
    adopt_grad_of = _part("room", "adopt_grad_of", "Manage a gradient autograd accumulated.")
    writes_settled = _part("room", "writes_settled", "No on-demand write is in flight any more.")
    close_node = _part("saved", "close_node", "The running backward node returned.")
    wait_for_shape = _part("binder", "wait_for_shape", "No plan checked or bound until end_wait.")
    hold_unread = _part("saved", "hold_unread", "Saved, never unpacked, held by a backward: live out.")
    saved_sizes = _part("saved", "saved_sizes", "Sizes autograd saved (adaptive chunk).")
    rename = _part("fresh", "rename", "Name a variable adopted before it had one.")
    hand_back = _part("fresh", "hand_back", "Bring back new storages that are not state.")
    live_slot = _part("recording", "live_slot", "A slot for a storage that outlives the step.")
    mark_live_out = _part("recording", "mark_live_out", "Record what outlives the step.")
    book_device_times = _part("recording", "book_device_times", "Ops' run times on the GPU.")
    whole_recording = _part("recording", "whole_recording", "The step as ooc.trace records it.")
    templates = _part("recompute", "built_templates", "Its chains' templates (templates.py), or None.")

    def __init__(self, ctx: StepContext, schedule: Schedule | None, binding: dict, *,
                 observe_small: bool = False) -> None:
        self.ctx, self.start_key, self.schedule = ctx, ctx.start_key, schedule
        self.rec = rec = Recording()
        self.course = course = Course(schedule, rec)
        self.book = book = StepBook(ctx)
        self.slots, self.events = book.slots, book.events   # the engine reads them (never rebound)
        self.done_before, self.updating = -1, False   # last op whose before-actions ran; inside optimizer.step()
        # What a rollback needs if the step fails before its optimizer step (rollback.py).
        self.rollback = StepRollback(ctx.model, copy_all=bool(ctx.quiet_ops))   # a quiet op may write one
        persistent = list(ctx.persistent)
        for slot in persistent:
            book.register(slot)
            rec.add_persistent(slot.var, slot.nbytes, slot.kind, slot.name, live_out=True)
            if slot.state in (State.RESIDENT, State.IN, State.OUT):
                book.resident += slot.nbytes
        book.peak = book.resident   # the engine brought the start within the budget (_reconcile)
        self.recording = StepRecording(ctx, rec, course, book)
        self.recompute = Recomputation(ctx, book, course, rec)
        self.plan = PlanExecutor(ctx, book, course, self.recompute)
        self.fresh = FreshStorages(ctx, book, rec)
        self.room = OnDemandRoom(ctx, book, course, rec, self.fresh, self.recompute, persistent)
        self.binder = Binding(ctx, book, course, rec, binding)
        self.saved = SavedTensors(ctx, book, course, rec, self.recording.full, self.room, observe_small, self._diverge)
        self.signature, self.hook_trace = self.saved.signature, self.saved.hook_trace

    # -- the per-op protocol (each op's Python calls are the overhead: test_op_cost.py) -------

    def on_op(self, func, args, kwargs) -> Any:
        """Op ``i`` as the module docstring says; of a planned step, one the plan gives no role
        (most of them: ``scheduler.schedule.quiet_functions``) is only run and recorded."""
        own_ref = self.saved.own_pack   # other hooks innermost (save_on_cpu inside the step)?
        if own_ref is not None and top_saved_tensors_hooks is not None and torch.is_grad_enabled():
            top = top_saved_tensors_hooks(False)   # only where autograd may save tensors
            if top is not None and top[0] is not (own := own_ref()):
                check_hooks_inside(own)   # refused: what they save would bypass the engine
        info = _OPS.get(id(func))
        if info is None or info.func is not func:
            info = op_info(func)
        if info.lists is not None:
            pieces = split_foreach(info, args, kwargs, self.book.slot_of)
            if pieces is not None:   # one list entry at a time: see split_foreach
                outs = [self.on_op(func, a, k) for a, k in pieces]
                return None if outs[0] is None else [t for out in outs for t in out]
        i, course, saved = len(self.rec.names), self.course, self.saved
        if func is _ITEM and self.recompute.templates is not None:   # a number read out of a tensor
            self.recompute.templates.read_out(i, args[0])
        if i in self.ctx.quiet_ops and course.planned and not course.waiting and course.names[i] == info.name:
            if saved.unpacked or saved.node_vars or not (info.view or saved.worked):   # as _take does
                saved.op_ran(i, info.view, current_node() is None)
            return self.recording.quiet_op(info, func, args, kwargs)
        i, uses = self._take(info, args, kwargs)     # 1-2. actions before it; what it uses, usable
        recording, recompute = self.recording, self.recompute   # 3. the op itself, timed
        timing = recording.start_timing() if recording.gpu_timing else None
        recipe = course.planned and (course.waiting or i in recompute.recipe_ops)   # capture it for a chain
        rng = recompute.rng_before(info) if recipe else None
        t0 = time.perf_counter()
        out = func(*args, **kwargs) if kwargs else func(*args)
        t1 = time.perf_counter()
        self.rec.seconds[i] = t1 - t0
        if recording.full is not None or timing is not None:
            recording.op_ran(i, info, args, kwargs, out, t1 - t0, timing)
        self.book.events.append(("compute", info.name, t0, t1))
        self._give(info, func, args, kwargs, out, i, uses, rng if recipe else False)   # 4. after it
        return out

    def _take(self, info, args, kwargs) -> tuple[int, tuple]:
        """Op ``i`` begins: checked against the plan, its actions before it run, what it uses made
        usable, what it writes taken back or marked stale, buffers copied for a rollback. Returns
        ``i`` and (inputs, their storages' ids, written tensors, theirs, touched slots, kept)."""
        rec, course, book, saved = self.rec, self.course, self.book, self.saved
        course.i = i = rec.begin_op(info.name)
        if saved.unpacked or saved.node_vars or not (info.view or saved.worked):   # see op_ran
            saved.op_ran(i, info.view, rec.nodes[i] is None)
        if course.planned and not course.waiting:   # a step that waits for its shape: binding.py
            expected = course.names[i] if i < len(course.names) else None
            if expected != info.name:
                self._diverge(i, f"expected {expected}, got {info.name}")
        if self.done_before < i:   # before(i), inline: most ops have no action before them
            self.done_before = i
            if course.planned and i < len(course.before) and course.before[i]:
                self.run_actions(course.before[i], i)
        fresh = self.fresh.fresh
        if fresh or (self.updating and self.fresh.adopted):   # (a planned step adopts none)
            self.room.prune_fresh(self.updating)
        ins = info.inputs(args, kwargs)
        written_tensors = info.written(args, kwargs) if info.writes else ()
        written = {id(s) for t in written_tensors if (s := storage_of(t)) is not None} if written_tensors else ()
        touched: list[Slot] = []
        keep: set[Slot | Birth] = set()
        in_ids = set()
        taken_back: list[tuple[Slot, torch.UntypedStorage]] = []
        by_storage, births = book.by_storage, rec.births
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
            elif s._cdata in births and (b := rec.live_birth(s)) is not None:
                if b.var is None:
                    b.reads.append(i)      # replayed if it becomes managed later
                    rec.anonymous_reads.append((i, b))
                    if key in written:
                        b.writes.append(i)
                    if b in fresh:
                        keep.add(b)
                        self.room.touch(b)
                else:
                    rec.use(i, b.var, Access.READ)   # managed; the engine let go of it
                    slot = book.slots.get(b.var)
                    if key in written and slot is not None and slot.state is not State.ABSENT:
                        touched.append(slot)
                        taken_back.append((slot, s))
        if touched:
            keep.update(touched)
            for slot in touched:
                self.ensure(slot, i, keep)
        for slot, s in taken_back:
            self.binder.take_back(slot, s)
        rollback = self.rollback
        if rollback.undo is not None and rollback.buffers:   # copied before the first op that uses them
            for key in in_ids & rollback.buffers.keys():
                rollback.save_before_write(key)
        for t in written_tensors:
            slot = book.slot_of(t)
            if slot is not None:
                slot.written()
                rec.use(i, slot.var, Access.WRITE)
        return i, (ins, in_ids, written_tensors, written, touched, keep)

    def _give(self, info, func, args, kwargs, out, i: int, uses: tuple, rng) -> None:
        """Op ``i`` ran: what it created bound (planned) or counted from birth (the optimizer's,
        on demand); its replay flags; its capture for a chain (``rng`` False unless one reruns
        it); the plan's actions after it, or on demand what it used leaves."""
        rec, course, book = self.rec, self.course, self.book
        ins, in_ids, written_tensors, written, touched, keep = uses
        tracked = set() if not course.planned and self.fresh.tracking(False, self.updating) else None
        min_bytes, small_born, widened = self.ctx.min_bytes, self.saved.small_born, course.widened
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
            # a planned output at a plan variable is bound at any size (widening.py; an empty one
            # moves nothing), recorded on demand after a widened plan (the next plan keeps it)
            var = self.binder.vars.get((i, k)) if widened or course.planned else None
            if nbytes >= min_bytes or var is not None:
                if t.is_meta or t._is_zerotensor():   # no bytes to move (a ZeroTensor: sgn's grad)
                    continue
                b = rec.birth(s, i, k, nbytes)
                if var is not None and course.planned:
                    why = self.binder.bind(var, s, nbytes, i)
                    if why is not None:
                        self._diverge(i, why)
                elif tracked is not None and key not in tracked:   # once per storage
                    tracked.add(key)
                    keep.add(self.room.track_fresh(b, keep, i))
            elif small_born is not None and not t.is_meta:
                small_born[key] = nbytes
        if not course.planned and not self.updating:   # replay flags; reads of no variable (managed.py)
            rec.outside(i, ins, written_tensors, book.slot_of)
            if info.replay.replayable and not aliased:
                rec.flags[i] = self.recompute.replay_flags(info, args, kwargs, written_tensors)
        if rng is not False:
            self.recompute.capture(i, info, func, args, kwargs, rng, len(outs))
        if course.planned:
            if not course.waiting and course.after[i]:
                self.run_actions(course.after[i], i, "after")
        else:
            self.room.after_op(touched)
        limit = course.bound(i, self.ctx.budget) if course.bounded else self.ctx.budget   # (no call per op else)
        if course.planned and book.resident > limit:
            raise OutOfBudget(f"op {i} ({course.name(i)}): managed tensors take {format_size(book.resident)} "
                              f"({book.resident} B), over the {format_size(limit)} budget")
        self.ctx.pool.reap()

    def before(self, i: int) -> None:
        """Run the plan's actions before op ``i`` once (from an unpack, early)."""
        if self.done_before < i:
            self.done_before = i
            self._act(i, "before")

    def run_actions(self, actions, where: int, phase: str = "before") -> None:
        """The plan's ``actions`` around op ``where``; one the step cannot run makes it diverge."""
        if (why := self.plan.run(actions, where, phase, self.ensure)) is not None:
            self._diverge(where, why)

    def ensure(self, slot: Slot, i: int, keep: set | tuple = ()) -> None:
        """``slot`` usable for op ``i``: the plan made it so, else on demand, keeping ``keep``."""
        if slot.state is State.RESIDENT:
            if not self.course.planned:
                self.room.touch(slot)
            return
        if self.course.planned:
            self._diverge(i, f"{slot.name} is {slot.state.value} at its use")
        self.room.bring_back(slot, i, keep, self.ensure)

    def _diverge(self, i: int, why: str, level: int | None = None) -> None:
        """Stop following the plan: the rest of the step runs on demand, the next re-plans."""
        if not (course := self.course).planned:
            return
        # A fresh plan's first run often meets what its recording could not see: said quietly.
        level = level or (logging.WARNING if self.ctx.plan_runs else logging.INFO)
        log.log(level, "step diverged from its plan at op %d (%s): %s; finishing on demand (the "
                "planner says what the next step runs)", i, course.name(i), why)
        course.planned = course.waiting = False   # on demand: nothing waits for a plan
        course.diverged_at = i
        self.recording.left_plan(i)
        self.room.leave_plan()   # on demand keeps no activation it need not

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The step's saved-tensor hooks (``SavedTensors.hooks``: an unpack runs ``before``, ``ensure``)."""
        return self.saved.hooks(self.before, self.ensure)

    # -- the optimizer step, and another step object taking over ------------------------------

    def update_starts(self) -> None:
        """``optimizer.step()`` begins: its ops are the optimizer phase, past the commit point."""
        self.recording.optimizer_starts()
        self.rollback.commit()
        self.updating = True

    def update_done(self) -> None:
        self.updating = False
        self.fresh.let_go()   # the update's temporaries written out to make room, let go of

    def quiet(self) -> bool:
        """Whether the ops so far left managed memory alone (no managed tensor used, none made but
        while it waits for its shape, no buffer touched, no action, no update): ``resume`` may."""
        rec, course, undo = self.rec, self.course, self.rollback.undo
        if (self.updating or (undo is None if self.ctx.quiet_ops else undo != {}) or any(rec.uses)
                or (rec.births and not course.waiting)):
            return False
        ran = range(min(len(rec.names), len(course.after)))   # the plan's ops run so far
        return not course.planned or not any(course.before[j] or course.after[j] for j in ran)

    def leave_plan(self, why: str) -> None:
        """Stop following the plan before the next op, quietly (the engine knows why)."""
        self._diverge(len(self.rec.names), why, logging.INFO)

    def resume(self, prefix: Stepper) -> None:
        """Take over after ``prefix``'s quiet ops, caught up with (``Binding.bind_born``)."""
        for name, seconds in zip(prefix.rec.names, prefix.rec.seconds):
            self.rec.begin_op(name)
            self.rec.seconds[-1] = seconds
        self.done_before = len(self.rec.names) - 1
        self.course.i = max(self.done_before, 0)
        self.events[:0] = prefix.events
        self.rec.births.update(prefix.rec.births)
        self.end_wait(self.binder.bind_born(self._act), prefix.recompute.recipes)

    def end_wait(self, why: str | None = None, recipes: dict | None = None) -> None:
        """The shape is known and this is the plan: its ops so far caught up with, their captures
        kept for its chains (``Binding.end_wait``, ``Recomputation.adopt``), else (``why``) left."""
        if self.course.waiting or recipes is not None:
            why = why or (self.binder.end_wait(self._act) if self.course.waiting else None)
            self.recompute.adopt(self.recompute.recipes if recipes is None else recipes, self.binder.vars)
        if why is not None and self.course.planned:
            self.leave_plan(why)

    def _act(self, j: int, phase: str) -> None:
        """The plan's actions ``phase`` op ``j`` (``before``, ``after``), caught up with."""
        actions = self.course.before if phase == "before" else self.course.after
        if self.course.planned and j < len(actions) and actions[j]:
            self.run_actions(actions[j], j, phase)
