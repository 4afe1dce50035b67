"""``roundup_power2_divisions``: round requests up to a fraction of their power of two.

PyTorch's ``round_size`` (``c10/cuda/CUDACachingAllocator.cpp``) rounds every request up to
a multiple of 512 bytes. With ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:N`` (N a
power of two) it instead splits each interval between two powers of two into N equal steps
and rounds up to the next step: with N = 4 a 1,200 MiB request lies in [1 GiB, 2 GiB), whose
steps are 256 MiB, so it becomes 1,280 MiB. Why a user turns it on: requests whose sizes vary
a little (dynamic shapes) then land on a few sizes, and a freed block fits the next request
of a neighbouring size instead of the cache growing a new segment for it. The cost is the
padding, up to 1/N of each request.

The rules followed (PyTorch's ``roundup_power2_next_division`` and ``round_size``):

- below 512 bytes: 512, as without the knob;
- a size that is a power of two is kept;
- the knob applies only when ``N > 1`` and the size exceeds ``512 * N`` (below that a step
  would be smaller than 512 bytes): otherwise the usual multiple of 512;
- the step is ``floor_pow2(size) / N``; if that is 0 the size goes to the next power of two.

Only the single-number form (``roundup_power2_divisions:4``, every size interval alike) is
modelled; PyTorch's per-interval list form (``[256:1,512:2,>:8]``) is not.
"""

from __future__ import annotations

K_MIN_BLOCK_SIZE = 512

__all__ = ["round_up", "check_divisions"]


def check_divisions(divisions: int) -> int:
    """``divisions`` if PyTorch accepts it (a power of two, 1 meaning off), else ValueError
    naming the knob and what to give."""
    if type(divisions) is not int or divisions < 1 or divisions & (divisions - 1):
        raise ValueError(f"roundup_power2_divisions:{divisions} is not a power of two; give 1 "
                         f"(off), 2, 4, 8 or 16 ... as PyTorch requires")
    return divisions


def round_up(nbytes: int, divisions: int) -> int:
    """The block size PyTorch's ``round_size`` gives ``nbytes`` under ``divisions``."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        below = nbytes & ~(step - 1)
        return nbytes if below == nbytes else below + step
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
