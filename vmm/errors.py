"""The one error hierarchy of the project.

It lives in the lowest layer (``vmm``) so that ``scheduler``, ``vmm`` and ``ooc`` raise
subclasses of the same ``OOCError`` without importing each other's internals; ``ooc``
re-exports the classes users catch.
"""

from __future__ import annotations


class OOCError(Exception):
    """Base of every error ooc raises on purpose.

    ``step_applied``: on an error raised out of ``with engine.step():``, whether what the step
    did stays (True: its update ran, or began, or a step without one kept its gradients; go on
    with the next batch) or was taken back (False: run that batch again, after what the error
    asks). None where no step ran (raised by the constructor, ``set_budget``, a step refused at
    its start): nothing of one was applied either. A loop that retries on ``BudgetTooSmall``
    reads it rather than the message.
    """

    step_applied: bool | None = None


class OutOfBudget(OOCError, MemoryError):
    """A request does not fit in the physical budget of a pool.

    A ``MemoryError`` too, so code that already catches allocation failures keeps working.
    """


class VMMError(OOCError):
    """A virtual-memory operation failed (bad chunk size, backend call error, misuse)."""


class CachingAllocatorError(VMMError):
    """Misuse of the caching allocator: double free, a foreign or split-away block."""
