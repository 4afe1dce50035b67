"""Hugging Face ``Trainer`` under ``OutOfCore`` (``ooc.integrations.transformers``), in one line.

A tiny Llama (2 layers, random weights, nothing downloaded) trained by ``Trainer`` for 4
updates of 2 micro-batches each, with ``max_grad_norm`` clipping, bf16 autocast, a linear LR
schedule and checkpoints every 2 updates; once with a LoRA adapter from ``peft``
(activations managed, the Trainer's default fused AdamW), once the whole model with all four
kinds managed (unfused AdamW). The same ``Trainer`` run without ooc is the reference: same
seeds, same data. Parameters, optimizer state, logged losses and gradient norms, and every
checkpoint file must be bitwise equal, under a quarter of the managed peak (bytes must move);
a run resumed from the out-of-core run's checkpoint, under ooc, must end where the reference
ends. A library that does not import skips, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ooc
from ooc.errors import OOCError
from test_outside_models import _library, _quiet_transformers, least_step_budget  # noqa: F401
from test_reliability import ALL, _one_torch_thread  # noqa: F401

_, WHY = _library("transformers")
if WHY is None:
    _, WHY = _library("accelerate")   # the Trainer needs it
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")]

UPDATES, SAVE = 4, 2
OPTIONS = {"options": ooc.Options(chunk="16KiB", min_bytes=4096)}   # tiny model: manage its small tensors too


class _Tokens(torch.utils.data.Dataset):
    """16 random sequences, the same in every run."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(lora: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, vocab_size=128, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.1))
    return model


def _trainer(out: Path, lora: bool, optim: str, steps: int = UPDATES, callbacks: list | None = None):
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=steps, bf16=True, use_cpu=True, report_to=[],
        save_steps=SAVE, logging_steps=1, seed=3, learning_rate=1e-3, lr_scheduler_type="linear",
        optim=optim, dataloader_num_workers=0, disable_tqdm=True)
    return transformers.Trainer(model=_model(lora), args=args, train_dataset=_Tokens(),
                                callbacks=callbacks or [])


def _train(out: Path, lora: bool, optim: str, ooc_kw: dict | None, steps: int = UPDATES,
           resume: Path | None = None) -> dict[str, Any]:
    """One ``trainer.train()``; ``ooc_kw=None``: without ooc."""
    from ooc.integrations.transformers import out_of_core

    trainer = _trainer(out, lora, optim, steps)
    run = out_of_core(trainer, **ooc_kw) if ooc_kw is not None else None
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    assert torch._C._len_torch_dispatch_stack() == 0, "a step was left open"
    log = [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
           for e in trainer.state.log_history]
    return {"state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "opt": trainer.optimizer.state_dict(), "log": log,
            "stats": run.stats() if run is not None else None}


def _assert_same_tensors(a: Any, b: Any, what: str) -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_same_tensors(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensors(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _checkpoint(path: Path) -> dict[str, Any]:
    """What a Trainer checkpoint holds, loaded as a user loads it (no pickle of code)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {f.name: load_file(f) for f in sorted(path.glob("*.safetensors"))}
    for name in ("optimizer.pt", "scheduler.pt"):
        out[name] = torch.load(path / name, weights_only=True)
    assert any(n.endswith(".safetensors") for n in out), f"no weights in {path}"
    return out


CASES = {   # name: (LoRA, TrainingArguments.optim, manage)
    "lora-activations": (True, "adamw_torch_fused", ("activations",)),
    "full-all": (False, "adamw_torch", ALL),   # a fused optimizer cannot run one parameter at a time
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_is_bitwise_and_its_checkpoints_load(case: str, tmp_path: Path) -> None:
    lora, optim, manage = CASES[case]
    if lora:
        _, why = _library("peft")
        if why is not None:
            pytest.skip(why)
    ref = _train(tmp_path / "ref", lora, optim, None)
    probe = _train(tmp_path / "probe", lora, optim, {"budget": "4GiB", "manage": manage, **OPTIONS}, steps=2)
    budget = probe["stats"]["plan.in_core_peak_bytes"] // 4
    got = _train(tmp_path / "ooc", lora, optim, {"budget": budget, "manage": manage, **OPTIONS})

    _assert_same_tensors(ref["state"], got["state"], "parameters")
    _assert_same_tensors(ref["opt"], got["opt"], "optimizer state")
    _assert_same_tensors(ref["log"], got["log"], "logged loss, grad_norm, learning_rate")
    stats = got["stats"]
    assert stats["steps"] == UPDATES, "one engine step per optimizer step"
    assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0, "a quarter of the peak must swap"
    assert stats["plan.peak_resident_bytes"] <= budget and stats["last_planned"] == 1
    for step in range(SAVE, UPDATES + 1, SAVE):
        name = f"checkpoint-{step}"
        _assert_same_tensors(_checkpoint(tmp_path / "ref" / name), _checkpoint(tmp_path / "ooc" / name), name)

    # Loadable: resumed from the out-of-core run's first checkpoint, under ooc, the run ends
    # bitwise where the uninterrupted reference does.
    resumed = _train(tmp_path / "resumed", lora, optim, {"budget": budget, "manage": manage, **OPTIONS},
                     resume=tmp_path / "ooc" / f"checkpoint-{SAVE}")
    _assert_same_tensors(ref["state"], resumed["state"], "parameters after resuming")
    _assert_same_tensors(ref["opt"], resumed["opt"], "optimizer state after resuming")


def test_trainer_under_the_least_budget_for_the_whole_step(tmp_path: Path) -> None:
    """``Options(budget_covers="step")`` through ``out_of_core``, every kind managed: each
    ``BudgetTooSmall`` the Trainer's run raises names a larger step budget (the update's own
    refusal, at ``optimizer.step()``, named the managed share's minimum, and a loop raising the
    budget to it was refused again at every try), and at the last the run is bitwise the one
    without ooc, checkpoints too, and resumes from its checkpoint to the same end."""
    lora, optim, manage = CASES["full-all"]
    options = {"options": ooc.Options(chunk="16KiB", min_bytes=4096, budget_covers="step")}
    ref = _train(tmp_path / "ref", lora, optim, None)
    got, budget, named = least_step_budget(
        lambda budget, k: _train(tmp_path / f"ooc{k}", lora, optim, {"budget": budget, "manage": manage, **options}))
    k = len(named)   # the try that trained
    assert named, "64 KiB for every tensor of the step must be refused"
    _assert_same_tensors(ref["state"], got["state"], "parameters")
    _assert_same_tensors(ref["opt"], got["opt"], "optimizer state")
    _assert_same_tensors(ref["log"], got["log"], "logged loss, grad_norm, learning_rate")
    stats = got["stats"]
    assert stats["step_budget"] == budget and stats["bytes_out"] > 0 and stats["last_planned"] == 1
    for step in range(SAVE, UPDATES + 1, SAVE):
        name = f"checkpoint-{step}"
        _assert_same_tensors(_checkpoint(tmp_path / "ref" / name), _checkpoint(tmp_path / f"ooc{k}" / name), name)
    resumed = _train(tmp_path / "resumed", lora, optim, {"budget": budget, "manage": manage, **options},
                     resume=tmp_path / f"ooc{k}" / f"checkpoint-{SAVE}")
    _assert_same_tensors(ref["state"], resumed["state"], "parameters after resuming")


def test_an_exception_in_the_loop_rolls_the_step_back_and_closes_the_engine(tmp_path: Path) -> None:
    """An exception after the third window's backward, before its update (another callback's
    ``on_pre_optimizer_step``): ``train()`` raises it, no step is left open, the engine is
    closed and model and optimizer are as the reference saved them after the second update."""
    import transformers
    from safetensors.torch import load_file

    from ooc.integrations.transformers import out_of_core

    class Boom(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == SAVE:
                raise RuntimeError("boom before the update")

    _train(tmp_path / "ref", False, "adamw_torch", None)   # its checkpoint after update 2
    trainer = _trainer(tmp_path / "ooc", False, "adamw_torch", callbacks=[Boom()])
    run = out_of_core(trainer, budget="256KiB", **OPTIONS)
    with pytest.raises(RuntimeError, match="boom before the update"):
        trainer.train()
    assert torch._C._len_torch_dispatch_stack() == 0 and run.engine is None
    assert run.stats()["bytes_out"] > 0
    saved = tmp_path / "ref" / f"checkpoint-{SAVE}"
    _assert_same_tensors(load_file(saved / "model.safetensors"),
                         {k: v for k, v in trainer.model.state_dict().items()}, "parameters")
    _assert_same_tensors(torch.load(saved / "optimizer.pt", weights_only=True),
                         trainer.optimizer.state_dict(), "optimizer state")
    assert all(p.grad is None for p in trainer.model.parameters()), "the step's gradients stay"


def test_misuse_is_refused_before_training(tmp_path: Path) -> None:
    from ooc.integrations.transformers import OutOfCoreCallback, out_of_core

    trainer = _trainer(tmp_path / "a", False, "adamw_torch")
    with pytest.raises(OOCError, match="budget"):
        out_of_core(trainer, budget="lots")
    with pytest.raises(OOCError, match="unknown kind"):
        out_of_core(trainer, budget="1MiB", manage=("weights",))
    out_of_core(trainer, budget="1MiB")
    with pytest.raises(OOCError, match="already"):
        out_of_core(trainer, budget="1MiB")

    alone = _trainer(tmp_path / "b", False, "adamw_torch", callbacks=[OutOfCoreCallback(budget="1MiB")])
    with pytest.raises(OOCError, match="out_of_core"):
        alone.train()

    fused = _trainer(tmp_path / "c", False, "adamw_torch_fused")
    out_of_core(fused, budget="1MiB", manage=ALL)
    with pytest.raises(OOCError, match="fused") as info:
        fused.train()
    assert "adamw_torch" in "".join(getattr(info.value, "__notes__", []))
    assert torch._C._len_torch_dispatch_stack() == 0
