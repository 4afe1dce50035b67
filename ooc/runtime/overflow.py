"""Where a step's swap-in takes its destination: the pool, or memory outside it.

A planned step reads into the pool, within the budget its plan was proven under: a pool that
cannot hold a swap-in is an error. A step on demand (no plan yet, or one that left its plan)
needs the bytes now: it takes them outside the pool, finishes, and fails at its end with the
plan's verdict (``BudgetTooSmall`` with the minimum) or the overflow noted here.
"""

from __future__ import annotations

import torch

from ooc.runtime.devices import cuda_runtime
from ooc.runtime.slots import Slot
from ooc.runtime.step_book import Course, StepBook
from ooc.runtime.step_context import StepContext
from vmm.errors import OutOfBudget
from vmm.units import format_size


class Unbudgeted:
    """Memory outside the pool, on the engine's device, for an on-demand step that has
    already failed its budget."""

    def __init__(self, device: torch.device) -> None:
        # where the device's tensors live (the CPU under ooc.testing.fake_cuda)
        self.device = cuda_runtime().tensor_device(device) if device.type == "cuda" else device

    def take(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class _Overflowing:
    """The pool a step's swap-in takes its destination from. On demand (no plan yet, or a
    diverged step) the bytes are needed now: if the pool cannot hold them, they are taken
    outside it, the step finishes and fails at its end with the plan's verdict
    (BudgetTooSmall with the minimum) or this error (``overflow``). A planned step raises."""

    def __init__(self, ctx: StepContext, book: StepBook, course: Course, slot: Slot, where: int) -> None:
        self.ctx, self.book, self.course, self.slot, self.where = ctx, book, course, slot, where

    def take(self, nbytes: int) -> torch.Tensor:
        ctx, slot, where = self.ctx, self.slot, self.where
        try:
            return ctx.pool.take(nbytes)
        except OutOfBudget as exc:
            error = OutOfBudget(
                f"op {where} ({self.course.name(where)}): swapping in {slot.name} ({format_size(slot.nbytes)}, "
                f"{slot.nbytes} B) does not fit the {format_size(ctx.budget)} pool: {exc}")
            if self.course.planned:
                try:
                    raise error from None
                finally:   # (held here, a cycle through the frame its traceback keeps)
                    del error
            if self.book.overflow is None:
                self.book.overflow = error
            return Unbudgeted(ctx.device).take(nbytes)


def pool_for(ctx: StepContext, book: StepBook, course: Course, slot: Slot, where: int) -> _Overflowing:
    """The memory a swap-in of ``slot`` before op ``where`` reads into: the pool, or, on
    demand once the pool cannot hold it, memory outside it (``_Overflowing``)."""
    return _Overflowing(ctx, book, course, slot, where)


