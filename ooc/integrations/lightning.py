"""Lightning's ``Trainer`` under ``OutOfCore``, in one line: a ``Callback``.

::

    import torch, lightning, ooc
    from ooc.integrations.lightning import OutOfCoreCallback

    class LM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ooc.models.tiny_transformer(vocab=128)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return ooc.models.lm_loss(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x = torch.randint(0, 128, (32, 32))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    run = OutOfCoreCallback(budget="512KiB")                    # the one line
    trainer = lightning.Trainer(accelerator="cpu", max_steps=4, accumulate_grad_batches=2,
                                gradient_clip_val=1.0, precision="bf16-mixed", logger=False,
                                enable_checkpointing=False, callbacks=[run])
    trainer.fit(LM(), data)
    print(run.stats()["bytes_out"])                             # what the engine swapped out

The seam: each batch runs inside one ``engine.step()``, opened at ``on_train_batch_start``
and closed at ``on_train_batch_end``: its ``training_step`` (the forward), the ``zero_grad``
that Lightning puts in a window's first micro-batch after the forward, the backward, and in a
window's last micro-batch the clipping, ``optimizer.step()`` and a step-interval scheduler.
Lightning zeroes lazily, so every micro-batch starts with gradients (the last update's, or
the window's earlier micro-batches') while the first zeroes them and the last updates: each
step passes its place in the window (``batch_idx % accumulate_grad_batches``) as its kind
(``OutOfCore.step(kind)``), and each kind keeps its own plan. Not one step per window: between
micro-batches Lightning runs the other callbacks' ``on_train_batch_end`` (``ModelCheckpoint``
makes tensors there in every other window), logs and loads the next batch, and those ops
inside the step made consecutive windows differ from each other's plan.

Lightning calls ``optimizer.step(closure)``, with the forward, backward and clipping inside
the closure, which runs after the optimizer's step pre-hooks, where the engine has its commit
point; so the callback adds a pre-hook of its own, ahead of the engine's, that runs the
closure first and hands the optimizer its result. Validation, logging and ``ModelCheckpoint``
(which Lightning calls after the other callbacks) run between steps, as plain PyTorch;
managed tensors over the budget come back for ``state_dict()`` by themselves. The engine is
made at ``on_train_start`` on the ``LightningModule`` and its one optimizer, and closed at
``on_train_end``; an exception in ``fit`` (``on_exception``) rolls the open step back as
``with engine.step():`` does, then closes the engine.

What is guaranteed (``tests/ooc/test_integrations_lightning.py``): with automatic
optimization, ``accumulate_grad_batches``, ``gradient_clip_val``, ``bf16-mixed``, a
step-interval scheduler and ``self.log`` in ``training_step``, parameters, optimizer state and
the checkpoints ``ModelCheckpoint`` saves are bitwise those of the same ``Trainer`` run without
ooc (same seeds, same data), activations managed or all four kinds; ``fit(ckpt_path=...)``
from such a checkpoint under ooc ends bitwise where the same resumption without ooc does.
Not guaranteed: an optimizer that evaluates its closure more than once per step (LBFGS:
refused), more than one optimizer (refused), manual optimization and multi-process strategies
(untested), a compiled module (refused by the engine), the standalone ``pytorch_lightning``
package's ``Trainer`` (its ``Callback`` is another class: this one is ``lightning.pytorch``'s).
An epoch whose length is not a multiple of ``accumulate_grad_batches`` ends on a short window
whose last batch updates under the kind of a batch that does not: that step re-plans.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ooc.errors import OOCError
from ooc.integrations.held_step import HeldStep
from ooc.runtime.user_hooks import UserHook

try:
    import lightning.pytorch as pl
except ImportError as exc:   # only this module needs it: ``import ooc`` never does
    raise ImportError("ooc.integrations.lightning needs Lightning (pip install lightning)") from exc


class OutOfCoreCallback(pl.Callback):
    """Train under ``OutOfCore(pl_module, optimizer, budget=budget, manage=manage, **options)``,
    one ``engine.step()`` per batch (see the module's docstring). ``engine`` during
    ``fit``; ``stats()`` during and after. A bad budget or kind fails here, before ``fit``."""

    def __init__(self, *, budget: int | str, manage: tuple[str, ...] | list[str] | str = ("activations",),
                 **options: Any) -> None:
        self._held = HeldStep(budget, manage, options)
        self._closure_hook: Any = None

    @property
    def engine(self):
        """The ``OutOfCore`` engine of the running ``fit``; None outside it."""
        return self._held.engine

    def stats(self) -> dict[str, int | float]:
        """The engine's ``stats()``; after ``fit``, those it had at its end ({} before)."""
        return self._held.stats()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise OOCError(f"OutOfCore takes one optimizer; this LightningModule has {len(trainer.optimizers)}")
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, torch.optim.LBFGS):
            raise OOCError("LBFGS evaluates its closure several times per step, after the update "
                           "began; under OutOfCore the closure runs once, before it: use another optimizer")
        # Registered before the engine's own pre-hook, so it runs first (see _closure_first).
        self._closure_hook = optimizer.register_step_pre_hook(UserHook(self._closure_first))
        self._held.start(pl_module, optimizer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._held.enter(kind=batch_idx % trainer.accumulate_grad_batches)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._held.leave()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A batch skipped by on_train_batch_start returning -1 never reaches on_train_batch_end.
        self._held.leave()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unhook()
        self._held.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._unhook()
        raised = self._held.abandon(exception)   # the open step rolled back, the engine closed
        if raised is not exception:   # Lightning raises its own: keep what the rollback said
            exception.add_note(f"ooc: {type(raised).__name__}: {raised}")

    def _closure_first(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(closure)`` pre-hook, ahead of the engine's: inside an open step, run
        the closure now (forward, backward, clipping) and give the optimizer its result, so
        that the engine's commit point (its own pre-hook) comes after the backward, where it
        comes in a loop that calls ``optimizer.step()`` after ``loss.backward()``."""
        if not self._held.open:
            return None
        positional = "closure" not in kwargs and len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            return None
        with torch.enable_grad():
            result = closure()
        evaluated = _once(result, type(optimizer).__name__)
        if positional:
            return (args[0], evaluated, *args[2:]), kwargs
        return args, {**kwargs, "closure": evaluated}

    def _unhook(self) -> None:
        if self._closure_hook is not None:
            self._closure_hook.remove()
            self._closure_hook = None


def _once(result: Any, optimizer: str) -> Callable[[], Any]:
    """A closure that returns the result of the one that already ran, and refuses to be
    evaluated twice (the forward and backward would not run again)."""
    calls = 0

    def evaluated() -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OOCError(f"{optimizer} evaluated its closure twice in one step: under OutOfCore "
                           "the closure runs once, before the update; use an optimizer that calls it once")
        return result

    evaluated.ooc_ran = True   # type: ignore[attr-defined] # the engine's update hook: it ran already
    return evaluated
