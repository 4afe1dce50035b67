"""The one error hierarchy of the project.

It lives in the lowest layer (``vmm``) so that ``scheduler``, ``vmm`` and ``ooc`` raise
subclasses of the same ``OOCError`` without importing each other's internals; ``ooc``
re-exports the classes users catch.
"""

from __future__ import annotations


class OOCError(Exception):
    """Base of every error ooc raises on purpose."""


class OutOfBudget(OOCError, MemoryError):
    """A request does not fit in the physical budget of a pool.

    A ``MemoryError`` too, so code that already catches allocation failures keeps working.
    """


class VMMError(OOCError):
    """A virtual-memory operation failed (bad chunk size, backend call error, misuse)."""


class CachingAllocatorError(VMMError):
    """Misuse of the caching allocator: double free, a foreign or split-away block."""
