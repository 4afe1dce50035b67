"""Cleanup that must not run where the garbage collector runs a finalizer.

A swap-file tier (or an engine) dropped without ``close()`` is cleaned up by a
``weakref.finalize``, and the collector runs finalizers at any allocation of any thread,
inside the threading module's own locked sections too. Joining the tier's I/O threads there
hung: a new I/O thread, while it registered itself (``threading._maintain_shutdown_locks``,
under ``_shutdown_locks_lock``), collected an engine dropped earlier, whose finalizer joined
that engine's threads; a join takes the same lock, which the joining thread held, and the
main thread waited for the new thread's start for ever (an outside-loop probe, 2026-11-28:
a ``BudgetTooSmall`` retry that left its engine to the collector). So a finalizer only queues
the work (:func:`later`: ``SimpleQueue.put`` is reentrant, safe in a finalizer) and one
daemon thread does it, while any owner is alive. At interpreter exit the queue is run by the
exiting thread.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["later", "release", "settled", "start"]

_queue: queue.SimpleQueue = queue.SimpleQueue()
_STOP = object()
_thread: threading.Thread | None = None
_holders = 0                 # owners alive whose finalizers may queue work
_lock = threading.Lock()     # start() and release() only: ordinary code, never a finalizer
_at_exit = False             # the interpreter runs its exit hooks: work runs where it is queued


def start() -> None:
    """One more owner whose finalizer may queue work: the reaper runs while any is alive.
    Called when the owner is made (ordinary code): starting a thread inside a finalizer is
    what must not be."""
    global _thread, _holders
    with _lock:
        _holders += 1
        if _thread is None:
            _thread = threading.Thread(target=_reap, name="ooc-reaper", daemon=True)
            _thread.start()


def release() -> None:
    """An owner's resources are gone (at its ``close()``, or on the reaper for one the
    collector finalized). With the last one the reaper ends, joined here unless this is the
    reaper: a closed engine leaves no thread behind."""
    global _thread, _holders
    with _lock:
        _holders -= 1
        if _holders > 0 or _thread is None:
            return
        reaper, _thread = _thread, None
        _queue.put((_STOP, ()))
    if reaper is not threading.current_thread():
        reaper.join()


def later(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on the reaper thread, soon; at once where the interpreter is exiting
    (the reaper, a daemon thread, may not run again) or no owner is alive (no reaper)."""
    if _exiting() or _thread is None:
        _run(fn, args)
    else:
        _queue.put((fn, args))


def settled(timeout: float | None = None) -> bool:
    """Wait until what was queued before this call has run; False if ``timeout`` passed
    first. For tests and for callers that need a dropped owner's resources gone."""
    reaper = _thread
    if reaper is None:
        _run_pending()
        return True
    done = threading.Event()
    _queue.put((done.set, ()))
    return done.wait(timeout)


def _reap() -> None:
    while True:
        fn, args = _queue.get()
        if fn is _STOP:
            return
        _run(fn, args)


def _run(fn: Callable[..., Any], args: tuple) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a failed cleanup must not stop the next ones
        log.warning("ooc: a deferred cleanup (%s) failed", getattr(fn, "__qualname__", fn), exc_info=True)


def _run_pending() -> None:
    while True:
        try:
            fn, args = _queue.get_nowait()
        except queue.Empty:
            return
        if fn is not _STOP:
            _run(fn, args)


def _exiting() -> bool:
    return _at_exit or sys.is_finalizing() or bool(getattr(weakref.finalize, "_shutdown", False))


def _exit() -> None:
    """At exit, before or after the finalizers' own exit hook: what is queued runs before the
    interpreter goes (the reaper finishes it, then ends; anything left runs here), and what
    finalizers queue from now on runs where they are."""
    global _at_exit, _thread
    _at_exit = True
    with _lock:
        reaper, _thread = _thread, None
    if reaper is not None:
        _queue.put((_STOP, ()))
        reaper.join()
    _run_pending()


atexit.register(_exit)
