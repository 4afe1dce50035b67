"""The allocation traces ``bench_frag`` replays for peak reserved (issue 18 item 4).

Two families:

- what the project generates: the synthetic swap schedule of the speed benchmark
  (``vmm.replay.swap_trace``); eager training steps of zoo models traced on meta
  (``ooc.trace`` -> ``ooc.frag.inputs.sequence_events``: what ``ooc frag step.json`` replays);
  and the swap schedule the planner makes for one of them at a quarter of its peak
  (``scheduler.memory_events.allocation_events``: what ooc's own pool sees);
- real-world shapes, generated here because no CUDA snapshot can be recorded on this
  machine: *many small tensors* (a scientific CNN on small inputs with per-channel
  parameters, Adam state and small temporaries: the shape of the 3,892-event snapshot of
  issue 18, where pure 2 MiB chunks reserved 2.11x the live peak), and a *transformer full
  step with a growing KV cache* (generation appends to each layer's K and V by allocating
  the longer tensor and freeing the old one, as ``torch.cat`` does, then a forward and backward
  over the grown context with its activation set).

Each function returns ``(label, note, events)``; deterministic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vmm.replay import Event, swap_trace

KiB, MiB = 1 << 10, 1 << 20


class _Trace:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.key = 0
        self.size: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int:
        k = self.key
        self.key += 1
        n = self.size[k] = max(1, int(nbytes))
        self.events.append(Event("alloc", k, n))
        return k

    def free(self, k: int) -> None:
        self.events.append(Event("free", k, 0))


def synthetic_swap(n: int = 200_000) -> tuple[str, str, list[Event]]:
    return ("synthetic swap schedule", f"`swap_trace({n}, jitter=0.05)`, 48 layers, 64 KiB-96 MiB",
            swap_trace(n, jitter=0.05, seed=0))


def model_step(name: str, batch: int, image_size: int | None = None,
               **kw: Any) -> tuple[str, str, list[Event]]:
    """An eager training step of zoo model ``name`` (traced on meta, no memory used)."""
    seq = _trace(name, batch, image_size, **kw)
    from ooc.frag.inputs import sequence_events

    args = ", ".join(f"{k}={v}" for k, v in dict(kw, image_size=image_size).items() if v)
    return (f"{name} step", f"eager step, batch {batch}{', ' + args if args else ''} (`ooc.trace`)",
            sequence_events(seq))


def model_plan(name: str, batch: int, fraction: int = 4, image_size: int | None = None,
               **kw: Any) -> tuple[str, str, list[Event]]:
    """The swap schedule of zoo model ``name`` planned at 1/``fraction`` of its in-core peak."""
    from scheduler.memory_events import allocation_events
    from scheduler.planner import plan

    seq = _trace(name, batch, image_size, **kw)
    s = plan(seq, seq.in_core_peak_bytes // fraction, policy="window")
    return (f"{name} plan 1/{fraction}", f"window schedule at 1/{fraction} of the in-core peak, "
            f"batch {batch}", allocation_events(s))


def _trace(name: str, batch: int, image_size: int | None, **kw: Any) -> Any:
    import torch

    import ooc
    from ooc import models

    with torch.device("meta"):
        model = models.get(name, **kw)
    x, y = models.example_batch(name, batch, "meta", image_size=image_size, **kw)
    return ooc.trace(model, x, y, loss_fn=models.loss_fn(name), optimizer="adam", name=name)


def many_small_cnn(steps: int = 3, seed: int = 0) -> tuple[str, str, list[Event]]:
    """A scientific CNN on small inputs: 40 conv blocks of 16-128 channels on 24x24-96x96
    maps at batch 4 (activations 36 KiB-4.5 MiB), each with a weight, a bias, BatchNorm's
    four per-channel tensors, their gradients and two Adam states (a few hundred bytes to
    600 KiB), saved activations and small temporaries (statistics, masks). Most tensors are far
    below 2 MiB; the live peak is tens of MiB."""
    rng = np.random.default_rng(seed)
    t = _Trace()
    blocks = 40
    chans = [int(rng.choice([16, 32, 48, 64, 96, 128])) for _ in range(blocks)]
    sides = [int(rng.choice([24, 32, 48, 64, 96])) for _ in range(blocks)]
    batch = 4
    params = []
    for i in range(blocks):
        cin = chans[i - 1] if i else 3
        w = chans[i] * cin * 9 * 4
        params.append([t.alloc(w), t.alloc(chans[i] * 4)] + [t.alloc(chans[i] * 4) for _ in range(4)])
    states: list[int] = []
    for _ in range(steps):
        x = t.alloc(batch * 3 * sides[0] ** 2 * 4)
        saved = []
        for i in range(blocks):
            act = batch * chans[i] * sides[i] ** 2 * 4
            y = t.alloc(act)
            stats = [t.alloc(chans[i] * 4) for _ in range(2)]
            bn = t.alloc(act)
            relu = t.alloc(act)
            mask = t.alloc(act // 4)          # dropout / relu mask (bool)
            t.free(y)
            saved.append((bn, relu, mask, stats))
        loss = t.alloc(4)
        grads = []
        g = t.alloc(batch * chans[-1] * sides[-1] ** 2 * 4)
        for i in reversed(range(blocks)):
            bn, relu, mask, stats = saved[i]
            tmp = t.alloc(batch * chans[i] * sides[i] ** 2 * 4)
            gw = [t.alloc(t.size[p]) for p in params[i][:2]]
            gbn = [t.alloc(chans[i] * 4) for _ in range(2)]
            grads += gw + gbn
            t.free(g)
            g = t.alloc(batch * (chans[i - 1] if i else 3) * sides[i] ** 2 * 4)
            t.free(tmp)
            for k in (bn, relu, mask, *stats):
                t.free(k)
        t.free(g)
        t.free(loss)
        t.free(x)
        if not states:   # Adam: two states per gradient, made at the first step
            states = [t.alloc(t.size[gk]) for gk in grads for _ in range(2)]
        for gk in grads:  # the update's small temporaries, then the gradient goes
            tmp = t.alloc(t.size[gk])
            t.free(tmp)
            t.free(gk)
    for k in states + [p for ps in params for p in ps]:
        t.free(k)
    return ("many small tensors (CNN)", f"{blocks} conv blocks, 16-128 channels, 24-96 px, batch "
            f"{batch}, Adam, {steps} steps", t.events)


def transformer_kv(layers: int = 12, width: int = 1024, heads: int = 16, prompt: int = 256,
                   generate: int = 256, block: int = 16, batch: int = 4,
                   ) -> tuple[str, str, list[Event]]:
    """A transformer full step with a growing KV cache: fp16 weights of ``layers`` blocks
    (12 x width^2 each); generation of ``generate`` tokens after a ``prompt``, each layer's K
    and V grown by ``block`` tokens at a time (a new, longer tensor allocated, the old freed,
    as ``torch.cat`` does) with per-token temporaries (q, attention scores over the context,
    MLP hidden); then a training forward and backward over the whole context, with its saved
    activations, gradients and Adam states."""
    t = _Trace()
    h = 2  # fp16
    weights = [[t.alloc(width * width * h) for _ in range(4)] + [t.alloc(4 * width * width * h)
               for _ in range(2)] + [t.alloc(width * h) for _ in range(4)] for _ in range(layers)]
    kv = [[t.alloc(batch * prompt * width * h) for _ in range(2)] for _ in range(layers)]
    ctx = prompt
    while ctx < prompt + generate:
        for _ in range(block):
            x = t.alloc(batch * width * h)
            for li in range(layers):
                q = t.alloc(batch * width * h)
                scores = t.alloc(batch * heads * ctx * 4)
                hidden = t.alloc(batch * 4 * width * h)
                out = t.alloc(batch * width * h)
                for k in (q, scores, hidden):
                    t.free(k)
                t.free(x)
                x = out
            t.free(x)
        ctx += block
        for li in range(layers):   # append a block of tokens to K and V: cat = alloc + free
            for j in range(2):
                new = t.alloc(batch * ctx * width * h)
                t.free(kv[li][j])
                kv[li][j] = new
    # Training step over the grown context (prefix-tuning style): activations kept.
    seq = ctx
    tok = batch * seq * width * h
    x = t.alloc(tok)
    saved = []
    for li in range(layers):
        qkv = t.alloc(3 * tok)
        att = t.alloc(batch * heads * seq * seq * h)
        o = t.alloc(tok)
        hid = t.alloc(4 * tok)
        out = t.alloc(tok)
        saved.append((qkv, att, o, hid, x))
        x = out
    g = t.alloc(tok)
    t.free(x)
    grads = []
    for li in reversed(range(layers)):
        qkv, att, o, hid, xin = saved[li]
        tmp = t.alloc(4 * tok)
        grads += [t.alloc(t.size[w]) for w in weights[li]]
        t.free(tmp)
        t.free(g)
        g = t.alloc(tok)
        for k in (qkv, att, o, hid, xin):
            t.free(k)
    t.free(g)
    states = [t.alloc(t.size[gk]) for gk in grads for _ in range(2)]
    for gk in grads:
        t.free(gk)
    for k in states + [w for ws in weights for w in ws] + [k for pair in kv for k in pair]:
        t.free(k)
    return ("transformer step, growing KV", f"{layers} layers, width {width}, batch {batch}, "
            f"context {prompt}->{prompt + generate} in steps of {block}, then forward+backward, "
            f"Adam", t.events)
