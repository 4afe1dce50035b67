"""A saved view rebuilt on a storage: its shape, and its lazy conjugate and negative bits.

Why the bits: ``x.conj()`` of a complex tensor is a view of the same bytes with a bit that
says "read these conjugated" (``is_conj()``), and ``x.conj().imag`` one that says "negated"
(``is_neg()``). Autograd saves such views as they are (``mul``'s backward keeps the other
factor's conjugate). A view rebuilt from its dtype, size, stride and offset alone is the
unconjugated tensor: the backward read the wrong values, and ``cov``, ``var``, ``std``,
``lu_solve``, ``svd_lowrank`` and ``pca_lowrank`` of complex inputs got wrong gradients (op_db's
complex64 samples under the engine). Every place that rebuilds a view of a managed storage
(an unpack, a spilled activation read back, a recompute chain's arguments and results) goes
through :func:`view_on`.
"""

from __future__ import annotations

import torch

__all__ = ["CONJ", "NEG", "bits_of", "view_on"]

CONJ, NEG = 1, 2


def bits_of(t: torch.Tensor) -> int:
    """The lazy bits a view carries beyond its shape: ``CONJ`` and ``NEG``, or 0."""
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


def view_on(s: torch.UntypedStorage, dtype: torch.dtype, size: torch.Size,
            stride: tuple[int, ...], offset: int, bits: int = 0) -> torch.Tensor:
    """The view of ``s`` with this shape and these bits (a view of a view where a bit is set:
    PyTorch sets them only on views)."""
    t = torch.empty(0, dtype=dtype, device=s.device).set_(s, offset, size, stride)
    if bits & CONJ:
        t = t.conj()
    if bits & NEG:
        t = torch._neg_view(t)
    return t
