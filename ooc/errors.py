"""Errors users catch: the whole surface is these four names (plus the base)."""

from __future__ import annotations

from scheduler.errors import BudgetTooSmall
from vmm.errors import OOCError, OutOfBudget

__all__ = ["OOCError", "BudgetTooSmall", "OutOfBudget", "StorageError"]


class StorageError(OOCError, OSError):
    """The slower tier failed: no room, an I/O error, a short transfer, corrupted bytes, or an
    unsafe storage directory. The message names the file system, the variable and the bytes."""
