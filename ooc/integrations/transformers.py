"""Hugging Face ``Trainer`` under ``OutOfCore``, in one line.

::

    import torch, transformers, ooc.integrations.transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, max_position_embeddings=32))
    ids = torch.randint(0, 128, (16, 32))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments("out", per_device_train_batch_size=2, max_steps=4,
                                          gradient_accumulation_steps=2, max_grad_norm=1.0,
                                          bf16=True, use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    run = ooc.integrations.transformers.out_of_core(trainer, budget="256KiB")   # the one line
    trainer.train()
    print(run.stats()["bytes_out"])                  # what the engine swapped out

The seam: each optimizer step of the Trainer runs inside one ``engine.step()``, opened at
``on_step_begin`` (before the first micro-batch's forward) and closed at ``on_step_end``
(after its ``model.zero_grad()``): every micro-batch of gradient accumulation (forward and
``accelerator.backward``), clipping to ``max_grad_norm``, ``optimizer.step()`` (the engine
hooks the optimizer, under Accelerate's wrapper), the LR scheduler's step and the zero_grad.
Every window then starts in the same state (no gradients) and runs one plan. Logging,
evaluation and checkpoints (``save_steps``) run between steps, as plain PyTorch; managed
parameters and optimizer state over the budget come back for ``state_dict()`` by themselves.
The engine is made at ``on_train_begin``, when the Trainer has created (and Accelerate has
wrapped) its optimizer, on ``trainer.model`` and the torch optimizer inside Accelerate's;
it is closed at ``on_train_end``. ``out_of_core`` also wraps ``trainer.train`` on this
instance: a callback never sees an exception, and one that crosses the loop (the forward,
the backward, another callback) must roll the open step back; then the engine is closed and
the same exception raised, with model and optimizer as after the last whole update.

What is guaranteed (``tests/ooc/test_integrations_transformers.py``): parameters, optimizer
state, logged losses and gradient norms, and the checkpoints ``Trainer`` saves (adapter or
model weights, ``optimizer.pt``, ``scheduler.pt``) are bitwise those of the same Trainer run
without ooc (same seeds, same data), with gradient accumulation, ``max_grad_norm`` clipping,
bf16 autocast, an LR schedule, a LoRA adapter from ``peft``, activations managed or all four
kinds; a run resumed from such a checkpoint under ooc ends bitwise where the uninterrupted one
does. Not guaranteed: ``torch_compile=True`` (the engine refuses a compiled model); a fused
optimizer (the default ``adamw_torch_fused``) with ``params``, ``grads`` or
``optimizer_state`` managed (refused: ``optim="adamw_torch"``); DeepSpeed, FSDP and
multi-process runs (untested: the DDP and FSDP2 notes of docs/guide/distributed.md apply per
rank); more than one engine per Trainer.
"""

from __future__ import annotations

import functools
from typing import Any

from ooc.engine.arguments import stepped_optimizer
from ooc.errors import OOCError
from ooc.integrations.held_step import HeldStep

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:   # only this module needs it: ``import ooc`` never does
    raise ImportError("ooc.integrations.transformers needs Hugging Face transformers "
                      "(pip install transformers)") from exc


def out_of_core(trainer: Trainer, *, budget: int | str,
                manage: tuple[str, ...] | list[str] | str = ("activations",),
                **options: Any) -> "OutOfCoreCallback":
    """Train ``trainer`` under ``OutOfCore(model, optimizer, budget=budget, manage=manage,
    **options)``, one ``engine.step()`` per optimizer step (see the module's docstring).

    Adds an ``OutOfCoreCallback`` to the trainer and returns it: its ``engine`` during
    training, its ``stats()`` during and after. Also wraps this instance's ``train()``, so
    that an exception crossing the loop rolls the open step back and closes the engine
    before it is raised. A bad budget or kind fails here, before training starts.
    """
    if any(isinstance(cb, OutOfCoreCallback) for cb in trainer.callback_handler.callbacks):
        raise OOCError("this Trainer trains out of core already: one engine per Trainer")
    callback = OutOfCoreCallback(budget=budget, manage=manage, **options)
    callback._attached = True
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_out_of_core(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            raised = callback._held.abandon(exc)   # the open step rolled back, the engine closed
            if raised is exc:
                raise
            raise raised from exc

    trainer.train = train_out_of_core   # this instance only: its class is left as it is
    return callback


class OutOfCoreCallback(TrainerCallback):
    """What ``out_of_core(trainer, ...)`` adds to the trainer; made by that function, which
    also makes an exception in the loop roll the open step back (a callback alone never
    sees one)."""

    def __init__(self, *, budget: int | str, manage: tuple[str, ...] | list[str] | str = ("activations",),
                 **options: Any) -> None:
        self._held = HeldStep(budget, manage, options)
        self._attached = False

    @property
    def engine(self):
        """The ``OutOfCore`` engine of the running ``train()``; None outside it."""
        return self._held.engine

    def stats(self) -> dict[str, int | float]:
        """The engine's ``stats()``; after training, those it had at its end ({} before)."""
        return self._held.stats()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self._attached:
            raise OOCError("add ooc's callback with ooc.integrations.transformers.out_of_core(trainer, "
                           "budget=...), not in callbacks=[...]: it must also see the exceptions "
                           "that cross the training loop, to roll the open step back")
        if model is None or optimizer is None:
            raise OOCError("the Trainer gave its callbacks no model or optimizer at on_train_begin "
                           "(DeepSpeed creates its own): OutOfCore needs both")
        inner = stepped_optimizer(optimizer)   # Accelerate's AcceleratedOptimizer wraps the Trainer's
        try:
            self._held.start(model, inner)
        except OOCError as exc:
            if any(group.get("fused") for group in inner.param_groups):
                exc.add_note("with the Trainer: TrainingArguments(optim='adamw_torch') is AdamW unfused")
            raise

    def on_step_begin(self, args, state, control, **kwargs):
        self._held.enter()

    def on_step_end(self, args, state, control, **kwargs):
        self._held.leave()

    def on_epoch_end(self, args, state, control, **kwargs):
        # A window that another callback cut short (should_training_stop after a micro-batch)
        # never reaches on_step_end: its micro-batches end here, a step without an update,
        # before the Trainer saves or evaluates.
        self._held.leave()

    def on_train_end(self, args, state, control, **kwargs):
        self._held.finish()
