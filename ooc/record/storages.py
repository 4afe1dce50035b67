"""Storages as variables: the key both recorders use, and why it stays unique.

A variable is a *storage*: every view of a storage is the same variable. The key is the
address of the C++ ``StorageImpl`` (``t.untyped_storage()._cdata``, also valid on ``meta``,
where every ``data_ptr`` is 0). An address can be reused once a storage is freed, so the
table keeps a *weak* reference to every storage it has seen: a weak reference does not keep
the bytes alive (``StorageImpl::release_resources`` frees them) but it keeps the
``StorageImpl`` object itself allocated, so no later storage can get the same address while
the table lives. Lifetimes then need no bookkeeping: the sequence's uses define them.

The runtime moves bytes between storages (a swapped-out activation comes back in a new
storage of the pool): ``alias`` makes the new storage the same variable as the old one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage, or None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse tensor's bytes are in (its indices and values), none for
    other tensors without a storage. A sparse gradient (``nn.Embedding(sparse=True)``) is made
    by ops that return it whole (``clone``): its values, as large as the rows it touches, have
    no strided result of their own to be seen by."""
    layout = t.layout
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout is torch.sparse_csr or layout is torch.sparse_bsr:
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout is torch.sparse_csc or layout is torch.sparse_bsc:
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def storage_key(t: torch.Tensor) -> int | None:
    """The key of ``t``'s storage (the ``StorageImpl`` address), None without a storage."""
    s = storage_of(t)
    return None if s is None else s._cdata


class StorageTable:
    """Storage key -> variable index, for one recorded step. Every storage entered stays
    pinned (weakly: its bytes can go, its address cannot be reused) until ``clear``."""

    __slots__ = ("var_of", "_pins")

    def __init__(self) -> None:
        self.var_of: dict[int, int] = {}
        self._pins: list[Any] = []

    def get(self, s: torch.UntypedStorage) -> int | None:
        return self.var_of.get(s._cdata)

    def add(self, s: torch.UntypedStorage, var: int) -> None:
        """``s`` holds variable ``var`` (a new variable, or ``var``'s bytes moved into ``s``)."""
        self.var_of[s._cdata] = var
        self._pins.append(StorageWeakRef(s))

    def clear(self) -> None:
        """Let the pinned addresses go (the keys may be reused from now on)."""
        self.var_of.clear()
        self._pins.clear()
