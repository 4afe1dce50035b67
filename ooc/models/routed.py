"""A mixture of experts whose tokens a learned router sends to one expert each: the model whose
activations' sizes depend on the data (each expert's batch is the tokens routed to it, which
changes with the batch and drifts as the router learns), for the tests and the benchmark of
plans that hold such sizes (``scheduler/widening.py``). Not in the zoo (``NAMES``): on the meta
device ``nonzero`` has no size to give.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class RoutedExperts(nn.Module):
    """Inputs of 16 features, ``width``-wide experts (an MLP of 4x), 10 classes;
    ``checkpointed``: each expert under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, width: int = 64, experts: int = 4, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Linear(16, width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                   nn.Linear(4 * width, width)) for _ in range(experts))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        weight, choice = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e).squeeze(1)   # as many rows as tokens routed to e
            y = checkpoint(expert, h[idx], use_reentrant=False) if self.checkpointed else expert(h[idx])
            out = out.index_add(0, idx, y * weight[idx, None])
        return self.head(F.gelu(out + h))


def routed_experts(width: int = 64, experts: int = 4, checkpointed: bool = False) -> RoutedExperts:
    return RoutedExperts(width, experts, checkpointed)
