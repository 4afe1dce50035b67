"""``scheduler.whole_step``: the bytes a step holds beside its managed tensors, and the managed
budget that leaves room for them under a budget for the whole step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import BudgetTooSmall, Cost, Kind, Variable, build_sequence
from scheduler.ir import VariableSequence
from scheduler.whole_step import held_beside, least_budget, managed_budget
from scheduler.working_sets import working_sets

MiB = 1 << 20


def _step() -> VariableSequence:
    """A weight (live in and out), two activations, a temporary of the backward, a gradient,
    and optimizer state the step creates and keeps (a first step's momentum)."""
    return build_sequence(
        [("fwd1", [(0, "r"), (1, "w")], Cost()),            # 0: activation a
         ("fwd2", [(0, "r"), (2, "w")], Cost()),            # 1: activation b (a waits for bwd2)
         ("bwd1", [(2, "r"), (3, "w")], Cost()),            # 2: temporary t (a gradient of b)
         ("bwd2", [(3, "r"), (1, "r"), (4, "w")], Cost()),  # 3: gradient g
         ("opt", [(4, "r"), (0, "w"), (5, "w")], Cost())],  # 4: the update, momentum m
        [Variable(0, 10 * MiB, Kind.PARAM, "w", live_in=True, live_out=True),
         Variable(1, 40 * MiB, Kind.ACTIVATION, "a"), Variable(2, 30 * MiB, Kind.ACTIVATION, "b"),
         Variable(3, 20 * MiB, Kind.TEMPORARY, "t"), Variable(4, 10 * MiB, Kind.GRAD, "g"),
         Variable(5, 10 * MiB, Kind.OPTIMIZER_STATE, "m", live_out=True)])


def _managed(whole: VariableSequence, keep: set[int]) -> VariableSequence:
    """``whole`` with only the variables ``keep`` (the engine's recording of its managed tensors)."""
    functions = tuple(type(f)(f.index, f.name, tuple(u for u in f.uses if u.var in keep), f.cost)
                      for f in whole.functions)
    return VariableSequence(functions, {v: whole.variables[v] for v in keep}, {})


def test_held_is_the_whole_steps_bytes_less_the_managed_ones_with_what_it_keeps_from_the_start() -> None:
    whole = _step()
    held = held_beside(whole, _managed(whole, {1, 2}))
    # the weight everywhere, the momentum the step keeps (there when the next step starts),
    # the temporary during the backward's first two functions, the gradient until the update
    assert held == tuple(x * MiB for x in (20, 20, 40, 50, 30))
    # what in core holds, less the managed activations, plus the momentum before it is made
    managed = _managed(whole, {1, 2}).live_bytes
    assert [h - (10 * MiB if i < 4 else 0) for i, h in enumerate(held)] == \
        [t - m for t, m in zip(whole.live_bytes, managed)]
    # each tensor as the allocator takes it (here whole 16 MiB blocks), the managed ones too
    blocks = held_beside(whole, _managed(whole, {1, 2}), size=lambda n: -(-n // (16 * MiB)) * 16 * MiB)
    assert blocks == tuple(x * MiB for x in (32, 32, 64, 80, 48))


def _held(held_to: dict[int, int]) -> VariableSequence:
    """``_step`` and one more function (the user's logging reads the weight), with what a
    recorder saw die later than its last use (``Variable.held_to``)."""
    seq = _step()
    functions = seq.functions + (type(seq.functions[0])(5, "log", ((seq.functions[0].uses[0]),)),)
    variables = {v: Variable(x.id, x.nbytes, x.kind, x.name, x.live_in, x.live_out, held_to.get(v))
                 for v, x in seq.variables.items()}
    return VariableSequence(functions, variables, {})


def test_what_the_program_holds_past_its_last_use_is_held_beside_unless_the_engine_manages_it() -> None:
    """A Python name kept the backward's temporary to the update, and the gradient lived until
    ``zero_grad``, after the update: eager lifetimes had both gone, and a plan bounded by those
    figures went over the step's budget by them (an MLP with Adam: 27 MiB over 204 MiB). What
    the engine manages goes when it lets it go: not counted; under ``min_bytes`` it is not
    managed, whatever its kind. A gradient the update will read (``read_later``) counts once."""
    whole = _held({3: 4, 4: 5})   # t last used at bwd2 (3), g at the update (4)
    eager = held_beside(_held({}), _managed(_held({}), {1, 2}))
    assert eager == tuple(x * MiB for x in (20, 20, 40, 50, 30, 20))
    assert held_beside(whole, _managed(whole, {1, 2})) == tuple(x * MiB for x in (20, 20, 40, 50, 50, 30))
    managed_grad = _managed(whole, {1, 2, 4})   # the gradient managed: only the temporary's hold counts
    assert held_beside(whole, managed_grad)[4:] == (40 * MiB, 20 * MiB)
    assert held_beside(whole, managed_grad, min_bytes=16 * MiB)[5] == 30 * MiB   # a gradient under min_bytes
    assert held_beside(whole, _managed(whole, {1, 2}), read_later=[4]) == held_beside(whole, _managed(whole, {1, 2}))
    before = _held({3: 2})   # (seen dead before its last use: a storage its bytes moved out of)
    assert held_beside(before, _managed(before, {1, 2})) == eager


def test_functions_the_whole_recording_leaves_out_hold_what_the_one_before_held() -> None:
    whole = _step()
    kept = _managed(whole, {1, 2})
    marker = type(kept.functions[0])(2, "profiler._record_function_enter_new", (), Cost())
    functions = list(kept.functions[:2]) + [marker] + [
        type(f)(f.index + 1, f.name, f.uses, f.cost) for f in kept.functions[2:]]
    with_marker = VariableSequence(tuple(functions), dict(kept.variables), {})
    held = held_beside(whole, with_marker, skipped=[2])
    assert held == tuple(x * MiB for x in (20, 20, 20, 40, 50, 30))
    with pytest.raises(ValueError, match="not the same step"):
        held_beside(whole, with_marker)


def test_the_managed_budget_is_what_is_left_where_the_step_holds_the_most() -> None:
    whole = _step()
    managed = _managed(whole, {1, 2})
    held = held_beside(whole, managed)
    assert managed_budget(managed, held, 130 * MiB) == 80 * MiB   # more than a and b's in-core peak: not capped there
    assert managed_budget(managed, held, 110 * MiB, granule=4 * MiB) == 60 * MiB
    assert managed_budget(managed, held, 110 * MiB, reserve=lambda b: 8 * MiB, granule=4 * MiB) == 52 * MiB
    assert managed_budget(managed, held, 190 * MiB, arenas=2) == 70 * MiB   # (190 - 50) / 2


def test_a_step_budget_that_leaves_no_working_set_names_where_and_how_much() -> None:
    whole = _step()
    managed = _managed(whole, {1, 2})
    held = held_beside(whole, managed)
    need = max(working_sets(managed))   # 40 MiB: a, written by fwd1 and read by bwd2
    with pytest.raises(BudgetTooSmall) as err:
        managed_budget(managed, held, 90 * MiB, reserve=lambda b: 4 * MiB)
    e = err.value
    assert (e.function, e.name, e.working_set) == (3, "bwd2", 50 * MiB + need)
    assert e.minimum == 50 * MiB + need + 4 * MiB
    assert "covers the whole step" in "".join(e.__notes__) and "4 MiB is kept" in "".join(e.__notes__)
    assert managed_budget(managed, held, e.minimum, reserve=lambda b: 4 * MiB) == need   # the minimum is enough
    eighth = lambda b: b // 8   # noqa: E731 - a reserve that grows with the budget (the CPU cache's)
    with pytest.raises(BudgetTooSmall) as err:
        managed_budget(managed, held, 90 * MiB, reserve=eighth, granule=1)
    assert managed_budget(managed, held, err.value.minimum, reserve=eighth, granule=1) == need
    assert err.value.minimum - 1 - (err.value.minimum - 1) // 8 < 50 * MiB + need   # and the least that is
    with pytest.raises(BudgetTooSmall) as err:
        managed_budget(managed, held, 120 * MiB, arenas=2)
    assert err.value.minimum == 50 * MiB + 2 * need
    assert managed_budget(managed, held, err.value.minimum, arenas=2) == need


def test_activations_count_as_the_whole_chunks_the_pool_gives_them() -> None:
    """The planner counts each activation in whole chunks (``round_activations``: they come
    back into pool ranges), so the share and its refusal do too. Two 4-byte activations live
    together need two 4 KiB chunks; counted in their own bytes they peaked at 8 B, the share
    was capped at one chunk, and the planner refused every step budget (PyTorch's module
    database under ``budget_covers="step"``: ``nn.ReLU``, ``nn.BatchNorm2d``, ``nn.LSTM``)."""
    whole = build_sequence(
        [("fwd1", [(0, "r"), (1, "w")], Cost()), ("fwd2", [(1, "r"), (2, "w")], Cost()),
         ("bwd", [(1, "r"), (2, "r"), (3, "w")], Cost())],
        [Variable(0, 100, Kind.PARAM, "w", live_in=True, live_out=True), Variable(1, 4, Kind.ACTIVATION, "a"),
         Variable(2, 4, Kind.ACTIVATION, "b"), Variable(3, 100, Kind.GRAD, "g")])
    managed = _managed(whole, {1, 2})
    held = held_beside(whole, managed)
    chunk = 4096
    assert managed_budget(managed, held, 1 * MiB, granule=chunk) == (MiB - max(held)) // chunk * chunk   # in chunks
    with pytest.raises(BudgetTooSmall) as err:
        managed_budget(managed, held, max(held) + chunk, granule=chunk)
    assert err.value.working_set == max(held) + 2 * chunk
    assert managed_budget(managed, held, err.value.minimum, granule=chunk) == 2 * chunk


@settings(max_examples=60, deadline=None)
@given(held=st.lists(st.integers(0, 300), min_size=5, max_size=5), granule=st.sampled_from([1, 64, 256]),
       arenas=st.sampled_from([1, 2]), eighth=st.booleans())
def test_the_minimum_named_is_the_least_step_budget_that_works(held, granule, arenas, eighth) -> None:
    """Whatever the step holds, the reserve and the granule: the minimum a refusal names gives
    the largest working set, and one granule less does not."""
    whole = _step()
    managed = _managed(whole, {1, 2})
    held = [h * 1024 for h in held]
    reserve = (lambda b: b // 8) if eighth else (lambda b: 0)
    kw = dict(reserve=reserve, arenas=arenas, granule=granule * 1024)
    with pytest.raises(BudgetTooSmall) as err:
        managed_budget(managed, held, max(held), **kw)   # never enough: nothing left beside
    minimum = err.value.minimum
    assert managed_budget(managed, held, minimum, **kw) >= max(working_sets(managed))
    with pytest.raises(BudgetTooSmall):
        managed_budget(managed, held, minimum - granule * 1024, **kw)


@settings(max_examples=80, deadline=None)
@given(need=st.integers(1, 5000), start=st.integers(0, 3000), guess=st.integers(0, 4000),
       granule=st.sampled_from([1, 7, 64]), eighth=st.booleans())
def test_least_budget_is_the_least_granule_multiple_whose_share_holds(need, start, guess, granule, eighth) -> None:
    def share(b: int) -> int:
        return max(0, (b - (b // 8 if eighth else 0) - start) // granule * granule)

    got = least_budget(share, need, guess, granule)
    first = max(-(-guess // granule), 1) * granule
    brute = next(b for b in range(first, 20000, granule) if share(b) >= need)
    assert got == brute
