"""An ``engine.step()`` entered at one hook of a training framework and left at a later one.

A framework calls the user's code at its hooks (Hugging Face's ``on_step_begin`` and
``on_step_end``, Lightning's ``on_train_batch_start`` and ``on_train_batch_end``), not inside a
``with`` block the user writes, so the step's context manager is entered at one hook and left
at another. ``HeldStep`` owns that: the engine (made when the framework's model and
optimizer exist, closed when its training ends), the step it holds open between two hooks,
and the way out when an exception crosses the training loop: the open step is left with that
exception, so it is rolled back as ``with engine.step():`` rolls a step back (same exception,
model and optimizer as before the step), and the engine is closed (model and optimizer plain
PyTorch again, nothing left on the swap tier).

Entered and left on the framework's training thread; a step held open across hooks has the
engine's dispatch mode and saved-tensor hooks on top of PyTorch's stacks, so whatever the
framework enters in between (autocast, ``no_sync``) must be left before the step is, as the
frameworks' own ``with`` blocks are.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, Hashable

import torch

from ooc.engine import OutOfCore
from ooc.engine.arguments import KINDS
from ooc.errors import OOCError
from vmm.units import parse_size

log = logging.getLogger(__name__)


class HeldStep:
    """The engine of one training run and the step it holds open between two hooks.

    ``budget``, ``manage`` and ``options`` are ``OutOfCore``'s keyword arguments; the budget
    and the kinds are checked here, when the integration is made, so that a bad one fails
    before the framework starts training (the other options when the engine is made)."""

    def __init__(self, budget: int | str, manage: tuple[str, ...] | list[str] | str,
                 options: dict[str, Any]) -> None:
        parse_size(budget, what="budget")
        kinds = (manage,) if isinstance(manage, str) else tuple(manage)
        unknown = [m for m in kinds if m not in KINDS]
        if unknown:
            raise OOCError(f"manage: unknown kind(s) {unknown}; choose from {list(KINDS)}")
        self.budget, self.manage, self.options = budget, kinds, dict(options)
        self.engine: OutOfCore | None = None
        self._step: AbstractContextManager | None = None
        self._last_stats: dict[str, int | float] = {}

    @property
    def open(self) -> bool:
        """Whether a step is held open now."""
        return self._step is not None

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> OutOfCore:
        """Make the engine for a training run. One that a run left behind is closed first;
        a step it held open was cut off by an exception the framework caught and restarted
        after (Hugging Face's ``auto_find_batch_size`` after an out-of-memory error): it is
        rolled back."""
        if self._step is not None:
            self.abandon(OOCError("the training loop restarted while a step was open"))
        self.finish()
        self.engine = OutOfCore(model, optimizer, budget=self.budget, manage=self.manage, **self.options)
        return self.engine

    def enter(self, kind: Hashable = None) -> None:
        """Open a step (of ``kind``: ``OutOfCore.step``), unless one is open already."""
        if self._step is not None:
            return
        if self.engine is None:
            raise OOCError("no engine: the framework has not started training yet")
        step = self.engine.step(kind)
        step.__enter__()
        self._step = step

    def leave(self) -> None:
        """Close the open step, if any: it finishes as ``with engine.step():`` finishes (an
        error of its end, such as ``BudgetTooSmall``, is raised here)."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def abandon(self, exc: BaseException) -> BaseException:
        """``exc`` crossed the training loop: roll the open step back with it and close the
        engine. Returns the exception to raise: ``exc``, or the one the rollback raised
        instead (a swap failure after the update began says there that the update is partial)."""
        step, self._step = self._step, None
        raised: BaseException = exc
        if step is not None:
            try:
                step.__exit__(type(exc), exc, exc.__traceback__)
            except BaseException as other:  # noqa: BLE001 - handed to the caller to raise
                raised = other
        try:
            self.finish()
        except Exception:   # the loop's exception is the one to report; this one is logged
            log.exception("closing the engine after %r failed", exc)
        return raised

    def finish(self) -> None:
        """Training ended: close the open step, then the engine (its stats are kept)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            self.leave()
        finally:
            self._last_stats = engine.stats()
            engine.close()

    def stats(self) -> dict[str, int | float]:
        """The engine's ``stats()``; after training, those it had when it closed ({} before)."""
        return self.engine.stats() if self.engine is not None else dict(self._last_stats)
