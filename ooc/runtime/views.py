"""How a tensor looks at its storage (``View``), so that it can be rebuilt on another storage
holding the same bytes: its dtype, size, stride, offset, and its lazy conjugate and negative
bits.

Every place that keeps a managed tensor without holding it keeps a ``View``: a saved
activation (``Packed``, ``Spilled``), a recompute chain's arguments (``Ref``, ``Made``) and a
template's (``VarArg``, ``PackArg``, ``Persistent``). One description, so that a new property
of views is added once: the bits were missing from all five when each kept its own fields.

Why the bits: ``x.conj()`` of a complex tensor is a view of the same bytes with a bit that
says "read these conjugated" (``is_conj()``), and ``x.conj().imag`` one that says "negated"
(``is_neg()``). Autograd saves such views as they are (``mul``'s backward keeps the other
factor's conjugate). A view rebuilt from its dtype, size, stride and offset alone is the
unconjugated tensor: the backward read the wrong values, and ``cov``, ``var``, ``std``,
``lu_solve``, ``svd_lowrank`` and ``pca_lowrank`` of complex inputs got wrong gradients (op_db's
complex64 samples under the engine).

Why a ``NamedTuple``: a ``View`` is made for every saved activation of every step (the pack
hook); made with ``tuple.__new__`` it costs ~0.1 us more than five attributes on the holder, a
frozen dataclass ~0.5 us. It compares by value (templates compare what steps read).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CONJ", "NEG", "View", "bits_of"]

CONJ, NEG = 1, 2
_new = tuple.__new__


def bits_of(t: torch.Tensor) -> int:
    """The lazy bits a view carries beyond its shape: ``CONJ`` and ``NEG``, or 0."""
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


class View(NamedTuple):
    """How a tensor looks at its storage."""

    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    bits: int = 0

    @staticmethod
    def of(t: torch.Tensor) -> View:
        return _new(View, (t.dtype, t.size(), t.stride(), t.storage_offset(),
                           (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)))

    def on(self, s: torch.UntypedStorage) -> torch.Tensor:
        """This view of ``s`` (a view of a view where a bit is set: PyTorch sets them only on
        views)."""
        t = torch.empty(0, dtype=self.dtype, device=s.device).set_(s, self.offset, self.size, self.stride)
        if self.bits & CONJ:
            t = t.conj()
        if self.bits & NEG:
            t = torch._neg_view(t)
        return t

    def of_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """This view of ``t``'s storage: ``t`` itself where it is the view (rebuilding one
        costs ~5 us, as much as a small op)."""
        if (t.dtype == self.dtype and t.storage_offset() == self.offset and t.size() == self.size
                and t.stride() == self.stride and bits_of(t) == self.bits):
            return t
        return self.on(t.untyped_storage())
