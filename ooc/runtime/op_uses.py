"""What one op touches of a step's managed memory, read from its arguments and results.

``find_uses`` runs before the op: the managed storages it reads and writes (``OpUses``), the
storages born earlier in the step that it reads (noted for replays), and the activations it
writes in place after the engine let go of them (``taken_back``: ``Binding.take_back``).
``new_storages`` runs after it: the storages it created, over the threshold, each a birth
in the recording. Both only look and record; the ``Stepper`` acts on what they find.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ooc.record.managed import Birth, Recording
from ooc.record.op_schema import tensors as _tensors
from ooc.record.storages import storage_of
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_book import StepBook
from scheduler.ir import Access


class OpUses:
    """What op ``i`` uses: its tensor inputs (``ins``) and the ids of their storages
    (``in_ids``), the tensors it writes and their storages' ids (``written``), the managed
    slots it touches (``touched``), what on demand never evicts for it (``keep``), the slots
    whose storage it writes after the engine let go of it (``taken_back``), and whether a
    recompute chain reruns it (``recipe``, with the generator state it drew from)."""

    __slots__ = ("in_ids", "ins", "keep", "recipe", "taken_back", "touched", "written", "written_tensors")

    def __init__(self, ins, written_tensors, written) -> None:
        self.ins, self.written_tensors, self.written = ins, written_tensors, written
        self.in_ids: set[int] = set()
        self.touched: list[Slot] = []
        self.keep: set[Slot | Birth] = set()
        self.taken_back: list[tuple[Slot, torch.UntypedStorage]] = []
        self.recipe: tuple[bool, torch.Tensor | None] = (False, None)


def find_uses(info: Any, args: tuple, kwargs: dict, i: int, rec: Recording, book: StepBook,
              fresh: dict[Birth, None], touch: Callable[[Birth], None]) -> OpUses:
    """Op ``i``'s uses of managed memory, recorded (``rec.use``); ``touch`` sees each new
    storage of the optimizer it reads (``fresh``: on demand, the eviction order)."""
    ins = info.inputs(args, kwargs)
    written_tensors = info.written(args, kwargs) if info.writes else ()
    written = {id(s) for t in written_tensors if (s := storage_of(t)) is not None} if written_tensors else ()
    uses = OpUses(ins, written_tensors, written)
    touched, keep, in_ids, taken_back = uses.touched, uses.keep, uses.in_ids, uses.taken_back
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
        elif s._cdata in births:
            b = rec.live_birth(s)
            if b is not None:
                if b.var is None:
                    b.reads.append(i)      # replayed if it becomes managed later
                    rec.anonymous_reads.append((i, b))
                    if key in written:
                        b.writes.append(i)
                    if b in fresh:
                        keep.add(b)
                        touch(b)
                else:
                    rec.use(i, b.var, Access.READ)   # managed; the engine let go of it
                    slot = book.slots.get(b.var)
                    if key in written and slot is not None and slot.state is not State.ABSENT:
                        touched.append(slot)
                        taken_back.append((slot, s))
    if touched:
        keep.update(touched)
    return uses


def new_storages(out: Any, uses: OpUses, rec: Recording, i: int, min_bytes: int,
                 small_born: dict[int, int] | None) -> tuple[int, bool, list]:
    """The storages op ``i`` created with ``out``, at least ``min_bytes`` each, as births in
    the recording: ``(outputs, aliased, born)``, ``born`` a list of (output index, storage,
    bytes, birth). ``aliased``: a result in an input's storage, not written in place
    (``ooc/record/replay.py``). Smaller ones go to ``small_born`` when it is kept."""
    in_ids, written = uses.in_ids, uses.written
    aliased = False
    born = []
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
            born.append((k, s, nbytes, rec.birth(s, i, k, nbytes)))
        elif small_born is not None and not t.is_meta:
            small_born[key] = nbytes
    return len(outs), aliased, born
