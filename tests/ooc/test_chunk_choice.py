"""The default chunk's choice before a refusal (``ooc.engine.chunk_choice``), over a stand-in
for the engine's memory: which chunk is taken and which refusal is raised, in turn.
The engine-level case (a fresh engine at the least budget a loop from below names) is
``test_refusal_loop.py::test_a_fresh_engine_trains_at_the_least_budget_its_loop_named_in_smaller_chunks``."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest

from ooc.engine.chunk_choice import ChunkChoice
from scheduler.errors import BudgetTooSmall

MiB = 1 << 20


def _mem(chunk: int = 2 * MiB, granularity: int = 4096) -> SimpleNamespace:
    return SimpleNamespace(chunk=chunk, budget=40 * MiB, step_budget=48 * MiB, pool=SimpleNamespace(granularity=granularity))


def _refused(minimum_mib: float) -> BudgetTooSmall:
    minimum = int(minimum_mib * MiB)
    return BudgetTooSmall(function=1, name="op", working_set=minimum, budget=48 * MiB, minimum=minimum)


def test_halves_while_each_half_names_a_sixteenth_less_then_keeps_the_least() -> None:
    """58 MiB in 2 MiB chunks, 52 in 1 MiB (a tenth less: on), 50 in 512 KiB (under a
    sixteenth less: stop); 50 is the least, so its chunk stays and its refusal is raised."""
    choice, mem = ChunkChoice(adaptive=True), _mem()
    assert choice.instead_of(_refused(58), mem) == (MiB, None)
    mem.chunk = MiB
    assert choice.instead_of(_refused(52), mem) == (MiB // 2, None)
    mem.chunk = MiB // 2
    last = _refused(50)
    assert choice.instead_of(last, mem) == (MiB // 2, last)


def test_a_half_that_names_more_gives_the_chunk_before_back_with_its_refusal() -> None:
    choice, mem = ChunkChoice(adaptive=True), _mem()
    first = _refused(58)
    assert choice.instead_of(first, mem) == (MiB, None)
    mem.chunk = MiB
    assert choice.instead_of(_refused(60), mem) == (2 * MiB, first)
    # and the next refusal starts afresh (no half under way)
    mem.chunk = 2 * MiB
    assert choice.instead_of(_refused(58), mem) == (MiB, None)


@pytest.mark.parametrize("adaptive, granularity", [(False, 4096), (True, 2 * MiB)])
def test_a_fixed_chunk_or_one_at_the_granularity_is_refused_as_it_is(adaptive: bool, granularity: int) -> None:
    """``Options(chunk=...)`` keeps its chunk; a GPU's 2 MiB chunk is its VMM granularity."""
    choice, mem, err = ChunkChoice(adaptive=adaptive), _mem(granularity=granularity), _refused(58)
    assert choice.instead_of(err, mem) == (2 * MiB, err)
    with pytest.raises(BudgetTooSmall) as raised:
        choice.at_update(lambda chunk: (_ for _ in ()).throw(_refused(58 if chunk == 2 * MiB else 40)), mem)
    assert raised.value.minimum == 58 * MiB


def test_a_budget_again_forgets_the_halves_tried_at_the_last() -> None:
    choice, mem = ChunkChoice(adaptive=True), _mem()
    choice.instead_of(_refused(58), mem)
    choice.again()
    mem.chunk = MiB
    assert choice.instead_of(_refused(60), mem) == (MiB // 2, None)   # no 58 to go back to


def _fits_from(least: dict[int, float]):
    """``fits(chunk)`` for a step whose least budget in each chunk is ``least[chunk]`` (MiB),
    at a budget of 48 MiB."""
    def fits(chunk: int) -> None:
        if least[chunk] * MiB > 48 * MiB:
            raise _refused(least[chunk])
    return fits


def test_at_the_update_a_half_that_holds_the_step_lets_it_go_on() -> None:
    ChunkChoice(adaptive=True).at_update(_fits_from({2 * MiB: 58, MiB: 47}), _mem())


def test_at_the_update_the_halfs_least_is_named_where_it_is_a_sixteenth_less() -> None:
    choice = ChunkChoice(adaptive=True)
    with pytest.raises(BudgetTooSmall) as raised:
        choice.at_update(_fits_from({2 * MiB: 58, MiB: 52}), _mem())
    assert raised.value.minimum == 52 * MiB
    assert any("in 1 MiB chunks" in note and "58 MiB" in note for note in raised.value.__notes__)
    with pytest.raises(BudgetTooSmall) as raised:
        choice.at_update(_fits_from({2 * MiB: 58, MiB: 56}), _mem())
    assert raised.value.minimum == 58 * MiB and not getattr(raised.value, "__notes__", [])


class _Held:
    pass


def test_a_refusal_kept_while_halving_keeps_no_frame_of_the_step() -> None:
    """The refusal kept to go back to holds no traceback: its frames are the step's, and
    they hold its tensors (a Llama's retried step: 96 MiB) until the next budget."""
    choice, mem, alive = ChunkChoice(adaptive=True), _mem(), []

    def step() -> None:
        tensor = _Held()   # what a frame of the step holds
        alive.append(weakref.ref(tensor))
        raise _refused(58)

    try:
        step()
    except BudgetTooSmall as err:
        assert choice.instead_of(err, mem) == (MiB, None)
    assert alive[0]() is None
