"""What reading a managed tensor whose bytes the plan gave back raises: never a read of freed
memory (a segfault or garbage), but an error naming the tensor, its bytes, where it was read
and what to change. A plan frees a tensor after its last use in the step it was recorded
from; a later step that reads it after all (a gradient read after ``optimizer.step()``, a
second backward the recorded step did not run) left that step's program."""

from __future__ import annotations

from ooc.errors import OOCError
from ooc.runtime.slots import Slot
from vmm.units import format_size


def given_back_error(slot: Slot, where: str) -> OOCError:
    """A persistent tensor (a gradient) whose bytes the plan gave back (``Slot.given_back``)."""
    return OOCError(
        f"{where} reads {slot.name} ({format_size(slot.nbytes)}, {slot.nbytes} B), whose bytes the plan "
        f"gave back after its last use in the step it was recorded from (nothing read it later "
        f"there). Read gradients before optimizer.step() (clip_grad_norm_ returns the norm), do the "
        f"same reads in every step, or leave 'grads' out of manage")


def freed_error(slot: Slot, where: str) -> OOCError:
    """A saved activation the plan freed, where a step left its plan and autograd unpacked it
    after all (never a read of a storage that is gone)."""
    return OOCError(
        f"{where} reads the saved activation {slot.name} ({format_size(slot.nbytes)}, {slot.nbytes} B), "
        f"whose bytes the plan gave back after its last use in the step it was recorded from, where "
        f"no backward node read it again. This step's backward did (a second backward over a graph "
        f"kept with retain_graph=True, which the recorded step did not run?): run the same backward "
        f"passes in every step (the step is rolled back: the parameters are as before it)")
