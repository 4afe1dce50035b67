"""A GPT-2 style decoder: token + position embeddings, pre-LayerNorm blocks with causal
self-attention and a GELU MLP, dropout, and an LM head tied to the token embedding.

Attention is written out (``q @ k^T``, mask, softmax, dropout, ``@ v``) by default, as GPT-2
did: the ``heads x T x T`` score matrices are the activations that dominate memory at long
sequences, and the same aten ops run on ``meta`` and on CPU, so a meta trace matches a real
one. ``attention="sdpa"`` uses ``F.scaled_dot_product_attention`` instead (faster, far less
memory); note that on ``meta`` PyTorch decomposes SDPA into the math ops, so a meta trace of
that variant is not the op sequence a CPU run executes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, attention: str) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.attention = attention
        self.dropout = dropout
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(future[:, :, :t, :t], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, attention: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout, attention)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), future)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Input: token ids ``(batch, seq)``; output: logits ``(batch, seq, vocab)``."""

    def __init__(self, depth: int = 12, width: int = 768, heads: int = 12, seq_len: int = 1024,
                 vocab: int = 50257, dropout: float = 0.1, attention: str = "manual") -> None:
        super().__init__()
        if attention not in ("manual", "sdpa"):
            raise ValueError(f"attention must be 'manual' or 'sdpa', not {attention!r}")
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(width, heads, dropout, attention) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        # True above the diagonal: the positions a token must not attend to. One buffer
        # shared by all blocks (not saved in the state dict).
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1).view(1, 1, seq_len, seq_len)
        self.register_buffer("future", future, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x, self.future)
        return self.lm_head(self.ln_f(x))


def gpt2(depth: int = 12, width: int = 768, heads: int = 12, seq_len: int = 1024,
         vocab: int = 50257, dropout: float = 0.1, attention: str = "manual") -> GPT:
    """GPT-2 style decoder; the defaults are GPT-2 small (124 M parameters)."""
    return GPT(depth, width, heads, seq_len, vocab, dropout, attention)


def tiny_transformer(depth: int = 2, width: int = 64, heads: int = 4, seq_len: int = 32,
                     vocab: int = 256, dropout: float = 0.1, attention: str = "manual") -> GPT:
    """A two-block GPT for tests and demos (~0.1 M parameters)."""
    return GPT(depth, width, heads, seq_len, vocab, dropout, attention)
