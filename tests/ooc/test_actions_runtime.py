"""The runtime follows the same transition table as ``check`` and ``simulate``.

Zoo sequences (traced on meta) planned by both window policies get one verdict from every
consumer, and a planned step whose schedule was corrupted is refused by the runtime's
executor (``Stepper.apply``) with the error ``check`` raises for the same action.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

import ooc
from ooc import models, Options
from ooc.engine import OutOfCore
from scheduler import Action, Op, check, plan
from scheduler.actions import Refused
from scheduler.window import working_sets

sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))
from test_actions import _agree, _mutants  # noqa: E402


@pytest.mark.parametrize("name", ["small_cnn", "tiny_transformer"])
def test_zoo_plans_and_mutants_get_one_verdict(name) -> None:
    with torch.device("meta"):
        model = models.get(name)
    x, y = models.example_batch(name, 4, "meta")
    seq = ooc.trace(model, x, y, loss_fn=models.loss_fn(name), optimizer="adam", name=name)
    budget = max(max(working_sets(seq)), seq.in_core_peak_bytes // 4)
    for policy in ("window", "window-paper"):
        s = plan(seq, budget, policy=policy)
        assert _agree(s) == (None, check(s).peak_bytes)
        for m in _mutants(s, random.Random(policy), 25):
            _agree(m)


def _corrupt(s):
    """The plan with a wait_in before its first free (of a resident variable: nothing to wait for)."""
    for i, acts in enumerate(s.after):
        for j, a in enumerate(acts):
            if a.op is Op.FREE:
                after = list(s.after)
                after[i] = acts[:j] + (Action(Op.WAIT_IN, a.var),) + acts[j:]
                return dataclasses.replace(s, after=tuple(after))
    raise AssertionError("the plan frees nothing")


def test_a_corrupted_plan_is_refused_by_the_runtime_as_by_check() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
                                  for _ in range(6)], torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step(e):
        with e.step():
            st = e._stepper
            torch.nn.functional.cross_entropy(model(x), y).backward()
            e.optimizer_step()
        return st

    e = OutOfCore(model, opt, budget=1 << 20, options=Options(chunk=16 << 10, min_bytes=4096))
    try:
        for _ in range(3):
            st = step(e)
        assert st.planned and st.diverged_at is None and st.refused is None
        key, (schedule, binding) = next((k, p) for k, p in e._plans.plans.items() if p[0] is st.schedule)
        bad = _corrupt(schedule)
        with pytest.raises(Refused) as checked:
            check(bad)
        e._plans.plans[key] = (bad, binding)
        st = step(e)
        assert st.refused is not None and st.diverged_at == checked.value.function
        assert st.refused.verdict == checked.value.verdict
        assert str(st.refused) == str(checked.value)
    finally:
        e.close()
