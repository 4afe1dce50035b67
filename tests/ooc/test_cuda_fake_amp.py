"""Mixed precision, recomputed dropout and the sparse slab tier on the CUDA path, over the FAKE
CUDA driver (``ooc.testing.fake_cuda``: CPU tensors stand for device memory; what runs above
the fake is the real pinned tier, CUDA pool and copy-stream logic).

A small GPT (dropout, AdamW) under bf16 autocast, and under fp16 autocast with a
``GradScaler``, trained with ``OutOfCore(device="cuda")`` at half its peak, bitwise against the
same loop without the engine after every step (losses, parameters, optimizer state): with
recomputation preferred (chains with dropout replayed from the generator state the op drew
from) and swap only (its settled plan runs anchored, no op intercepted; the trial's verdict
fixed to keep it, as the host's clock under load would decide either way). Its width makes
tensors of 1.25 chunks, which the pool places in sparse slabs when they come back.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
import ooc.testing
import vmm.small_blocks
from ooc.engine import hook_forms
from ooc.runtime import recipes as recompute_module
from test_anchored_steps import _decided
from test_engine import TinyGPT, _data, _loss

pytestmark = pytest.mark.timeout(120)

CHUNK = 64 << 10      # the fake's granularity
WIDTH = 80            # 8 x 32 x 80 fp32 = 80 KiB: rounds badly to chunks (medium tier: sparse slabs)
STEPS = 10


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(width=WIDTH)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _autocast(precision: str) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _step(model, opt, scaler, precision, step) -> torch.Tensor:
    x, y = _data("gpt", step)
    torch.manual_seed(1000 + step)   # dropout
    with _autocast(precision):
        loss = _loss("gpt", model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _peak(precision: str) -> int:
    model = _model()
    opt = _optimizer(model)
    e = ooc.OutOfCore(model, opt, device="cuda", budget="1GiB", options=ooc.Options(chunk=CHUNK, min_bytes=4096))
    with e.step():
        _step(model, opt, torch.amp.GradScaler("cpu", enabled=False), precision, 0)
    peak = e._plans.schedule.sequence.in_core_peak_bytes
    e.close()
    return peak


@pytest.mark.parametrize("recompute,arena", [("prefer", "pool"), ("never", "pool"), ("prefer", "auto")])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_on_the_cuda_path_is_bitwise_in_core(precision: str, recompute: str, arena: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The VMM pool (its sparse blocks hold AMP's small tensors) and the default, one arena."""
    counts = {"sparse": 0, "rng": 0}
    alloc_medium, set_rng = vmm.small_blocks.alloc_medium, recompute_module._set_rng_state

    def counted_sparse(*args):
        counts["sparse"] += 1
        return alloc_medium(*args)

    def counted_rng(*args):
        counts["rng"] += 1
        return set_rng(*args)

    monkeypatch.setattr(vmm.small_blocks, "alloc_medium", counted_sparse)
    monkeypatch.setattr(recompute_module, "_set_rng_state", counted_rng)
    # the anchored trial's verdict on the host's clock would depend on the machine's load
    monkeypatch.setattr(hook_forms.HookPlan, "judge", _decided(keep=True, runs=2))
    fp16 = precision == "fp16"
    with ooc.testing.fake_cuda() as driver:
        budget = max(CHUNK, _peak(precision) // 2 // CHUNK * CHUNK)
        model = _model()
        ref = copy.deepcopy(model)
        opt, ref_opt = _optimizer(model), _optimizer(ref)
        scaler, ref_scaler = torch.amp.GradScaler("cpu", enabled=fp16), torch.amp.GradScaler("cpu", enabled=fp16)
        e = ooc.OutOfCore(model, opt, device="cuda", budget=budget, recompute=recompute,
                          options=ooc.Options(chunk=CHUNK, min_bytes=4096, arena=arena))
        assert type(e._mem.pool).__name__ == {"pool": "CudaDevicePool", "auto": "TorchArenaPool"}[arena]
        forms = []
        for step in range(STEPS):
            want = _step(ref, ref_opt, ref_scaler, precision, step)
            with e.step():
                got = _step(model, opt, scaler, precision, step)
            forms.append(ooc.FORMS[e.stats()["last_form"]])
            assert torch.equal(want, got), f"step {step} ({forms[-1]}): loss {want.item()} vs {got.item()}"
            for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
                assert torch.equal(a, b), f"step {step} ({forms[-1]}): {name} differs from training without ooc"
            for s_ref, s in zip(ref_opt.state.values(), opt.state.values()):
                assert all(torch.equal(s_ref[k], s[k]) for k in s_ref), f"step {step}: optimizer state differs"
            assert scaler.get_scale() == ref_scaler.get_scale()
        stats = e.stats()
        e.close()
        assert driver.violations == []
        assert set(driver.outstanding().values()) == {0}, driver.outstanding()
    assert stats["bytes_out"] > 0 and (counts["sparse"] > 0) == (arena == "pool"), (stats["bytes_out"], counts)
    if recompute == "prefer":   # chains with dropout rerun from the generator state it drew from
        assert stats["bytes_recomputed"] > 0 and counts["rng"] > 0 and forms[-3:] == ["planned"] * 3, (forms, counts)
    else:
        assert stats["bytes_recomputed"] == 0 and forms[-3:] == ["anchored"] * 3, forms
