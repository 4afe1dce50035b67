"""Make freed CPU tensors give their memory back to the operating system.

glibc serves blocks below its mmap threshold from its heap, and raises that threshold (up
to 32 MiB) every time a large mmapped block is freed. After a few steps, activations of a
few MiB live in the heap, and the holes they leave when ooc swaps them out are rarely
returned to the system: the process keeps the memory swapping was meant to save. A fixed
threshold of 1 MiB stops the adjustment; blocks at or above it are mmapped and unmapped on
free. Set once per process, and only if the user did not choose (MALLOC_MMAP_THRESHOLD_).

The threshold only governs what is allocated after it is set: a model built before the
engine has its parameters in glibc's heap already (the default threshold rises during
initialisation), and when they are swapped out the heap keeps their pages. ``give_back_heap``
(glibc's ``malloc_trim``) returns the free pages inside the heap; the engine calls it at the
end of every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
_done = False
_libc = None


def release_freed_memory(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True if it was set here."""
    global _done
    if _done or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    _done = True
    libc = _glibc()
    if libc is None:   # not glibc (musl, macOS): nothing to tune
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    log.info("glibc mmap threshold fixed at %d bytes so freed activations return to the OS", threshold)
    return ok


def give_back_heap() -> bool:
    """Return the free pages inside glibc's heaps to the system; True if any were."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has mallopt and malloc_trim), loaded once; else None."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.mallopt, _libc.malloc_trim   # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _libc = False
    return _libc or None
