"""scheduler.arenas: a plan's device peak on a GPU with one arena and with ooc's pool beside
PyTorch's allocator (the model ``ooc simulate`` prints and benchmarks/gpu_memory.py compares
with the H100's measured peaks)."""

from __future__ import annotations

import pytest

import scheduler
from scheduler.arenas import device_peaks
from scheduler.managed import managed_view
from strategies import training_like_sequence


@pytest.mark.parametrize("style", ["cnn", "transformer"])
def test_a_plan_that_moves_nothing_peaks_at_the_in_core_peak_in_one_arena(style: str) -> None:
    full = training_like_sequence(6, style=style)
    m = device_peaks(full, scheduler.plan(full, budget=2 * full.in_core_peak_bytes))
    assert m.pool == 0 and m.one_arena == m.two_arenas == m.torch == full.in_core_peak_bytes


@pytest.mark.parametrize("style", ["cnn", "transformer"])
def test_swapped_in_bytes_peak_in_the_pool_and_one_arena_holds_no_more_than_two(style: str) -> None:
    """A managed view planned at a third of its peak: the pool holds what comes back, the
    device with two arenas holds both peaks, with one arena the peak of their sum, which
    here is less (the pool's peak comes in the backward, PyTorch's in the forward)."""
    full = training_like_sequence(8, style=style, act_bytes=4 << 20)
    seq = managed_view(full, min_bytes=1 << 20, chunk=1 << 20)
    plan = scheduler.plan(seq, budget=seq.in_core_peak_bytes // 3, recompute="never")
    m = device_peaks(full, plan)
    assert m.pool > 0 and m.two_arenas == m.torch + m.pool
    assert max(m.torch, m.pool) <= m.one_arena < m.two_arenas


def test_a_plan_of_another_step_is_refused() -> None:
    full = training_like_sequence(4)
    other = training_like_sequence(5)
    with pytest.raises(ValueError, match="functions"):
        device_peaks(full, scheduler.plan(other, budget=2 * other.in_core_peak_bytes))
