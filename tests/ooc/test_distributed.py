"""ooc under DistributedDataParallel and FSDP2, 2 ranks on the CPU with gloo (issue 19).

Each test starts 2 ranks as torchrun would (``dist_launch.py``; a hang kills them and fails
within its timeout). Every rank trains the job twice in one process group, without ooc and
with an engine per rank under about a quarter of the managed peak, from the same weights,
batches and per-rank RNG seed (dropout), and reports whether its parameters are bitwise
those of the job without ooc, plus their digest: parameters must also be equal across ranks.

What composes, and what is refused:
- DDP, with activations or all four kinds managed, gradient_as_bucket_view (p.grad becomes a
  view into DDP's bucket, which ooc leaves to DDP: a gradient that is a view is never
  managed; the bucket DDP rebuilds in step 2 was adopted and released under gloo's
  asynchronous all-reduce, "writev: Bad address"), find_unused_parameters,
  no_sync() accumulation; the engine on the DDP wrapper or on the inner module (the
  state-dict hooks go on the inner module either way, so ``ddp.module.state_dict()`` brings
  released parameters back).
- FSDP2 (``fully_shard``) with activations managed; saved views of its unsharded parameters
  (``weight.t()``) are FSDP2's to free and gather again, never swapped (with slow writes a
  write in flight read the freed storage). Managed params/grads/optimizer state of DTensor
  parameters are refused with an ``OOCError``.
"""

from __future__ import annotations

import pytest
import torch

import dist_launch

pytestmark = pytest.mark.timeout(240)

KiB = 1 << 10
ALL = ["activations", "params", "grads", "optimizer_state"]


# One launch for the module (each process start and first distributed step costs ~10 s on
# 2 busy cores); each test checks its own configs.
CONFIGS = {
    "cnn": [
        {"name": "cnn-activations", "model": "cnn", "mode": "ddp", "budget": 1024 * KiB,
         "manage": ["activations"], "steps": 5},
        # all kinds, the engine on the inner module, DDP's bucket views, an unused layer,
        # two micro-batches per update (the first under no_sync), writes delayed 20 ms
        {"name": "cnn-all", "model": "cnn", "mode": "ddp", "budget": 1024 * KiB, "manage": ALL,
         "steps": 4, "accum": 2, "bucket_view": True, "find_unused": True, "target": "inner",
         "slow_writes": 0.02},
    ],
    "transformer": [
        {"name": "tr-activations", "model": "tr", "mode": "ddp", "budget": 896 * KiB,
         "manage": ["activations"], "steps": 5, "slow_writes": 0.02},
        # all kinds on the DDP wrapper, under the params+grads+state total: they stay
        # released between steps, and ddp.module.state_dict() must bring them back. Bucket
        # views with zero_grad(set_to_none=False): p.grad stays a view into the bucket DDP
        # rebuilds in step 2; managed as a gradient, it was released under gloo's
        # all-reduce ("writev: Bad address")
        {"name": "tr-all", "model": "tr", "mode": "ddp", "budget": 1024 * KiB, "manage": ALL,
         "steps": 5, "bucket_view": True, "set_to_none": False, "target": "outer"},
    ],
    "fsdp2": [
        {"name": "fsdp-tr-activations", "model": "tr", "mode": "fsdp", "budget": 896 * KiB,
         "manage": ["activations"], "steps": 4, "slow_writes": 0.02},
        {"name": "fsdp-cnn-activations", "model": "cnn", "mode": "fsdp", "budget": 1024 * KiB,
         "manage": ["activations"], "steps": 4},
        # BatchNorm outputs pinned must_recompute: FSDP2 frees the unsharded weights after the
        # forward, so no op reading a parameter may be replayed (it read freed storage, a crash)
        {"name": "fsdp-cnn-pinned", "model": "cnn", "mode": "fsdp", "budget": 1024 * KiB,
         "manage": ["activations"], "steps": 3, "pin_bn": True},
        {"name": "fsdp-tr-all", "model": "tr", "mode": "fsdp", "budget": 1024 * KiB,
         "manage": ALL, "steps": 1},
    ],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    configs = [c for group in CONFIGS.values() for c in group]
    by_name: dict[str, list[dict]] = {}
    for rank_results in dist_launch.launch(configs, tmp_path_factory.mktemp("dist") / "r", timeout=200):
        for r in rank_results:
            assert "crash" not in r, r["crash"]
            by_name.setdefault(r["name"], []).append(r)
    assert sorted(by_name) == sorted(c["name"] for c in configs)
    return by_name


def _check(results: dict[str, list[dict]], group: str) -> None:
    for name in [c["name"] for c in CONFIGS[group]]:
        ranks = results[name]
        if any("error" in r for r in ranks):
            continue
        for r in ranks:
            assert r["equal"], f"{name} rank {r['rank']}: parameters differ from the job without ooc"
            s = r["stats"]
            assert s["bytes_out"] + s["bytes_recomputed"] > 0 and s["plan.bytes_out"] + s["plan.bytes_recomputed"] > 0, \
                f"{name}: nothing moved or recomputed ({s})"
            assert s["last_planned"], f"{name}: the last step did not run a plan ({s})"
            assert s.get("state_dict_ok", True), f"{name}: state_dict() read released storages"
            assert not s.get("grad_slots_not_a_grad"), f"{name}: a DDP bucket managed as a gradient"
        assert len({r["digest"] for r in ranks}) == 1, f"{name}: parameters differ across ranks"


def test_ddp_bn_cnn_sgd_momentum(results):
    _check(results, "cnn")


def test_ddp_transformer_dropout_adamw(results):
    _check(results, "transformer")
    assert all(r["stats"]["released_between_steps"] > 0 for r in results["tr-all"])


def test_fsdp2_activations_and_refusals(results):
    _check(results, "fsdp2")
    assert not any("error" in r for r in results["fsdp-tr-activations"] + results["fsdp-cnn-activations"]
                   + results["fsdp-cnn-pinned"])
    for r in results["fsdp-tr-all"]:
        assert r["error"].startswith("OOCError") and "DTensor" in r["error"] and "'params'" in r["error"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl)")
def test_ddp_nccl_two_gpus(tmp_path):
    configs = [
        {"name": "cnn-all", "model": "cnn", "mode": "ddp", "budget": 2048 * KiB, "chunk": 2048 * KiB,
         "manage": ALL, "steps": 4, "accum": 2, "bucket_view": True, "find_unused": True},
        {"name": "tr-fsdp-activations", "model": "tr", "mode": "fsdp", "budget": 4096 * KiB,
         "chunk": 2048 * KiB, "manage": ["activations"], "steps": 4},
    ]
    results = dist_launch.launch(configs, tmp_path / "r", timeout=200, device="cuda")
    for rank_results in results:   # 2 MiB chunks (the VMM granularity) may move nothing here
        for r in rank_results:
            assert "crash" not in r and "error" not in r, r
            assert r["equal"], r
