"""choose_chunk(): the largest chunk whose threshold leaves at most an eighth of the budget in
saved activations outside it, never below the backend's granularity, never above the chunk
it starts from, and no change when everything saved fits the budget."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.chunk_size import UNMANAGED_SHARE, choose_chunk, unmanaged_bytes

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4 * KiB


def test_small_activations_get_a_smaller_chunk() -> None:
    """A ResNet-18-like mix: two 2 MiB tensors, the rest 64-512 KiB (all under 1 MiB, so a
    2 MiB chunk manages almost nothing) and a few BatchNorm statistics of 2 KiB."""
    saved = [2 * MiB] * 2 + [512 * KiB] * 9 + [256 * KiB] * 9 + [64 * KiB] * 9 + [2 * KiB] * 20
    budget = sum(saved) // 4
    chunk = choose_chunk(saved, budget, 2 * MiB, PAGE)
    assert chunk < 2 * MiB
    assert unmanaged_bytes(saved, chunk // 2) <= budget // UNMANAGED_SHARE
    # the largest such chunk: twice it leaves too much outside
    assert unmanaged_bytes(saved, chunk) > budget // UNMANAGED_SHARE


def test_everything_fits_keeps_the_chunk() -> None:
    """Nothing has to move: a smaller chunk would only cost a second recording step."""
    saved = [64 * KiB] * 10
    assert choose_chunk(saved, sum(saved), 2 * MiB, PAGE) == 2 * MiB


def test_large_activations_keep_the_chunk() -> None:
    """A large model's activations are managed with 2 MiB chunks already."""
    saved = [8 * MiB] * 20 + [4 * KiB] * 10
    assert choose_chunk(saved, sum(saved) // 4, 2 * MiB, PAGE) == 2 * MiB


def test_the_granularity_is_a_floor() -> None:
    """On a GPU the VMM granularity (2 MiB) is the smallest chunk: no smaller one, even when
    the small tensors then stay outside the budget."""
    saved = [16 * KiB] * 1000
    assert choose_chunk(saved, sum(saved) // 4, 2 * MiB, 2 * MiB) == 2 * MiB
    assert choose_chunk(saved, sum(saved) // 4, 2 * MiB, 64 * KiB) == 64 * KiB
    assert choose_chunk([1 * KiB] * 1000, 100 * KiB, 2 * MiB, PAGE) == PAGE


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4 * MiB), min_size=1, max_size=60), st.integers(PAGE, 64 * MiB),
       st.sampled_from([PAGE, 16 * KiB, 64 * KiB, 2 * MiB]), st.sampled_from([64 * KiB, 2 * MiB]))
def test_choice_properties(saved: list[int], budget: int, floor: int, start: int) -> None:
    if start < floor:
        start = floor
    chunk = choose_chunk(saved, budget, start, floor)
    allowed = budget // UNMANAGED_SHARE
    assert floor <= chunk <= start and chunk % floor == 0 and start % chunk == 0
    if sum(saved) <= budget:
        assert chunk == start
        return
    if chunk != floor:   # it met the share, and no larger chunk did
        assert unmanaged_bytes(saved, chunk // 2) <= allowed
    if chunk != start:
        assert unmanaged_bytes(saved, chunk) > allowed
    # monotonic: less budget never gets a larger chunk
    assert choose_chunk(saved, budget // 2, start, floor) <= chunk
