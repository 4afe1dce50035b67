"""What a template reads, each a slot a hook-driven step fills from what its hooks see
(``templates.py`` says how a template is made and replayed): ``VarArg`` (a managed
activation), ``PackArg`` (a tensor autograd saved, by its index among the step's saves) and
``Persistent`` (a parameter or buffer); and ``part_of``, whether a slot reads part of what
it views (the rows of a table a number may have placed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ooc.runtime.made_by import node_of
from ooc.runtime.views import View, bits_of


@dataclass(frozen=True, slots=True)
class VarArg:
    """A managed activation: plan variable ``var``, read as ``view``; ``whole``: all of its
    storage (``part_of``)."""

    var: int
    view: View
    whole: bool = True


@dataclass(frozen=True, slots=True)
class PackArg:
    """The ``k``-th tensor the step saves (``nbytes`` its storage's; ``saved``, how it looks at
    it, from where it starts), its node's type ``node``, at ``gap`` (the ops begun before the
    save), read as ``view`` from where the save starts (its ``offset`` in bytes: the two may
    differ in dtype, ``view_as_real``). Why from there: a batch sliced from a
    tensor made before the step (``x = xs[i:i + b]``) is saved at another offset of the same
    storage at every step; read at the captured step's offset, a ResNet's first convolution
    replayed on the captured step's images, and its parameters came out wrong from the first
    hook-driven step that recomputed it (``tests/ooc/test_templates.py``).

    ``whole``: the op read the save itself (the usual case: autograd saves an op's input or
    output as it is). Then the save is read as it is, wherever its bytes lie: a decoder's next
    token is a column of the targets under teacher forcing and the last step's ``argmax``
    without (PyTorch's seq2seq tutorial picks one per batch); the embedding saved a strided
    view of the targets' storage in one step and a tensor of its own in the next, and every
    hook-driven step of the other kind left its plan."""

    k: int
    nbytes: int
    node: str
    gap: int
    view: View
    saved: View
    whole: bool = False

    @staticmethod
    def of(k: int, t: torch.Tensor, s: torch.UntypedStorage, gap: int, x: torch.Tensor,
           node: str | None = None) -> PackArg:
        """``x``, read from ``t`` (storage ``s``), the ``k``-th save, at ``gap``; ``node``: the
        save's node where ``t`` is an alias of it (its own is none)."""
        after = x.storage_offset() * x.element_size() - t.storage_offset() * t.element_size()
        read, saved = View.of(x), View.of(t)
        return PackArg(k, s.nbytes(), node_of(t) if node is None else node, gap, read._replace(offset=after),
                       saved._replace(offset=0), read == saved)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """This argument in a step whose ``k``-th save is ``t``."""
        if self.whole:
            return t
        at = t.storage_offset() * t.element_size() + self.view.offset
        return self.view._replace(offset=at // self.view.dtype.itemsize).of_tensor(t)

    def differs(self, t: torch.Tensor, s: torch.UntypedStorage) -> bool:
        """Is ``t`` (storage ``s``), another step's ``k``-th save, not one this reads alike?
        A save read whole must look as captured (dtype, shape, conj and neg bits), made by a
        node of the captured type ("leaf" and "view" alike: no node made either's bytes);
        strides, storage and offset are free, the replay reads what the step's own op read.
        Any other must lie in its storage as captured."""
        if not self.whole:
            return s.nbytes() != self.nbytes or node_of(t) != self.node or View.of(t)._replace(offset=0) != self.saved
        was, node = self.saved, node_of(t)
        return (t.dtype != was.dtype or t.size() != was.size or bits_of(t) != was.bits
                or (node != self.node and not {node, self.node} <= _NO_NODE))


_NO_NODE = frozenset({"leaf", "view"})   # node_of's words for bytes no autograd node made


@dataclass(frozen=True, slots=True)
class Persistent:
    """A parameter or buffer (``tensor``), read as ``view``; ``checked``: a write to it since
    the op read it refuses a discard (BatchNorm's running statistics are not checked: the
    replay reads copies, and its output does not depend on them). ``writes``: the writes to it
    in the step before the op read it (its version counter's steps since the step began): a
    GAN's generator pass reads the discriminator's weights after the discriminator's update,
    and a replay then reads what the op read."""

    tensor: torch.Tensor
    view: View
    checked: bool
    writes: int = 0


def part_of(x: VarArg | PackArg | Persistent) -> bool:
    """Whether slot ``x`` reads a part of what it views, which a Python number may have
    placed: ``pe[start:start + T]`` of a positional table, read at row 0 in the capturing step
    and at ``start`` later, replayed the captured rows (its length is the plan's, a shape; its
    place is not). A weight's transpose is all of it."""
    if not isinstance(x, Persistent):
        return not x.whole
    v = x.view
    return v.offset != 0 or math.prod(v.size) * v.dtype.itemsize < x.tensor.untyped_storage().nbytes()


def whole_of(view: View, nbytes: int) -> bool:
    """Whether ``view`` reads all of a storage of ``nbytes`` (``VarArg.whole``)."""
    return view.offset == 0 and math.prod(view.size) * view.dtype.itemsize == nbytes
