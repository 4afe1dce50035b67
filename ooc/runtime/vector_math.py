"""Make the process's first MKL vector-math call on one thread, before any training.

PyTorch computes float ``sqrt``, ``exp``, ``tanh``... of CPU tensors with MKL's vector math,
one chunk per intra-op thread. When the first such call of a process is a large tensor, its
chunks run on several threads at once, and now and then (mostly on a loaded host) the
calling thread's chunk comes out of a low-accuracy path: relative errors up to 3.2e-4 where
the same call repeated, or the other thread's half, is within 6e-8. In Adam that is the
first step's ``exp_avg_sq.sqrt()``, so one run of plain PyTorch (no engine in the process)
differs from the next by ~20 ulp on half of a weight. Measured on this project's 2-core
Xeon host with two busy loops beside it (torch 2.13.0, MKL 2024.2): the first large
``sqrt`` was off in 17 of 280 fresh processes; it was never off (0 of 200) once one small
call (below PyTorch's parallel grain, so on one thread) had run first, be it ``sqrt``,
``exp`` or ``tanh``; ``MKL_NUM_THREADS=1`` or ``MKL_CBWR=COMPATIBLE`` also hide it.

The engine promises parameters bitwise equal to in-core training; a process that imports
it gets one small call here, so neither the engine's steps nor an in-core reference run
beside them can meet a racy first call. It costs microseconds.
"""

from __future__ import annotations

import torch

_settled = False


def settle_vector_math() -> None:
    """Run one single-threaded vector-math call, once per process (a no-op without MKL)."""
    global _settled
    if _settled:
        return
    _settled = True
    if torch.backends.mkl.is_available():
        torch.ones(1024).sqrt()
