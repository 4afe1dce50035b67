"""The end of every step, whatever its form: one routine, one report.

``StepEnd.finish`` runs at every step's end, failed or not. First the form's own settling:

- per op: wait for every transfer, roll back a step that failed before its update, decide
  which managed tensors outlive the step (``_live_out``) and bring them back between steps if
  they fit (``PersistentStore.bring_back_if_fits``);
- hook-driven: the rest of its plan runs and its transfers settle (``AnchoredStep.finish``);
  a step that failed before its update is rolled back.

Then, for every form alike: one ``StepReport`` is booked (``step_book.py``), the errors the
settling met are raised, and the planner decides what follows from the step
(``Planner.after_step``: plan, re-price, a hook-driven form, its trial). Every ``OOCError``
that leaves a step says whether the step was applied or taken back (``step_applied``), so
that a loop that retries a batch does not train it twice (``StepEnd.unwound`` for a step
whose body raised).
"""

from __future__ import annotations

import logging

import torch

from ooc.engine import step_budget
from ooc.engine.memory import EngineMemory
from ooc.engine.persistent import PersistentStore
from ooc.engine.planning import Planner
from ooc.engine.step_book import StepBook
from ooc.errors import OOCError, StorageError
from ooc.host import cpu_allocator
from ooc.runtime.anchored_step import AnchoredStep
from ooc.runtime.composition import refused_hooks
from ooc.host.malloc import give_back_heap
from ooc.runtime.slots import Slot
from ooc.runtime.step_protocol import StepReport, form_of
from ooc.runtime.stepper import Stepper
from scheduler.errors import BudgetTooSmall
from scheduler.ir import Kind
from vmm.units import format_size

log = logging.getLogger(__name__)


def partial_update_error(exc: StorageError, *, during_step: bool) -> StorageError:
    """``exc``, a transfer that failed after the step's first update began, saying what that
    left: some parameters updated, the others not (``during_step``: inside ``optimizer.step()``,
    which swaps managed parameters and state; else between the updates of PyTorch's recipe of
    the update inside the backward)."""
    where = ("during the optimizer step, which swaps managed parameters and state" if during_step
             else "after the step's first update, in a backward that updates each parameter as its "
                  "gradient is ready")
    err = StorageError(f"{exc}. This happened {where}: parameters already updated keep their new "
                       "values, the others their old ones. Restore model and optimizer from a "
                       "checkpoint before training on")
    err.errno = exc.errno
    return err


class StepEnd:
    """The engine's end of a step (the module docstring), over its memory, persistent store,
    book and planner."""

    def __init__(self, mem: EngineMemory, store: PersistentStore, book: StepBook, planner: Planner, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, manage: frozenset[str]) -> None:
        self._mem, self._store, self._book, self._planner = mem, store, book, planner
        self._model, self._optimizer, self._manage = model, optimizer, manage
        self._lost: list[str] = []   # the per-op step's gradients given back (_drop_given_back_grads)
        #: The last step that ran unplanned (the recording step), whole, as ``ooc.trace``
        #: records a step (``ooc/record/``). None until one completed.
        self.last_recording = None
        self._whole = None

    def unwound(self, st: Stepper | AnchoredStep, exc: BaseException, seconds: float) -> BaseException:
        """End ``st``, whose body raised ``exc`` (``finish``). Returns what ``step()`` raises:
        ``exc``, or in its place (from it) an error that says more: a transfer that failed
        once the update began says what that left; ``torch.func``'s refusal of the hooks says
        what to do instead."""
        committed = st.rollback.undo is None   # past the commit point: nothing to roll back
        self._mem.raised = True
        self.finish(st, exc, seconds)
        if committed and isinstance(exc, StorageError):
            raised = partial_update_error(exc, during_step=st.updating)
        else:
            raised = refused_hooks(exc) or exc
        if isinstance(raised, OOCError):
            raised.step_applied = not st.rollback.taken_back
        return raised

    def finish(self, st: Stepper | AnchoredStep, exc: BaseException | None, seconds: float) -> None:
        """``_finish``, and what it raises marked with whether the step was applied."""
        try:
            self._finish(st, exc, seconds)
        except OOCError as err:
            err.step_applied = not st.rollback.taken_back
            self._mem.raised = True
            raise

    def _finish(self, st: Stepper | AnchoredStep, exc: BaseException | None, seconds: float) -> None:
        """End ``st`` (``exc``: what the step raised, which ``step()`` re-raises): settle it,
        book its report, raise what the settling met, and let the planner decide what follows.

        A step that failed before its optimizer step (``exc``: the user's exception, a swap
        failure, Ctrl-C; or a transfer that fails here) is rolled back: the buffers it wrote
        (BatchNorm statistics) get their old bytes, the gradients it created are dropped, and
        every managed tensor is left either in memory or on the tier, so the next step can
        run as if this one had not."""
        if isinstance(st, Stepper):
            st.close_node()
            st.end_wait()   # a step that waited for a shape no forward showed
            if st.saved.templates is not None:   # its forward hooks off, the templates built or not
                st.saved.templates.close()
        if self._mem.on_cpu:
            cpu_allocator.end(self._mem)   # the cache stays for the next step, shrinking between
        settle = self._settle_per_op if isinstance(st, Stepper) else self._settle_hooked
        self._whole = None   # this step's whole recording, if it recorded one
        try:
            raised = settle(st, exc)
        finally:
            form = form_of(st)
            self._book.book(StepReport(form, seconds, st.stall_s, st.peak, st.diverged_at, tuple(st.events),
                                       kept_plan=form != "recorded" and st.diverged_at is None))
        if raised is not None:
            try:
                raise raised
            finally:   # (a cycle through this frame otherwise: the step's frames wait for a collection)
                del raised
        if exc is None:
            if isinstance(st, AnchoredStep) and st.diverged_at is not None:
                log.warning("step diverged from its plan near op %d (%s): %s; %s written out and read "
                            "back on demand (the planner says what the next step runs)", st.diverged_at,
                            _op_name(st.schedule, st.diverged_at), st.why, format_size(st.spilled_bytes))
            try:
                self._planner.after_step(st, self._book.last, whole=self._whole)
            except BudgetTooSmall as err:   # the step ran whole: whatever it updated stays updated
                err.add_note("ooc: this step completed (an update it ran is applied; a step refused before "
                             "its update is rolled back and says nothing of this): the budget is refused for "
                             "the steps after it; raise it (engine.set_budget) and go on with the next batch")
                raise
        if isinstance(st, Stepper) and exc is None:
            self._after_per_op(st)
        if exc is None and self._mem.step_budget:
            self._starts_with()

    def _starts_with(self) -> None:
        """``Options(budget_covers="step")``: what the next step starts with, against what the
        last step recorded whole counted (its state made and kept, from its start on). Where it
        grew since (LBFGS appends to its history every step: 2.6 MiB a step of a small MLP, 16
        MiB after six steps at an 8 MiB budget, which no fit had seen), the next step records
        whole again, and is refused at its update where the budget no longer holds it."""
        mem = self._mem
        now = step_budget.start_bytes(self._model, self._optimizer, self._manage, mem.min_bytes)
        if self._whole is not None:   # this step's fit counted it
            mem.step_start = now
            return
        if now <= mem.step_start:
            return
        log.info("the step starts with %s beside ooc's tensors, %s more than the step recorded whole: "
                 "the next step records whole again", format_size(now), format_size(now - mem.step_start))
        self._planner.refit(now)

    def _settle_hooked(self, st: AnchoredStep, exc: BaseException | None) -> BaseException | None:
        """A hook-driven step's end: the rest of its plan, its transfers; a failed one (before
        its update) rolled back. Its bytes moved are counted here."""
        try:
            st.finish(failed=exc is not None)
        finally:
            if exc is not None and st.rollback.undo is not None:   # failed before the commit point
                note = st.rollback.roll_back()
                if note and hasattr(exc, "add_note"):
                    exc.add_note(note)
            self._mem.counters["bytes_out"] += st.spilled_bytes
            self._mem.counters["bytes_in"] += st.read_bytes
            if st.bound is not None:
                self._mem.counters["bytes_recomputed"] += st.bound.recomputed
                self._mem.counters["recompute_s"] += st.bound.recompute_s
        return None

    def _settle_per_op(self, st: Stepper, exc: BaseException | None) -> BaseException | None:
        """A per-op step's end (the module docstring). Returns the error to raise: a Ctrl-C
        met while settling, a failed transfer, a failed read back; None after a step that
        raised ``exc`` (its transfers' errors are its consequences, noted on it)."""
        store, tier = self._store, self._mem.tier
        interrupt: BaseException | None = None
        try:   # every transfer, also one whose future an interrupt kept from reaching its
            # slot; first, so that settling the slots below finds them complete (on a GPU: one
            # host synchronization for the step's end, not one per slot)
            tier.drain()
        except BaseException as e:  # noqa: B036 - raised at the end
            interrupt = e
        try:
            errors = store.settle(st.slots.values())
        except BaseException as e:  # noqa: B036 - every slot is settled; raised at the end
            interrupt, errors = interrupt or e, []
        st.writes_settled()
        failed = exc is not None or bool(errors) or interrupt is not None
        if failed and st.rec.optimizer_start is None:
            note = st.rollback.roll_back()
            if note and exc is not None and hasattr(exc, "add_note"):
                exc.add_note(note)
        self._lost = lost = self._drop_given_back_grads(st)
        if lost and exc is not None and hasattr(exc, "add_note"):
            exc.add_note(f"ooc: the gradients of {', '.join(lost)} were given back after the update, "
                         "as the plan does; they are None now")
        live = self._live_out(st)
        st.hand_back(live)
        store.keep(live)
        st.mark_live_out(live)
        if not st.planned:   # a step planned from: what its backward could have read lives on
            st.hold_unread()
        for slot in st.slots.values():
            if slot.var not in live:   # activations, dropped grads: nobody reads their copies
                slot.forget_copy(tier)
            if not slot.in_place:
                slot.storage = None
        back_error: BaseException | None = None
        try:
            store.bring_back_if_fits(between_steps=False)
        except Exception as e:  # a failed read: the tensor stays on the tier; raised below
            back_error = e
        if self._mem.on_cpu:
            # the pool's idle chunks go to the CPU allocator's cache, for the next step's
            # tensors and chunks alike (or, without it, back to the kernel). A GPU pool keeps
            # its chunks mapped between steps (within the budget): unmapping synchronizes the
            # device, and the next step would map them again.
            self._mem.pool.trim()
            give_back_heap()   # parameters built before the engine left their pages in glibc's heap
        if interrupt is not None:
            return interrupt
        if exc is not None:
            if back_error is not None and hasattr(exc, "add_note"):
                exc.add_note(f"ooc: reading managed tensors back after it failed too: {back_error}")
            return None   # step() re-raises it; the transfers' errors are its consequences
        if errors:
            err = errors[0]
            if st.rec.optimizer_start is not None:
                err = StorageError(f"{err}. The step's update had completed and nothing was lost: "
                                   "a tensor whose write failed kept its bytes in memory")
                err.errno = errors[0].errno
            return err
        if back_error is not None:   # the step is done; a tensor the tier holds could not come back
            return back_error
        recording = self._whole = st.whole_recording()
        if recording is not None:
            self.last_recording = recording
        return None

    def _after_per_op(self, st: Stepper) -> None:
        """What a per-op step that completed still raises once planned from: an on-demand need
        the pool could not meet, gradients its plan gave back that outlived it."""
        if st.overflow is not None:   # an on-demand step needed more than the pool could give
            raise st.forgive_overflow()   # (kept by the step it would be a cycle through this frame)
        if self._lost:
            raise OOCError(
                f"the gradients of {', '.join(self._lost)} outlived this step, but its plan (recorded from a "
                "step that set them to None after optimizer.step()) gave their bytes back after the "
                "update: they are None now. Call zero_grad(set_to_none=True) after the update in every "
                "step, or never inside the step")

    def _drop_given_back_grads(self, st: Stepper) -> list[str]:
        """Gradients whose bytes the plan freed after the update (they died in the recorded
        step) but which outlive this one (an exception or a Ctrl-C before ``zero_grad``, a
        loop that stopped zeroing them): their storage is empty, and a read would be of freed
        memory. They become None, as ``zero_grad`` would have made them; named for the error."""
        if "grads" not in self._manage:
            return []
        freed = {id(s.storage) for s in st.slots.values() if s.kind is Kind.GRAD and s.given_back()}
        if not freed:   # the usual step: no parameter to look at
            return []
        lost = []
        for name, p in self._model.named_parameters():
            if p.grad is not None and p.grad.layout is torch.strided and id(p.grad.untyped_storage()) in freed:
                p.grad = None
                lost.append(name)
        return lost

    def _live_out(self, st: Stepper) -> dict[int, Slot]:
        """The managed tensors that exist after the step: parameters, kept grads, state."""
        live: dict[int, Slot] = {}
        if not self._manage & {"params", "grads", "optimizer_state"}:
            return live   # activations only: none outlives the step
        by_storage = {id(s.storage): s for s in [*self._store.slots.values(), *st.slots.values()]
                      if s.in_place and s.storage is not None}
        candidates: list[tuple[torch.Tensor, Kind, str]] = []
        names = {p: n for n, p in self._model.named_parameters()}
        for p, name in names.items():
            if "params" in self._manage:
                candidates.append((p, Kind.PARAM, name))
            # A gradient that is a view is a window onto a buffer another owner holds: DDP's
            # gradient_as_bucket_view=True makes p.grad a view into its bucket, whose all-reduce
            # runs asynchronously, after the op that started it returned. Managed, the whole
            # bucket was adopted as one parameter's gradient (at DDP's bucket rebuild) and could
            # be released under that all-reduce. The bucket stays DDP's.
            if "grads" in self._manage and p.grad is not None and p.grad._base is None:
                candidates.append((p.grad, Kind.GRAD, f"{name}.grad"))
            if "optimizer_state" in self._manage and self._optimizer is not None:
                for key, t in self._optimizer.state.get(p, {}).items():
                    if isinstance(t, torch.Tensor):
                        candidates.append((t, Kind.OPTIMIZER_STATE, f"{name}.{key}"))
        for t, kind, name in candidates:
            if t.layout is not torch.strided:   # sparse: PyTorch's (PersistentStore._persistent_tensors)
                continue
            s = t.untyped_storage()
            slot = by_storage.get(id(s))
            if slot is None:
                slot = st.live_slot(s, kind, name)
                if slot is None:
                    continue
                by_storage[id(s)] = slot
            elif slot.name != name and slot.var not in self._store.slots:
                st.rename(slot, name)   # optimizer state written out on demand before it had a name
            live[slot.var] = slot
        return live


def _op_name(schedule, i: int) -> str:
    functions = schedule.sequence.functions
    return functions[i].name if 0 <= i < len(functions) else "end of step"
