"""Lightning's ``Trainer`` under ``OutOfCore`` (``ooc.integrations.lightning.OutOfCoreCallback``).

A small ``LightningModule`` (ooc's two-block GPT with dropout, AdamW, a step-interval
OneCycle schedule) trained by ``Trainer`` with automatic optimization for 4 updates of 2
micro-batches each (``accumulate_grad_batches=2``), ``gradient_clip_val``, ``bf16-mixed``,
and ``ModelCheckpoint`` every 2 updates. The same ``Trainer`` run without ooc is the
reference: same seeds, same data. Parameters, optimizer state and every checkpoint's weights,
optimizer and scheduler state must be bitwise equal under a quarter of the managed peak
(bytes must move), activations managed and all four kinds; ``fit(ckpt_path=...)`` from the
out-of-core run's checkpoint, under ooc, must end where the same resumption from the
reference's checkpoint ends without ooc. Skips, saying
why, where Lightning does not import.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import ooc
from ooc.errors import OOCError
from test_integrations_transformers import _assert_same_tensors
from test_outside_models import _library, least_step_budget
from test_reliability import ALL, _one_torch_thread  # noqa: F401

L, WHY = _library("lightning")
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

UPDATES, SAVE, ACCUMULATE = 4, 2, 2
OPTIONS = {"options": ooc.Options(chunk="16KiB", min_bytes=4096)}   # small model: manage its small tensors too


@pytest.fixture(autouse=True, scope="module")
def _quiet_lightning():
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _module(fail_at: int | None = None, optimizer: str = "adamw") -> Any:
    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ooc.models.tiny_transformer(vocab=128)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == fail_at:
                raise RuntimeError("boom in the forward")
            x, y = batch
            loss = ooc.models.lm_loss(self.net(x), y)
            self.log("loss", loss, on_step=True, on_epoch=True)   # inside the step, as users log
            return loss

        def configure_optimizers(self) -> Any:
            if optimizer == "lbfgs":
                return torch.optim.LBFGS(self.parameters())
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=UPDATES)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LM()


def _data() -> torch.utils.data.DataLoader:
    x = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(5))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4,
                                       shuffle=True, generator=torch.Generator().manual_seed(9))


def _fit(out: Path, ooc_kw: dict | None, module: Any = None, steps: int = UPDATES,
         resume: Path | None = None) -> dict[str, Any]:
    """One ``trainer.fit``; ``ooc_kw=None``: without ooc."""
    from ooc.integrations.lightning import OutOfCoreCallback

    module = module if module is not None else _module()
    run = OutOfCoreCallback(**ooc_kw) if ooc_kw is not None else None
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=SAVE, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=ACCUMULATE,
                        gradient_clip_val=0.5, precision="bf16-mixed", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[saves] + ([run] if run is not None else []))
    torch.manual_seed(1)   # dropout
    trainer.fit(module, _data(), ckpt_path=str(resume) if resume is not None else None)
    assert torch._C._len_torch_dispatch_stack() == 0, "a step was left open"
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "opt": trainer.optimizers[0].state_dict(), "stats": run.stats() if run is not None else None}


def _checkpoint(path: Path) -> dict[str, Any]:
    saved = torch.load(path, weights_only=True)
    return {k: saved[k] for k in ("state_dict", "optimizer_states", "lr_schedulers", "global_step")}


def _checkpoints(out: Path) -> dict[int, Path]:
    return {int(p.stem.split("step=")[1]): p for p in out.glob("*.ckpt")}


@pytest.mark.parametrize("manage", ["activations", "all"])
def test_lightning_is_bitwise_and_its_checkpoints_load(manage: str, tmp_path: Path) -> None:
    kinds = ALL if manage == "all" else ("activations",)
    ref = _fit(tmp_path / "ref", None)
    probe = _fit(tmp_path / "probe", {"budget": "4GiB", "manage": kinds, **OPTIONS}, steps=SAVE + 1)
    budget = probe["stats"]["plan.in_core_peak_bytes"] // 4
    got = _fit(tmp_path / "ooc", {"budget": budget, "manage": kinds, **OPTIONS})

    _assert_same_tensors(ref["state"], got["state"], "parameters")
    _assert_same_tensors(ref["opt"], got["opt"], "optimizer state")
    stats = got["stats"]
    assert stats["steps"] == UPDATES * ACCUMULATE, "one engine step per batch"
    assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0, "a quarter of the peak must swap"
    assert stats["plan.peak_resident_bytes"] <= budget and stats["last_planned"] == 1
    saved, ours = _checkpoints(tmp_path / "ref"), _checkpoints(tmp_path / "ooc")
    assert sorted(saved) == sorted(ours) == list(range(SAVE, UPDATES + 1, SAVE))
    for step, path in saved.items():
        _assert_same_tensors(_checkpoint(path), _checkpoint(ours[step]), f"checkpoint at step {step}")

    # Loadable: resumed from the out-of-core run's first checkpoint, under ooc, the run ends
    # bitwise where the same resumption from the reference's checkpoint ends without ooc
    # (Lightning keeps no RNG state in a checkpoint: a resumed run is not the uninterrupted one).
    again = _fit(tmp_path / "again", None, resume=saved[SAVE])
    resumed = _fit(tmp_path / "resumed", {"budget": budget, "manage": kinds, **OPTIONS}, resume=ours[SAVE])
    _assert_same_tensors(again["state"], resumed["state"], "parameters after resuming")
    _assert_same_tensors(again["opt"], resumed["opt"], "optimizer state after resuming")


def test_lightning_under_the_least_budget_for_the_whole_step(tmp_path: Path) -> None:
    """``OutOfCoreCallback(..., options=ooc.Options(budget_covers="step"))``, every kind
    managed: each ``BudgetTooSmall`` a ``fit`` raises names a larger step budget (the backward's
    bytes beside the working set, the update's own need at ``optimizer.step()``), and at the
    last the run is bitwise the one without ooc."""
    options = {"options": ooc.Options(chunk="16KiB", min_bytes=4096, budget_covers="step")}
    ref = _fit(tmp_path / "ref", None)
    got, budget, named = least_step_budget(
        lambda budget, k: _fit(tmp_path / f"ooc{k}", {"budget": budget, "manage": ALL, **options}))
    assert named, "64 KiB for every tensor of the step must be refused"
    _assert_same_tensors(ref["state"], got["state"], "parameters")
    _assert_same_tensors(ref["opt"], got["opt"], "optimizer state")
    stats = got["stats"]
    assert stats["step_budget"] == budget and stats["bytes_out"] > 0 and stats["last_planned"] == 1


def test_an_exception_in_fit_rolls_the_step_back_and_closes_the_engine(tmp_path: Path) -> None:
    """The third window's second micro-batch raises in its forward: ``fit`` raises it, no step
    is left open, the engine is closed, and parameters and optimizer state are those the
    reference saved after the second update."""
    from ooc.integrations.lightning import OutOfCoreCallback

    _fit(tmp_path / "ref", None)
    module = _module(fail_at=SAVE * ACCUMULATE + 1)
    with pytest.raises(RuntimeError, match="boom in the forward"):
        _fit(tmp_path / "ooc", {"budget": "512KiB", **OPTIONS}, module=module)
    assert torch._C._len_torch_dispatch_stack() == 0
    saved = _checkpoint(_checkpoints(tmp_path / "ref")[SAVE])
    _assert_same_tensors(saved["state_dict"], module.state_dict(), "parameters")
    run = next(cb for cb in module.trainer.callbacks if isinstance(cb, OutOfCoreCallback))
    assert run.engine is None and run.stats()["bytes_out"] > 0
    _assert_same_tensors(saved["optimizer_states"][0]["state"],
                         module.trainer.optimizers[0].state_dict()["state"], "optimizer state")


def test_misuse_is_refused(tmp_path: Path) -> None:
    from ooc.integrations.lightning import OutOfCoreCallback

    with pytest.raises(OOCError, match="budget"):
        OutOfCoreCallback(budget="lots")
    with pytest.raises(OOCError, match="unknown kind"):
        OutOfCoreCallback(budget="1MiB", manage="weights")
    with pytest.raises(OOCError, match="LBFGS"):
        _fit(tmp_path, {"budget": "1MiB"}, module=_module(optimizer="lbfgs"))
