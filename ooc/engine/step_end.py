"""Finishing a step: settle its transfers, keep what outlives it, roll back a failed one.

``_finish`` runs at every step's end, failed or not: it waits for every transfer, rolls back
a step that failed before its update, decides which managed tensors outlive the step
(``_live_out``), brings them back between steps if they fit, books the step's statistics and
timeline, and re-plans from a step that did not follow a plan (``ooc/engine/planning.py``).
"""

from __future__ import annotations

import bisect
import logging

import torch

from ooc.errors import OOCError, StorageError
from ooc.runtime import cpu_allocator
from ooc.runtime.malloc import give_back_heap
from ooc.runtime.slots import Slot
from ooc.runtime.stepper import Stepper
from scheduler.ir import Kind
from vmm.units import format_size

log = logging.getLogger(__name__)

# The timeline keeps the events of this many recent steps (and at most 200,000 events), so
# that a long run's memory does not grow with its number of steps.
TIMELINE_STEPS = 32


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
    """``OutOfCore``'s end of a step (a mixin over the engine's persistent tensors, tier,
    pool, counters and timeline)."""

    def _finish(self, st: Stepper, exc: BaseException | None, seconds: float) -> None:
        """Drain transfers, keep what outlives the step, and re-plan if the step was not planned.

        A step that failed before its optimizer step (``exc``: the user's exception, a swap
        failure, Ctrl-C; or a transfer that fails here) is rolled back: the buffers it wrote
        (BatchNorm statistics) get their old bytes, the gradients it created are dropped, and
        every managed tensor is left either in memory or on the tier, so the next step can
        run as if this one had not.
        """
        st.close_node()
        if self.device.type == "cpu":
            cpu_allocator.end(self)   # the cache stays for the next step, shrinking between
        interrupt: BaseException | None = None
        try:   # every transfer, also one whose future an interrupt kept from reaching its
            # slot; first, so that settling the slots below finds them complete (on a GPU: one
            # host synchronization for the step's end, not one per slot)
            self.tier.drain()
        except BaseException as e:  # noqa: B036 - raised at the end
            interrupt = e
        try:
            errors = self._settle(st.slots.values())
        except BaseException as e:  # noqa: B036 - every slot is settled; raised at the end
            interrupt, errors = interrupt or e, []
        st.writes_settled()
        failed = exc is not None or bool(errors) or interrupt is not None
        if failed and st.rec.optimizer_start is None:
            note = st.rollback.roll_back()
            if note and exc is not None and hasattr(exc, "add_note"):
                exc.add_note(note)
        lost = self._drop_given_back_grads(st)
        if lost and exc is not None and hasattr(exc, "add_note"):
            exc.add_note(f"ooc: the gradients of {', '.join(lost)} were given back after the update, "
                         "as the plan does; they are None now")
        live = self._live_out(st)
        st.hand_back(live)
        for var, slot in list(self.persistent.items()):
            if var not in live:
                del self.persistent[var]
        for var, slot in live.items():
            self.persistent[var] = slot
        st.mark_live_out(live)
        for slot in st.slots.values():
            if slot.host_current and slot.var not in live:   # activations, dropped grads
                self.tier.discard(slot.key)
                slot.host_current = False
            if not slot.in_place:
                slot.storage = None
        back_error: BaseException | None = None
        try:
            self._step_end_bring_back()
        except Exception as e:  # a failed read: the tensor stays on the tier; raised below
            back_error = e
        if self.device.type == "cpu":
            # the pool's idle chunks go to the CPU allocator's cache, for the next step's
            # tensors and chunks alike (or, without it, back to the kernel). A GPU pool keeps
            # its chunks mapped between steps (within the budget): unmapping synchronizes the
            # device, and the next step would map them again.
            self.pool.trim()
            give_back_heap()   # parameters built before the engine left their pages in glibc's heap
        self._book_step(st.events, seconds, st.stall_s, planned=st.planned, diverged_at=st.diverged_at,
                        peak=st.peak)
        if interrupt is not None:
            raise interrupt
        if exc is not None:
            if back_error is not None and hasattr(exc, "add_note"):
                exc.add_note(f"ooc: reading managed tensors back after it failed too: {back_error}")
            return   # step() re-raises it; the transfers' errors are its consequences
        if errors:
            err = errors[0]
            if st.rec.optimizer_start is not None:
                err = StorageError(f"{err}. The step's update had completed and nothing was lost: "
                                   "a tensor whose write failed kept its bytes in memory")
                err.errno = errors[0].errno
            raise err
        if back_error is not None:   # the step is done; a tensor the tier holds could not come back
            raise back_error
        recording = st.whole_recording()
        if recording is not None:
            self.last_recording = recording
        self._note_verified(st)
        if st.schedule is None or st.diverged_at is not None:
            st.book_device_times()
            if self._adapt_chunk(st):
                overflow = st.forgive_overflow()
                if overflow is not None:   # the next step records again, in the new chunks
                    log.warning("the recording step went over the pool once (%s); the next step "
                                "records again with %s chunks", overflow, format_size(self.chunk))
            else:
                self._replan(st)
        else:   # a plan's first planned run times its ops on warm memory (planning.py)
            self._reprice(st)
            self._note_anchored(st, seconds)
        if st.overflow is not None:   # an on-demand step needed more than the pool could give
            raise st.overflow
        if lost:
            raise OOCError(
                f"the gradients of {', '.join(lost)} outlived this step, but its plan (recorded from a "
                "step that set them to None after optimizer.step()) gave their bytes back after the "
                "update: they are None now. Call zero_grad(set_to_none=True) after the update in every "
                "step, or never inside the step")

    def _book_step(self, events: list[tuple[str, str, float, float]], seconds: float, stall_s: float, *,
                   planned: bool, diverged_at: int | None, peak: int) -> None:
        """Count the step, keep its timeline events (the last ``TIMELINE_STEPS`` steps') and
        what ``stats()`` says of the last step."""
        self.counters["steps"] += 1
        for tr, name, t0, t1 in events:
            self.events.append((tr, name, t0, t1, self.counters["steps"]))
        oldest = self.counters["steps"] - TIMELINE_STEPS
        del self.events[:bisect.bisect_right(self.events, oldest, key=lambda ev: ev[4])]
        del self.events[:-200_000]
        self.last = {"step_s": seconds, "stall_s": stall_s, "planned": planned,
                     "diverged_at": diverged_at, "resident_peak_bytes": peak}

    def _drop_given_back_grads(self, st: Stepper) -> list[str]:
        """Gradients whose bytes the plan freed after the update (they died in the recorded
        step) but which outlive this one (an exception or a Ctrl-C before ``zero_grad``, a
        loop that stopped zeroing them): their storage is empty, and a read would be of freed
        memory. They become None, as ``zero_grad`` would have made them; named for the error."""
        if "grads" not in self.manage:
            return []
        freed = {id(s.storage) for s in st.slots.values() if s.kind is Kind.GRAD and s.given_back()}
        if not freed:   # the usual step: no parameter to look at
            return []
        lost = []
        for name, p in self.model.named_parameters():
            if p.grad is not None and p.grad.layout is torch.strided and id(p.grad.untyped_storage()) in freed:
                p.grad = None
                lost.append(name)
        return lost

    def _live_out(self, st: Stepper) -> dict[int, Slot]:
        """The managed tensors that exist after the step: parameters, kept grads, state."""
        live: dict[int, Slot] = {}
        if not self.manage & {"params", "grads", "optimizer_state"}:
            return live   # activations only: none outlives the step
        by_storage = {id(s.storage): s for s in [*self.persistent.values(), *st.slots.values()]
                      if s.in_place and s.storage is not None}
        candidates: list[tuple[torch.Tensor, Kind, str]] = []
        names = {p: n for n, p in self.model.named_parameters()}
        for p, name in names.items():
            if "params" in self.manage:
                candidates.append((p, Kind.PARAM, name))
            # A gradient that is a view is a window onto a buffer another owner holds: DDP's
            # gradient_as_bucket_view=True makes p.grad a view into its bucket, whose all-reduce
            # runs asynchronously, after the op that started it returned. Managed, the whole
            # bucket was adopted as one parameter's gradient (at DDP's bucket rebuild) and could
            # be released under that all-reduce. The bucket stays DDP's.
            if "grads" in self.manage and p.grad is not None and p.grad._base is None:
                candidates.append((p.grad, Kind.GRAD, f"{name}.grad"))
            if "optimizer_state" in self.manage and self.optimizer is not None:
                for key, t in self.optimizer.state.get(p, {}).items():
                    if isinstance(t, torch.Tensor):
                        candidates.append((t, Kind.OPTIMIZER_STATE, f"{name}.{key}"))
        for t, kind, name in candidates:
            if t.layout is not torch.strided:   # sparse: PyTorch's (PersistentTensors._persistent_tensors)
                continue
            s = t.untyped_storage()
            slot = by_storage.get(id(s))
            if slot is None:
                slot = st.live_slot(s, kind, name)
                if slot is None:
                    continue
                by_storage[id(s)] = slot
            elif slot.name != name and slot.var not in self.persistent:
                st.rename(slot, name)   # optimizer state written out on demand before it had a name
            live[slot.var] = slot
        return live
