"""The on-demand rules (scheduler/on_demand.py): LRU victims, the in-flight share, the
persistent tensors evicted before a step, what a step leaving its plan writes out; and the optimizer state sizes measured on meta."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from ooc.runtime.dry_run import state_sizes
from scheduler import on_demand


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(-10, 500), st.sets(st.integers(0, 29)))
def test_victims_are_the_least_recent_not_kept_until_the_excess_is_freed(sizes, excess, kept):
    order = list(range(len(sizes)))
    victims = on_demand.choose_victims(order, excess, lambda x: sizes[x], lambda x: x in kept)
    assert not set(victims) & kept
    assert victims == sorted(victims)   # least recently used first, in the given order
    freed = sum(sizes[x] for x in victims)
    if victims:   # each victim was needed: the excess was not covered before it
        assert freed - sizes[victims[-1]] < excess
    candidates = [x for x in order if x not in kept]
    if freed < excess:   # short only when every candidate went
        assert victims == candidates
    if excess <= 0:
        assert victims == []


def test_victims_in_recency_order_skip_what_the_op_uses():
    recent = ["a", "b", "c", "d"]
    got = on_demand.choose_victims(recent, 15, {"a": 10, "b": 10, "c": 10, "d": 10}.get, lambda x: x == "a")
    assert got == ["b", "c"]


@given(st.lists(st.integers(1, 100), max_size=20), st.integers(0, 1000))
def test_persistent_eviction_leaves_what_fits_and_takes_the_last_first(sizes, budget):
    resident = list(enumerate(sizes))
    out = on_demand.persistent_to_evict(resident, budget)
    assert out == list(range(len(sizes) - 1, len(sizes) - 1 - len(out), -1))
    left = sum(sizes) - sum(sizes[i] for i in out)
    assert left <= budget or len(out) == len(sizes)
    if out:   # no more than needed
        assert left + sizes[out[-1]] > budget


def test_leaving_a_plan_writes_out_the_saved_activations_only_memory_holds():
    """Rule 4: a saved activation resident with no current copy on the tier is written out,
    unless the running backward node holds it; persistent tensors stay, whatever they hold."""
    tensors = [("act", True, True, False), ("held", True, True, True), ("copied", True, False, False),
               ("param", False, True, False), ("act2", True, True, False)]
    assert on_demand.to_write_out_on_leaving(tensors) == ["act", "act2"]
    assert on_demand.to_write_out_on_leaving([]) == []


def test_in_flight_limit_is_a_share_of_the_budget():
    assert on_demand.in_flight_limit(100 << 20) == (100 << 20) // on_demand.IN_FLIGHT_SHARE


def _params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def test_state_sizes_are_measured_per_optimizer_not_assumed():
    """What the first update will create, for optimizers with 0, 1 and 2 tensors per
    parameter: the engine reserves room on the tier for exactly that before the update."""
    cases = {
        "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
        "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
        "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), 1),
        "adam": (lambda ps: torch.optim.Adam(ps, lr=0.1), 2),
    }
    for name, (make, per_param) in cases.items():
        model = _params()
        opt = make(model.parameters())
        sizes = state_sizes(opt)
        assert sizes is not None, name
        for p in model.parameters():
            big = [n for n in sizes[p] if n >= p.untyped_storage().nbytes()]
            assert len(big) == per_param, (name, sizes[p])
        opt.step()   # the real step creates what was measured
        for p in model.parameters():
            real = sorted(t.untyped_storage().nbytes() for t in opt.state[p].values()
                          if isinstance(t, torch.Tensor) and t.numel() > 1)   # not step counters
            assert real == sorted(sizes[p]), name
