"""Hugging Face Accelerate's training loop, the engine given what ``accelerator.prepare``
returned: ``accelerator.accumulate`` over two micro-batches, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` on the synchronized one, an LR scheduler, bitwise as the same
loop without the engine.

``prepare`` wraps the optimizer in an ``AcceleratedOptimizer``, an ``Optimizer`` whose
``__init__`` skips ``Optimizer.__init__`` and whose ``step()`` calls the user's (and skips it
between synchronized micro-batches). Given to the engine, registering its step hooks raised
``AttributeError: 'AcceleratedOptimizer' object has no attribute '_optimizer_step_pre_hooks'``;
the engine now hooks the optimizer it wraps (``ooc.engine.arguments.stepped_optimizer``).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import ooc
from test_reliability import ALL

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _trained(base: torch.nn.Module, engine_kw: dict | None) -> tuple[dict, dict]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = [torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(12)]
    model, opt, loader, sched = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=None),
                                                    sched)
    engine = ooc.OutOfCore(model, opt, **engine_kw) if engine_kw is not None else None
    model.train()
    try:
        for i, ids in enumerate(loader):
            torch.manual_seed(1000 + i)   # dropout
            with accelerator.accumulate(model):
                with engine.step() if engine is not None else contextlib.nullcontext():
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        stats = engine.stats() if engine is not None else {}
    finally:
        if engine is not None:
            engine.close()
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, stats


@pytest.mark.parametrize("manage,budget", [(("activations",), 768 << 10), (ALL, 1 << 20)], ids=["default", "all"])
def test_accelerates_loop_trains_bitwise_with_its_prepared_optimizer(manage: tuple[str, ...], budget: int) -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_layer=2, n_embd=64, n_head=2,
                                                                n_positions=32))
    ref, _ = _trained(base, None)
    got, stats = _trained(base, {"budget": budget, "manage": manage})
    for name, a in ref.items():
        assert torch.equal(a, got[name]), f"{name} differs from the loop without the engine"
    assert stats["bytes_out"] > 0 and stats["steps"] == 12 and stats["steps.planned"] + stats["steps.anchored"] > 0


def test_an_optimizer_that_wraps_none_without_step_hooks_is_refused() -> None:
    class Bare(torch.optim.Optimizer):
        def __init__(self, params) -> None:   # Optimizer.__init__ not run: no step hooks
            self.param_groups = [{"params": list(params)}]

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ooc.OOCError, match="Bare has no step hooks"):
        ooc.OutOfCore(model, Bare(model.parameters()), budget="1MiB")
