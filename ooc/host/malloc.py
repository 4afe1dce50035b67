"""Make freed CPU tensors give their memory back to the operating system.

glibc serves blocks below its mmap threshold from its heap, and raises that threshold (up
to 32 MiB) every time a large mmapped block is freed. After a few steps, activations of a
few MiB live in the heap, and the holes they leave when ooc swaps them out are rarely
returned to the system: the process keeps the memory swapping was meant to save. A fixed
threshold of 1 MiB stops the adjustment; blocks at or above it are mmapped and unmapped on
free. Set while an engine holds it (from its first step to its close), and only if the user
did not choose (MALLOC_MMAP_THRESHOLD_).

glibc has no way back to its sliding threshold once one is fixed: when the last engine lets
go, the threshold is fixed at 32 MiB and the trim threshold at 64 MiB, where glibc's own
adjustment ends up for tensors of that size (its ceiling, DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
systems). Plain PyTorch training in the same process then reuses heap blocks again instead of
faulting in fresh pages for every large tensor (that cost +44% on a ResNet-18 step here).

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
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
GLIBC_MMAP_CEILING = 32 << 20
_holders = 0   # engines holding the fixed threshold; it was set here when this went 0 -> 1
_set_here = False
_threshold = GLIBC_MMAP_CEILING   # the lowest threshold a holder asked for, while one holds it
_lock = threading.Lock()
_libc = None


def release_freed_memory(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for one more holder (an engine's first
    step), or lower it there if a holder fixed it higher; True if it was set by this call."""
    global _holders, _set_here, _threshold
    with _lock:
        _holders += 1
        if (_holders > 1 and threshold >= _threshold) or "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return False
        libc = _glibc()
        if libc is None:   # not glibc (musl, macOS): nothing to tune
            return False
        _set_here = bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold))) or _set_here
        _threshold = threshold
    log.info("glibc mmap threshold fixed at %d bytes so freed activations return to the OS", threshold)
    return _set_here


def keep_freed_memory() -> None:
    """One holder is done (its engine closed): the last one puts glibc's thresholds where its
    own adjustment would have taken them (see the module docstring)."""
    global _holders, _set_here, _threshold
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _set_here:
            libc = _glibc()
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_CEILING)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_CEILING)
            _set_here, _threshold = False, GLIBC_MMAP_CEILING


def holds() -> bool:
    """Whether an engine holds the fixed threshold now."""
    return _holders > 0


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
