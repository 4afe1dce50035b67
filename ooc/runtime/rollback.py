"""Taking back a step that failed before its update.

A step that raises before ``optimizer.step()`` (the user's exception, a swap failure, Ctrl-C)
must leave the model as it found it, so the next step runs as if this one had not happened.
What the step changes before its update, besides the managed tensors the engine settles:

- buffers written in place (BatchNorm's running statistics): copied at the step's first op
  that uses each one, and copied back;
- gradients: those the step created are dropped; those that existed before (accumulation
  over steps) and that its backward added to cannot be restored without a copy of each
  (memory the budget does not have), so the caller is told which.

Once the update starts (the commit point) nothing is rolled back: the copies go.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class StepRollback:
    """The copies one step needs to be taken back, and the taking back.

    ``buffers`` maps the id of each buffer's storage to (buffer, storage); the entry keeps
    the storage (the Python object too), so the id stays that storage's: the per-op loop has
    the inputs' storages in hand. ``undo`` maps the same ids to (buffer, copy); None once the
    update started (``commit``) or the step was rolled back; ``taken_back`` says which (what
    ``OOCError.step_applied`` reports).
    """

    __slots__ = ("model", "buffers", "undo", "grads_were_none", "grad_versions", "taken_back")

    def __init__(self, model: torch.nn.Module, *, copy_all: bool = False) -> None:
        """``copy_all``: copy every buffer now, for a step that does not see each op's uses
        (a hook-driven step, a per-op step's quiet ops: ``Stepper.on_op``)."""
        self.model = model
        self.buffers: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {
            id(s): (b, s) for b in model.buffers() if (s := b.untyped_storage()).nbytes()}
        self.undo: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {}
        self.taken_back = False
        params = list(model.parameters())
        self.grads_were_none = [p for p in params if p.grad is None]
        self.grad_versions = {p: p.grad._version for p in params if p.grad is not None}
        for key in self.buffers if copy_all else ():
            self.save_before_write(key)

    def save_before_write(self, key: int) -> None:
        """Copy buffer ``key`` (the id of its storage) before the step's first op that touches
        it. Not only before a write: some ops change arguments their schema does not mark as
        written (``native_batch_norm`` updates the running statistics), so any use counts."""
        if key not in self.undo:
            b = self.buffers[key][0]
            self.undo[key] = (b, b.detach().clone())   # the mode is off inside its handler

    def commit(self) -> None:
        """The update starts: from here on the step is not rolled back."""
        self.undo = None

    def roll_back(self) -> str | None:
        """Undo what a step that failed before its optimizer step did to the model: buffers
        get their old bytes, gradients it created are dropped. Returns a note naming the
        gradients of earlier steps its backward already added to, else None."""
        with torch.no_grad():
            for b, copy in (self.undo or {}).values():
                b.copy_(copy)
        self.undo, self.taken_back = None, True
        for p in self.grads_were_none:
            p.grad = None
        names = {p: n for n, p in self.model.named_parameters()}
        touched = [names.get(p, "?") for p, v in self.grad_versions.items()
                   if p.grad is not None and p.grad._version != v]
        if not touched:
            return None
        note = (f"ooc: the failed step's backward had already added to the gradients of "
                f"{len(touched)} parameter(s) accumulated by earlier steps ({', '.join(touched[:4])}"
                f"{', ...' if len(touched) > 4 else ''}): call optimizer.zero_grad() and redo the "
                "accumulation; everything else is as before the step")
        log.warning("%s", note)
        return note
