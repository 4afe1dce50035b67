"""What a step records for the engine to plan the next ones from.

Every step records its ops and the managed variables each one touches (``Recording``); a step
that is not planned also records the whole step with the recorder ``ooc.trace`` uses
(``ooc/record/``). At the step's end the engine asks for: the ops' run times on a GPU, where
the optimizer phase began, which variables outlive the step, the sizes autograd saved (for
the adaptive chunk), and the whole recording.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import scheduler
from ooc.record import roles
from ooc.record.managed import Recording
from ooc.record.op_schema import tensors
from ooc.record.storages import storage_of
from ooc.record.recorder import StepRecorder
from ooc.runtime.devices import cuda_runtime
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from scheduler.ir import Access, Kind


class StepRecording:
    """What a step records beyond its ``Recording``: a step that is not planned also records
    the whole step (``full``, with the recorder ``ooc.trace`` uses: ``engine.last_recording``
    is the step as ``ooc plan`` would plan it; a planned step does not pay for it) and, on a
    GPU, times its ops with CUDA events (``gpu_timing``, ``gpu_events``: an op's host time is
    its launch, not its run): a step not planned, and a planned one whose plan's prices are
    open (``StepContext.time_ops``), quiet ops included."""

    def __init__(self, ctx: StepContext, rec: Recording, course: Course, book: StepBook) -> None:
        self.ctx, self.rec, self.course, self.book = ctx, rec, course, book
        planned = course.planned
        self.gpu_timing = ctx.device.type == "cuda" and (not planned or ctx.time_ops)
        self.gpu_events: list[tuple[int, Any, Any]] = []   # (op, start event, end event)
        self.full: StepRecorder | None = None
        self.skipped: list[int] = []   # ops the whole recording leaves out (``OpInfo.skip``)
        # functions a budget for the whole step keeps the engine's records for, as its first
        # update found them (``ooc.engine.step_budget.check_so_far``)
        self.functions_counted = 0
        if not planned:
            self.full = StepRecorder()
            self.roles = roles.register_persistent(self.full, ctx.model, ctx.optimizer, _sizes_of(book))

    def start_timing(self) -> tuple[Any, Any]:
        """CUDA events around the op about to run (its start recorded now)."""
        cuda = cuda_runtime()   # torch.cuda.Event, or host timing under the fake
        start, end = cuda.timing_event(), cuda.timing_event()
        cuda.keep_busy()   # else the events time the host's launches too (cuda_seam)
        start.record()
        return start, end

    def end_timing(self, i: int, timing: tuple[Any, Any]) -> None:
        """Op ``i`` was queued: its end event now, read at the step's end (``book_device_times``)."""
        timing[1].record()
        self.gpu_events.append((i, *timing))

    def op_ran(self, i: int, info: Any, args: tuple, kwargs: dict, out: Any, seconds: float,
               timing: tuple[Any, Any] | None) -> None:
        """Op ``i`` ran: its CUDA end event queued first, then recorded whole (a step not
        planned). In that order because the end event runs on the device when the host queues
        it: recording the op first (tens of microseconds of Python an op, more on a slow host)
        would leave the device idle between the op's last kernel and the event, and time it."""
        if timing is not None:
            self.end_timing(i, timing)
        if self.full is not None:
            if info.skip:
                self.skipped.append(i)
            else:
                self.full.op(info, args, kwargs, out, info.name, seconds)

    def quiet_op(self, info: Any, func: Any, args: tuple, kwargs: dict) -> Any:
        """The next op, one the plan gives no role (``StepContext.quiet_ops``): run and recorded
        as any planned op is (its name, time and timeline event; its reads and in-place writes
        of storages born in the step, which a chain's ``needs`` and ``Recording.promote`` come
        from when a later op leaves the plan and the step is planned from; the storages it
        makes, which a chain may read: ``recompute.Made``), with none of the per-op path's
        residency checks, rollback copies, bindings and actions (``Stepper._take``/``_give``)."""
        rec = self.rec
        self.course.i = i = rec.begin_op(info.name)
        timing = self.start_timing() if self.gpu_timing else None
        t0 = time.perf_counter()
        out = func(*args, **kwargs) if kwargs else func(*args)
        t1 = time.perf_counter()
        if timing is not None:   # as op_ran: the end event right after the op
            self.end_timing(i, timing)
        rec.seconds[i] = t1 - t0
        self.book.events.append(("compute", info.name, t0, t1))
        births, in_ids, written = rec.births, set(), None
        for x in info.inputs(args, kwargs):   # as Stepper._take, its storage calls inline
            try:
                s = x.untyped_storage()
            except (RuntimeError, NotImplementedError):   # sparse: PyTorch's
                continue
            in_ids.add(id(s))
            if s._cdata in births and (b := rec.live_birth(s)) is not None:
                if b.var is not None:   # managed, though the plan had no use here: noted
                    rec.use(i, b.var, Access.READ)
                    continue
                b.reads.append(i)
                rec.anonymous_reads.append((i, b))
                if info.writes:
                    if written is None:
                        written = {id(w) for t in info.written(args, kwargs) if (w := storage_of(t)) is not None}
                    if id(s) in written:
                        b.writes.append(i)
        min_bytes = self.ctx.min_bytes
        for k, t in enumerate((out,) if isinstance(out, torch.Tensor) else tensors(out)):
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # a sparse result: left to PyTorch
                continue
            if id(s) in in_ids:   # a view, an in-place op: no birth
                continue
            nbytes = s.nbytes()
            if nbytes >= min_bytes and not (t.is_meta or t._is_zerotensor()):
                rec.birth(s, i, k, nbytes)
        return out

    def left_plan(self, i: int) -> None:
        """The step left its plan before op ``i``: the flags of the ops it ran as planned are
        the plan's (recorded the same way), and the rest is timed to be planned from."""
        planned_ops = self.course.schedule.sequence.functions[:i]
        self.rec.flags[:len(planned_ops)] = [(f.replayable, f.rng, f.updates_stats) for f in planned_ops]
        self.gpu_timing = self.ctx.device.type == "cuda"

    def optimizer_starts(self) -> None:
        """``optimizer.step()`` begins: its ops are the optimizer phase."""
        if self.rec.optimizer_start is None:   # a second update in the step: the first one began it
            self.rec.optimizer_start = len(self.rec.names)
            if self.full is not None:
                self.full.phase("optimizer")
                roles.mark_grads(self.full, self.roles)

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
        # (watched tensors' class off: their storages are found, not read back from the tier,
        # which read a VAE's weights and Adam state back at every recording step's end)
        with torch._C.DisableTorchFunctionSubclass():
            roles.mark_grads(self.full, self.roles)   # a step without an update: grads it left
            roles.mark_persistent(self.full, self.roles, self.ctx.optimizer)
        return self.full.sequence({"device": str(self.ctx.device)})

    def book_device_times(self) -> None:
        """Replace the recorded ops' launch times by their run times on the GPU (one host
        synchronization, at the end of a step the engine plans from)."""
        if self.ctx.device.type != "cuda":
            return
        diverged_at, schedule = self.course.diverged_at, self.course.schedule
        if diverged_at is not None and schedule is not None:
            # The ops before the divergence ran planned, untimed: they are the plan's ops,
            # whose run times its own recording step measured.
            functions = schedule.sequence.functions
            for i in range(min(diverged_at, len(functions))):
                if functions[i].cost.seconds is not None:
                    self.rec.seconds[i] = functions[i].cost.seconds
        if not self.gpu_events:
            return
        self.gpu_events[-1][2].synchronize()
        for i, start, end in self.gpu_events:
            self.rec.seconds[i] = start.elapsed_time(end) / 1e3
        self.gpu_events.clear()


def _sizes_of(book: StepBook) -> Callable[[torch.Tensor], int | None]:
    """A managed persistent tensor's size (its storage may be empty: on the tier)."""
    def size(t: torch.Tensor) -> int | None:
        slot = book.slot_of(t)
        return slot.nbytes if slot is not None else None
    return size
