"""Ctrl-C during the optimizer update waits for the update to end.

A step is rolled back when it fails before its update (``ooc/runtime/rollback.py``); once
the update has started it is not (the undo copies are gone, and an update is many ops, one
per parameter). A ``KeyboardInterrupt`` raised between two of those ops would leave some
parameters updated and the others not: silently wrong weights for a user who catches it to
save a checkpoint, which is what most training scripts do. So from the commit point to the
end of ``optimizer.step()`` the engine holds SIGINT: the signal is noted, and delivered to
the handler that was installed before (Python's, which raises ``KeyboardInterrupt``) as soon
as the update is whole. A Ctrl-C therefore leaves a step either not applied at all or
applied entirely.

Only the main thread of the main interpreter may change signal handlers; a step run on any
other thread cannot receive SIGINT's ``KeyboardInterrupt`` anyway, and holds nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["DeferredInterrupt"]


class DeferredInterrupt:
    """``hold()`` notes SIGINT instead of acting on it; ``release()`` puts the previous
    handler back and gives it the signal if one came meanwhile."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._held = False
        self._arrived = False

    def hold(self) -> None:
        if self._held or threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is None:   # installed from C: not ours to wrap
                return
            signal.signal(signal.SIGINT, self._note)
        except ValueError:   # not the main interpreter
            return
        self._previous, self._held, self._arrived = previous, True, False

    def release(self) -> None:
        """Restore the handler, then deliver a SIGINT that arrived while held (the previous
        handler may raise ``KeyboardInterrupt`` here)."""
        if not self._held:
            return
        previous, arrived = self._previous, self._arrived
        signal.signal(signal.SIGINT, previous)
        self._previous, self._held, self._arrived = None, False, False
        if not arrived:
            return
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._arrived = True
