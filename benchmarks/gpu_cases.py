"""The GPU benchmark's cases: what trains, on which batch, with which optimizer and precision.

Three models of issue 38, each built on the CPU from a fixed seed so that every method trains
the same weights on the same batch and final parameters compare bit for bit:

- ``resnet50``: the zoo's ResNet-50 (torchvision's layout) at batch 256, 224x224, SGD momentum.
- ``gpt2``: the zoo's GPT-2 small (12 x 768, manual attention: score, softmax, dropout) at
  batch 8 x 1024 tokens, AdamW, dropout 0.1.
- ``llama``: a ~320 M-parameter ``transformers.LlamaForCausalLM`` (20 layers of 1024, SDPA
  attention) at batch 4 x 2048 tokens, AdamW, bf16 autocast over fp32 weights.

``--quick`` shrinks each to seconds (a smoke of the same code paths, not a measurement).
A *block* is the unit ``torch.utils.checkpoint`` wraps: a Bottleneck, a GPT block, a decoder
layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ooc.engine import Options

BLOCKS = ("Bottleneck", "Block", "LlamaDecoderLayer")
#: Where the cases train: "cuda", except in the dry run over ooc's fake driver
#: (tests/test_bench_gpu_dry.py), which sets "cpu".
DEVICE = "cuda"


@dataclass(frozen=True)
class GpuCase:
    name: str                            # "resnet50" | "gpt2" | "llama": gpu.json's ``case``
    label: str                           # for tables
    batch: int
    optimizer: str                       # "sgd" (momentum 0.9) | "adamw"
    amp: torch.dtype | None = None       # autocast dtype of the forward
    model_kw: dict = field(default_factory=dict)
    scaler: bool = False                 # torch.amp.GradScaler around backward and update
    image_size: int | None = None        # images: the side (default the model's, 224)
    sdpa: str | None = None              # the scaled-dot-product attention backend: flash | math
    foreach: bool | None = None          # the optimizer's (None: PyTorch's default)

    def build(self) -> tuple[nn.Module, Any, Any, Callable[[Any, Any], torch.Tensor]]:
        """``(model, inputs, targets, loss_fn)`` on the CPU, from seed 0."""
        from ooc import models

        torch.manual_seed(0)
        if self.name == "llama":
            model = _llama(**self.model_kw)
            gen = torch.Generator().manual_seed(0)
            vocab, seq = model.vocab, self.model_kw.get("seq_len", 2048)
            x = torch.randint(0, vocab, (self.batch, seq), generator=gen)
            y = torch.randint(0, vocab, (self.batch, seq), generator=gen)
            return model, x, y, models.lm_loss
        kw = dict(self.model_kw)
        model = models.get(self.name, **kw)
        x, y = models.example_batch(self.name, self.batch, "cpu", image_size=self.image_size, **kw)
        return model, x, y, models.loss_fn(self.name)

    def optimizer_for(self, params: Any) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=self.foreach)
        return torch.optim.AdamW(params, lr=1e-4, foreach=self.foreach)

    def attention(self) -> contextlib.AbstractContextManager:
        """The SDPA backend for the whole step, forward and backward: a checkpointed block
        recomputes its forward in the backward, and must pick the backend its forward did
        (else torch.utils.checkpoint refuses: "different metadata"). Flash is fast but its
        backward is not deterministic (a Llama in-core run twice differed on an H200, as with
        the cuDNN attention PyTorch 2.11 picks there by default); math is deterministic."""
        if self.sdpa is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION if self.sdpa == "flash" else SDPBackend.MATH])

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(DEVICE, dtype=self.amp)


FULL = [GpuCase("resnet50", "ResNet-50 b256", 256, "sgd"),
        GpuCase("gpt2", "GPT-2 small b8 x 1024", 8, "adamw"),
        GpuCase("llama", "Llama ~320M b4 x 2048 bf16", 4, "adamw", torch.bfloat16,
                dict(layers=20, width=1024, seq_len=2048), sdpa="flash")]
QUICK = [GpuCase("resnet50", "ResNet-50 b4 64x64 (quick)", 4, "sgd", image_size=64),
         GpuCase("gpt2", "GPT b8 x 256 (quick)", 8, "adamw",
                 model_kw=dict(depth=2, width=256, heads=4, seq_len=256, vocab=2048)),
         # small: a CPU without bf16 instructions runs bf16 matmuls ~60x slower than fp32
         GpuCase("llama", "Llama 2 x 128 b2 x 128 bf16 (quick)", 2, "adamw", torch.bfloat16,
                 dict(layers=2, width=128, seq_len=128, vocab=1024), sdpa="flash")]


# Each step form of the engine on a small model, bitwise against the same loop in core
# (issue 38 item 3): ``(case, engine keywords, budget fraction)``; a fraction of the in-core
# activation peak, or with params/grads/state managed, of the whole in-core peak.
_SMALL_GPT = dict(depth=4, width=512, heads=8, seq_len=512, vocab=8192)
_ALL = ("activations", "params", "grads", "optimizer_state")
FORMS = [
    (GpuCase("gpt2", "GPT 4 x 512 b8 fp32", 8, "adamw", model_kw=_SMALL_GPT), {"recompute": "prefer"}, 0.25),
    (GpuCase("gpt2", "GPT 4 x 512 b8 fp32", 8, "adamw", model_kw=_SMALL_GPT), {"recompute": "never"}, 0.25),
    (GpuCase("gpt2", "GPT 4 x 512 b8 bf16", 8, "adamw", torch.bfloat16, _SMALL_GPT), {}, 0.25),
    (GpuCase("gpt2", "GPT 4 x 512 b8 fp16 + GradScaler", 8, "adamw", torch.float16, _SMALL_GPT,
             scaler=True), {}, 0.25),
    (GpuCase("gpt2", "GPT 4 x 512 b8 AdamW per-parameter", 8, "adamw", model_kw=_SMALL_GPT,
             foreach=False), {"manage": _ALL}, 0.25),
    (GpuCase("resnet50", "ResNet-50 b32", 32, "sgd"), {"recompute": "prefer"}, 0.25),
    (GpuCase("resnet50", "ResNet-50 b32", 32, "sgd"), {"recompute": "prefer"}, 2.0),
    # one arena (the swap-ins in PyTorch's allocator): recomputing, and anchored (swap only)
    (GpuCase("resnet50", "ResNet-50 b32, one arena", 32, "sgd"),
     {"recompute": "prefer", "options": Options(arena="pytorch")}, 0.25),
    (GpuCase("gpt2", "GPT 4 x 512 b8 bf16, one arena", 8, "adamw", torch.bfloat16, _SMALL_GPT),
     {"recompute": "never", "options": Options(arena="pytorch")}, 0.25),
    (GpuCase("llama", "Llama 4 x 512 b2 x 512 bf16, math attention", 2, "adamw", torch.bfloat16,
             dict(layers=4, width=512, seq_len=512), sdpa="math"), {}, 0.25),
]
QUICK_FORMS = [(GpuCase("gpt2", "GPT 1 x 64 b4 fp16 + GradScaler", 4, "adamw", torch.float16,
                        dict(depth=1, width=64, heads=2, seq_len=64, vocab=256), scaler=True), {}, 0.25)]


class _Llama(nn.Module):
    """``LlamaForCausalLM`` as ``ids -> logits`` (fp32 logits for the loss, as HF's own)."""

    def __init__(self, inner: nn.Module, vocab: int) -> None:
        super().__init__()
        self.inner, self.vocab = inner, vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).logits.float()


def _llama(layers: int, width: int, seq_len: int, vocab: int = 32000) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=width // 64, num_key_value_heads=width // 64,
                      vocab_size=vocab, max_position_embeddings=seq_len, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return _Llama(LlamaForCausalLM(cfg), vocab)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, in order."""
    return [m for m in model.modules() if type(m).__name__ in BLOCKS]


def checkpoint_every(model: nn.Module, every: int) -> int:
    """Wrap every ``every``-th block in ``torch.utils.checkpoint`` (non-reentrant, RNG state
    preserved: dropout replays the same masks). Returns how many were wrapped."""
    import functools

    import torch.utils.checkpoint as cp

    chosen = blocks(model)[::every]
    for m in chosen:
        m.forward = functools.partial(cp.checkpoint, m.forward, use_reentrant=False)
    return len(chosen)

