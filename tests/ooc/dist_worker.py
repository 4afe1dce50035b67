"""One rank of the distributed tests (``test_distributed.py``): run as a script under a
torchrun-like environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Each rank trains the same job twice in one process group: first without ooc (the reference),
then with an engine per rank, from the same initial weights, the same per-rank batches and
the same per-rank RNG seed (dropout). It writes a JSON line per run config to ``--out``:
whether the ooc parameters (and buffers) are bitwise those of the reference on this rank, a
digest of them (the test compares the digests across ranks), and the engine's stats.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ooc

KiB = 1 << 10
# OOC_DIST_DEVICE=cuda: each rank on its GPU (LOCAL_RANK) with nccl; else the CPU with gloo.
DEVICE = torch.device("cpu")


class WithSpare(nn.Module):
    """A zoo model plus a layer its forward never uses (find_unused_parameters' case)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(kind: str, spare: bool) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    if kind == "cnn":
        model: nn.Module = ooc.models.small_cnn(width=8, blocks=4, per_stage=2)
        loss = F.cross_entropy
    else:
        model = ooc.models.tiny_transformer(depth=2, width=64, seq_len=32, vocab=128, dropout=0.1)
        loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    return (WithSpare(model) if spare else model), loss


def batch(kind: str, rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    if kind == "cnn":
        return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    x = torch.randint(0, 128, (8, 32), generator=g)
    return x, torch.randint(0, 128, (8, 32), generator=g)


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "cnn":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def wrap(model: nn.Module, cfg: dict) -> nn.Module:
    if cfg["mode"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, gradient_as_bucket_view=cfg.get("bucket_view", False),
                   find_unused_parameters=cfg.get("find_unused", False),
                   bucket_cap_mb=cfg.get("bucket_cap_mb", 25))
    from torch.distributed.fsdp import fully_shard

    body = model.body if isinstance(model, WithSpare) else model
    blocks = body.blocks if hasattr(body, "blocks") else body.h   # SmallCNN, GPT
    for block in blocks:
        fully_shard(block, reshard_after_forward=cfg.get("reshard", True))
    fully_shard(model, reshard_after_forward=cfg.get("reshard", True))
    return model


def train(cfg: dict, rank: int, use_ooc: bool) -> tuple[list[torch.Tensor], dict | None]:
    kind = cfg["model"]
    model, loss_fn = build(kind, cfg.get("find_unused", False))
    model.to(DEVICE)
    wrapped = wrap(model, cfg)
    opt = optimizer(kind, wrapped.parameters())
    engine = None
    if use_ooc:
        target = wrapped if cfg.get("target", "outer") == "outer" else model
        engine = ooc.OutOfCore(target, opt, budget=cfg["budget"], options=ooc.Options(chunk=cfg.get("chunk", 16 * KiB)), manage=tuple(cfg["manage"]), device=DEVICE,
                               pin={torch.ops.aten.native_batch_norm.default: "must_recompute"}
                               if cfg.get("pin_bn") else None)
        if cfg.get("slow_writes") and DEVICE.type == "cpu":   # a loaded disk: races show only when writes are slow
            write = engine._mem.tier._tasks.write

            def slow(*a, **kw):
                time.sleep(cfg["slow_writes"])
                return write(*a, **kw)
            engine._mem.tier._tasks.write = slow
    torch.manual_seed(100 + rank)   # dropout: the same stream per rank with and without ooc
    accum = cfg.get("accum", 1)
    bad_grads: list[str] = []
    for step in range(cfg.get("steps", 3)):
        for micro in range(accum):
            x, y = (t.to(DEVICE) for t in batch(kind, rank, step, micro))
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or cfg["mode"] != "ddp" else wrapped.no_sync()
            with (engine.step() if engine else contextlib.nullcontext()), sync:
                loss_fn(wrapped(x), y).backward()
                if last:
                    opt.step()
                    opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
            if engine is not None:   # a managed gradient is one parameter's, never a DDP bucket
                params = dict(engine.model.named_parameters())
                bad_grads += [s.name for s in engine._store.slots.values() if s.kind.value == "grad"
                              and s.nbytes != params[s.name[:-5]].nbytes]
    stats = None
    if engine is not None and cfg["mode"] == "ddp":
        # Between steps, managed parameters over the budget stay released: state_dict() of
        # the inner module (how DDP checkpoints are saved) must bring them back, whichever
        # module the engine was given.
        released = sum(s.state.value == "host" for s in engine._store.slots.values())
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    if engine is not None:
        stats = engine.stats()
        stats = {k: stats[k] for k in ("steps", "plans", "bytes_in", "bytes_out", "last_planned",
                                        "last_diverged_at", "resident_peak_bytes", "plan.bytes_out",
                                        "bytes_recomputed", "plan.bytes_recomputed")}
        engine.close()
    if engine is not None and cfg["mode"] == "ddp":
        stats["released_between_steps"] = released
        stats["grad_slots_not_a_grad"] = bad_grads
        stats["state_dict_ok"] = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        t = t.detach()
        if hasattr(t, "full_tensor"):   # FSDP2: a DTensor shard; compare the whole
            t = t.full_tensor()
        out.append(t.cpu().clone())
    return out, stats


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="JSON list of run configs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=os.environ.get("OOC_LOG", "WARNING"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    global DEVICE
    backend = "gloo"
    if os.environ.get("OOC_DIST_DEVICE") == "cuda":
        DEVICE, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("OOC_DIST_TIMEOUT", 60))))
    results = []
    try:
        for cfg in json.loads(args.configs):
            t0 = time.perf_counter()
            ref, _ = train(cfg, rank, use_ooc=False)
            nparams = len(list(build(cfg["model"], cfg.get("find_unused", False))[0].parameters()))
            try:
                got, stats = train(cfg, rank, use_ooc=True)
                res = {"equal": all(torch.equal(a, b) for a, b in zip(ref, got)) and len(ref) == len(got),
                       "digest": digest(got[:nparams]), "ref_digest": digest(ref[:nparams]), "stats": stats}
            except ooc.OOCError as e:
                res = {"error": f"{type(e).__name__}: {e}"}
            res |= {"name": cfg.get("name"), "rank": rank, "seconds": time.perf_counter() - t0}
            results.append(res)
            dist.barrier()
    except BaseException:
        results.append({"crash": traceback.format_exc(), "rank": rank})
        raise
    finally:
        with open(f"{args.out}.{rank}", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
