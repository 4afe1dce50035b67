"""Plans whose waits for swap-outs are placed by time (``scheduler.release``) run bitwise.

The default planner keeps such a plan only where ``simulate`` predicts it faster, which on
small test models may be never; here it is forced on, so every planned step waits for its
swap-outs as early as the rule says and prefetches into the bytes that frees. Asserted: the
rule did move waits in the plans the engine ran, every step stayed within the budget, and
parameters, losses and BatchNorm statistics are bitwise those of in-core training (a CNN with
BatchNorm and skip connections, SGD with momentum; a transformer with dropout, Adam), per op
and anchored, with every kind managed and with the update inside the backward.
"""

from __future__ import annotations

import pytest

import scheduler.recompute
from ooc import OutOfCore
from ooc.measure import managed_peak, update_in_backward
from scheduler.hardware import hardware
from scheduler.release import timed_release
from test_anchored_steps import CASES, assert_same, data, fresh, train  # noqa: F401 - data: train's

pytestmark = pytest.mark.timeout(300)

ALL = ("activations", "params", "grads", "optimizer_state")


@pytest.fixture
def moved(monkeypatch) -> list[int]:
    """Make the planner always take the plan with timed waits; returns, per plan made so, how
    many waits the rule placed before the overflow point.

    The rule is given a link with no latency and no transfer time, so it moves each wait to
    the function after the victim's last use wherever that comes before the overflow point,
    on any machine: with the CPU preset's link and the op seconds measured in the recording,
    whether any wait moved depended on the machine's speed (on CI's faster machine, small_cnn's
    ops were short beside a transfer and all four plans kept every wait in place)."""
    counts: list[int] = []

    def forced(seq, best, best_s, hw, make):
        rule, early = timed_release(seq, hardware(hw, link_latency_s=0.0, d2h_bandwidth=1e30)), []

        def spy(v: int, last: int, at: int) -> int:
            back = rule(v, last, at)
            early.extend([v] if back < at else [])
            return back

        plan = make(spy)
        if plan is None:
            return best
        counts.append(len(early))
        return plan

    monkeypatch.setattr(scheduler.recompute, "_sooner", forced)
    return counts


@pytest.mark.parametrize("name,opt,manage,in_backward", [
    ("small_cnn", "sgd", ALL, False),
    ("gpt2", "adam", ("activations",), False),
    ("gpt2", "sgd", ALL, True),
])
def test_plans_with_timed_waits_stay_within_budget_and_bitwise(moved, name, opt, manage, in_backward) -> None:
    sizes = [8] * 6
    ref, ref_opt = fresh(name, opt)
    if in_backward:
        update_in_backward(ref, ref_opt)
    ref_losses, _ = train(name, ref, ref_opt, None, sizes, in_backward=in_backward)
    model, o = fresh(name, opt)
    budget = managed_peak(name, 8, manage=manage, model_kwargs=CASES[name]) // 3
    with OutOfCore(model, o, budget=budget, manage=manage) as engine:
        if in_backward:
            update_in_backward(model, o)
        losses, stats = train(name, model, o, engine, sizes, in_backward=in_backward)
    assert any(moved), f"the rule moved no wait in any of {len(moved)} plans"
    planned = [s for s in stats if s["last_planned"]]
    assert len(planned) >= 3 and all(s["last_diverged_at"] == -1 for s in planned)
    assert all(s["resident_peak_bytes"] <= s["budget"] for s in planned)
    assert planned[-1]["plan.bytes_out"] > 0
    assert_same(ref, model, ref_losses, losses)
