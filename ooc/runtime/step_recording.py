"""What a step records for the engine to plan the next ones from.

Every step records its ops and the managed variables each one touches (``Recording``); a step
that is not planned also records the whole step with the recorder ``ooc.trace`` uses
(``ooc/record/``). At the step's end the engine asks for: the ops' run times on a GPU, where
the optimizer phase began, which variables outlive the step, the sizes autograd saved (for
the adaptive chunk), and the whole recording.
"""

from __future__ import annotations

import logging

import torch

import scheduler
from ooc.record import roles
from ooc.runtime.slots import Slot, State
from scheduler.ir import Kind


class StepRecording:
    """The ``Stepper``'s answers about its recording (a mixin over ``rec``, ``full`` and the
    GPU timing events the ``Stepper`` holds)."""

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

    # -- another step object takes over (its shape showed at the model's forward) -------------

    def quiet(self) -> bool:
        """Whether the ops this step ran so far left managed memory alone: no managed tensor
        used, none born, no buffer touched, no plan action run at them, no update begun. A
        step of the same ops on another plan can take over from here (``resume``)."""
        rec = self.rec
        if self.updating or self.rollback.undo != {} or rec.births or any(rec.uses):
            return False
        ran = range(min(len(rec.names), len(self._after)))   # the plan's ops run so far
        return not self.planned or not any(self._before[j] or self._after[j] for j in ran)

    def leave_plan(self, why: str) -> None:
        """Stop following the plan before the next op, quietly (the engine knows why): the
        rest of the step runs on demand and is recorded (``Stepper._diverge``)."""
        self._diverge(len(self.rec.names), why, logging.INFO)

    def resume(self, prefix: "StepRecording") -> None:
        """Take over after ``prefix``'s quiet ops (``quiet``): they are this step's first ops,
        run, their plan actions (none) done."""
        for name, seconds in zip(prefix.rec.names, prefix.rec.seconds):
            self.rec.begin_op(name)
            self.rec.seconds[-1] = seconds
        self.done_before = len(self.rec.names) - 1
        self.i = max(self.done_before, 0)
        self.events[:0] = prefix.events

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

    def saved_sizes(self) -> list[int] | None:
        """Bytes of every distinct storage born in this step that autograd saved, managed or
        not; None unless the step observed them (``observe_small``)."""
        if self.small_born is None:
            return None
        managed = [v.nbytes for v in self.rec.variables.values() if v.kind is Kind.ACTIVATION]
        return managed + list(self.small_saved.values())
