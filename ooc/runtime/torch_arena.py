"""Swapped-in tensors in PyTorch's own caching allocator: one arena on a GPU.

Why: :class:`~ooc.runtime.cuda_pool.CudaDevicePool` maps VMM chunks of its own, beside
PyTorch's caching allocator. What the forward's activations leave in PyTorch's cache once
they are swapped out cannot hold what the backward swaps back in, so the two peaks add up:
on the H100 (``benchmarks/results/gpu-memory.md``) ooc held 16.3 GiB at half of ResNet-50's
21.1 GiB peak, where one arena would have held about 10.6 GiB at the same plan, and lost the
comparison with checkpointing at equal memory. :class:`TorchArenaPool` takes each swap-in
from PyTorch's allocator (``torch.empty`` on the device), so freed activations and swap-ins
share blocks; the budget still bounds ooc's bytes, counted here (512-byte rounded, as
PyTorch rounds), and going over it is :class:`~ooc.errors.OutOfBudget` as in the VMM pool.
What it gives up is ooc's own allocator: fragmentation is PyTorch's (its
``expandable_segments`` setting is the remedy there), and the pool's figures count ooc's
bytes, not the blocks PyTorch reserved for them.

Stream order needs nothing new. ``take`` runs on the host at the swap-in's place in the step,
so PyTorch hands out the block on the compute stream, as it would to the op that reads it; a
block that kernels queued earlier may still use is safe because the tier's copy into it waits
for the work queued on the compute stream (``PinnedTier.read_async``), and a range is let go
only after the compute stream waited for any copy out of it (``Slot.finish_swap_out``): the
rules PyTorch's own activations already follow under ooc.

The default on CUDA (``Options(arena="auto")``; ``"pool"`` asks for the VMM pool). Only on
CUDA: on the CPU the pool's chunks already take their
pages from the allocator PyTorch's tensors use (``ooc.host.cpu_allocator``).
"""

from __future__ import annotations

import weakref

import torch

from ooc.errors import OOCError
from vmm.allocation import AllocationError
from vmm.errors import OutOfBudget
from vmm.units import format_size

__all__ = ["ARENAS", "BLOCK", "TorchArenaPool", "resolve_arena"]

#: Where swapped-in tensors live (``ooc.Options(arena=...)``): ``"auto"`` (PyTorch's allocator
#: on CUDA, ooc's pool on the CPU), ooc's VMM pool, or PyTorch's allocator.
ARENAS = ("auto", "pool", "pytorch")

#: PyTorch's CUDA caching allocator rounds every block to this (kMinBlockSize), so a range's
#: bytes are counted rounded to it: what the budget bounds is what the allocator hands out.
BLOCK = 512


def resolve_arena(device: "torch.device | str", arena: str) -> str:
    """``"pool"`` or ``"pytorch"`` for ``arena`` on ``device``. ``"auto"`` is one arena on CUDA:
    on the H100 (``benchmarks/results/gpu-one-arena*.md``, two runs) it held 1.2-3.2 GiB less
    than the VMM pool at the same budget on ResNet-50 and GPT-2, at the same speed within the
    runs' spread (its step 0.94-1.10x the pool's), and only it fitted nnabla's 16 GiB headline.
    On the CPU the pool's chunks already come from the allocator PyTorch's tensors use."""
    if arena not in ARENAS:
        raise OOCError(f"arena must be one of {list(ARENAS)}, got {arena!r}")
    dev = torch.device(device)
    if arena == "auto":
        return "pytorch" if dev.type == "cuda" else "pool"
    if arena == "pytorch" and dev.type != "cuda":
        raise OOCError(f"arena='pytorch' is for CUDA devices, not {dev}: on the CPU the pool's chunks "
                       "already take their pages from the allocator PyTorch's tensors use")
    return arena


class TorchArenaPool:
    """Budgeted swap-in memory from PyTorch's allocator on ``device`` (the module docstring
    says why). Conforms to :class:`~ooc.runtime.pool.DevicePool`; ``granularity`` is the
    one the VMM pool would have on that device (passed in), so that choosing the arena changes
    where bytes live, not which tensors the engine manages or how it plans them."""

    def __init__(self, budget: int, device: "torch.device | str", *, granularity: int) -> None:
        if budget <= 0 or granularity <= 0 or granularity % BLOCK:
            raise OOCError(f"TorchArenaPool: budget {budget} and granularity {granularity} must be "
                           f"positive, the granularity a multiple of {BLOCK}")
        self.budget, self.device = int(budget), torch.device(device)
        self._granularity = int(granularity)
        self._dead: list[int] = []     # counted bytes of ranges whose last user died (finalizers)
        self._live = self._count = 0   # counted bytes and ranges taken and not yet reaped
        self._peak = self._peak_count = 0
        self._closed = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes`` from PyTorch's allocator, on the current stream
        (raises OutOfBudget past the budget, leaving the pool as it was)."""
        if self._closed:
            raise OOCError("TorchArenaPool is closed")
        self.reap()
        counted = -(-max(int(nbytes), 1) // BLOCK) * BLOCK
        if self._live + counted > self.budget:
            raise OutOfBudget(f"{format_size(nbytes)} does not fit: {format_size(self._live)} of the "
                              f"{format_size(self.budget)} budget are taken by {self._count} swapped-in "
                              "tensors in PyTorch's allocator")
        try:
            out = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:   # the device, not the budget: PyTorch's own error, told why
            raise torch.OutOfMemoryError(
                f"a swap-in of {format_size(nbytes)} ({nbytes} B) in PyTorch's allocator, within the "
                f"{format_size(self.budget)} budget ({format_size(self._live)} taken), found the device full: "
                f"lower the budget (arena='pytorch' shares the device with PyTorch's own tensors). {exc}") from exc
        # On the storage: the slot keeps the storage, not this tensor, and every view shares it.
        weakref.finalize(out.untyped_storage(), self._dead.append, counted)
        self._live += counted
        self._count += 1
        self._peak, self._peak_count = max(self._peak, self._live), max(self._peak_count, self._count)
        return out

    def reap(self) -> None:
        """Stop counting the ranges whose last user died since the previous call (PyTorch has
        them back already: its allocator reuses them in stream order)."""
        while self._dead:
            self._live -= self._dead.pop()
            self._count -= 1

    def trim(self, limit: int | None = None) -> int:
        """Nothing to give back: freed blocks stay in PyTorch's cache, where the next forward's
        activations reuse them (``torch.cuda.empty_cache`` would synchronize the device and
        hand the next step's allocations to the driver again). Returns 0."""
        self.reap()
        return 0

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def alignment(self) -> int:
        """PyTorch's block size: every CUDA block starts at a multiple of it (a CPU tensor, as
        under ``ooc.testing.fake_cuda``, at a multiple of 64: the arena is for CUDA)."""
        return BLOCK if self.device.type == "cuda" else 64

    def stats(self) -> dict[str, int]:
        """The ranges and their counted bytes, live and at their peak (``mapped_bytes``: the
        same key as the VMM pools', here bytes PyTorch's allocator holds for ooc), as of the
        last ``take`` or ``reap``."""
        return {"allocations": self._count, "peak_allocations": self._peak_count,
                "mapped_bytes": self._live, "peak_mapped_bytes": self._peak}

    def close(self) -> None:
        """Refuse further takes. Refuses (``AllocationError``) while ranges are in use, as the
        VMM pools do, so that a caller's bookkeeping holds the same way over both; idempotent."""
        if self._closed:
            return
        self.reap()
        if self._count:
            raise AllocationError(f"TorchArenaPool.close: {self._count} ranges "
                                  f"({format_size(self._live)}) still live")
        self._closed = True

    def __repr__(self) -> str:
        return (f"TorchArenaPool({self.device}, budget={format_size(self.budget)}, "
                f"live={format_size(self._live)} in {self._count})")
