"""Issue 42: tensors without a storage the engine could move are left to PyTorch, never a crash.

Sparse tensors (COO, CSR) have no storage: asking for it raises (``Cannot access storage of
SparseCsrTensorImpl``), and so does asking a sparse COO tensor for its bytes (``nbytes is not
defined for sparse tensors``). A ``ZeroTensor`` (``sgn``'s gradient, ``_efficientzerotensor``)
has a storage without data (``Attempted to access the data pointer on an invalid python
storage``). Each of these crashed a step; the engine now leaves them to PyTorch, unmanaged,
and manages the dense tensors around them. Every case trains bitwise as in core under each
setting of ``db_steps.CONFIGS`` (swap only or recompute, activations or every kind managed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from db_steps import CONFIGS, Sample, compare
from test_reliability import _one_torch_thread  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


class SparseEmbedding(nn.Module):
    """``nn.Embedding(sparse=True)``: its gradient is sparse, and so is SGD's momentum for it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64, sparse=True)
        self.proj = nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(self.embed(ids)))


class GraphLayer(nn.Module):
    """A graph convolution: a sparse adjacency (COO or CSR, an input) times dense features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, adjacency: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(adjacency, self.lin(x)))
        return torch.sparse.mm(adjacency, h).to_sparse().to_dense()   # a sparse result too


class ZeroGradient(nn.Module):
    """``sgn``'s derivative is zero: autograd hands the parameter a ``ZeroTensor`` gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.w.sgn()


def _adjacency(layout: torch.layout) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(48, 48, generator=g) * (torch.rand(48, 48, generator=g) < 0.1)
    return dense.to_sparse() if layout is torch.sparse_coo else dense.to_sparse_csr()


SAMPLES = {
    "embedding-sparse-grad": Sample("embedding-sparse-grad", SparseEmbedding,
                                    lambda: (torch.randint(0, 100, (16, 8), generator=torch.Generator().manual_seed(1)),),
                                    lambda m, x: m(*x)),
    "graph-coo": Sample("graph-coo", GraphLayer,
                        lambda: (_adjacency(torch.sparse_coo), torch.randn(48, 32, generator=torch.Generator().manual_seed(2))),
                        lambda m, x: m(*x)),
    "graph-csr": Sample("graph-csr", GraphLayer,
                        lambda: (_adjacency(torch.sparse_csr), torch.randn(48, 32, generator=torch.Generator().manual_seed(2))),
                        lambda m, x: m(*x)),
    "zero-tensor-grad": Sample("zero-tensor-grad", ZeroGradient,
                               lambda: (torch.randn(16, 32, generator=torch.Generator().manual_seed(2)),),
                               lambda m, x: m(*x)),
}


@pytest.mark.parametrize("setting", list(CONFIGS))
@pytest.mark.parametrize("name", list(SAMPLES))
def test_tensors_without_storage_are_left_to_pytorch_and_training_is_bitwise(name: str, setting: str) -> None:
    stats = compare(SAMPLES[name], setting)
    assert stats["last_planned"] == 1, "the second step did not run its plan"
    assert stats["bytes_out"] > 0, "the dense tensors around them were not managed"
