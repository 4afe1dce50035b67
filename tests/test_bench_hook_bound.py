"""bench_hook_bound's arithmetic: which chains a template could rerun, and what each form's host
lane is charged (the bounds in benchmarks/results/hook-bound.md rest on both)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import scheduler
from scheduler.ir import Access, Function, Kind, Use, Variable, VariableSequence
from scheduler.managed import managed_view
from scheduler.recompute import default_hardware

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_hook_bound as hb  # noqa: E402


def _seq(kind: Kind) -> VariableSequence:
    """x (the step's input) -> a = f(x) (``kind``) -> b = g(a, w): a chain (f, g) or (g)."""
    variables = [Variable(0, 64, Kind.INPUT, "x", live_in=True), Variable(1, 64, kind, "a"),
                 Variable(2, 64, Kind.ACTIVATION, "b"), Variable(3, 64, Kind.PARAM, "w", live_in=True)]
    functions = [Function(0, "f", (Use(0, Access.READ), Use(1, Access.WRITE)), replayable=True),
                 Function(1, "g", (Use(1, Access.READ), Use(3, Access.READ), Use(2, Access.WRITE)),
                          replayable=True)]
    return VariableSequence(tuple(functions), {v.id: v for v in variables})


@pytest.mark.parametrize("kind, alone", [(Kind.ACTIVATION, True), (Kind.TEMPORARY, False)])
def test_a_chain_is_templatable_when_the_hooks_see_what_it_reads(kind: Kind, alone: bool) -> None:
    raw = _seq(kind)
    # g alone reads a: a saved activation the hooks see, or a temporary no hook sees
    assert hb.templatable(raw, (1,)) is alone
    # made again by the chain itself, the temporary is no argument of the template
    assert hb.templatable(raw, (0, 1))


def test_templates_take_the_mode_off_the_host_lane_and_add_only_the_replays() -> None:
    raw = VariableSequence.from_json(hb.PROFILES / "gpt2.json")
    seq = managed_view(raw)
    schedule = scheduler.plan(seq, budget=seq.in_core_peak_bytes // 4, hardware=default_hardware(seq))
    scopes = hb.lanes(schedule, "hook-driven, mode in scopes", raw, saved=350)
    templates = hb.lanes(schedule, "hook-driven, templates", raw, saved=350)
    assert scopes["replayed"] > 0 and scopes["quiet"] + scopes["looked"] > 0
    # every chain of this plan reads only what the hooks see: no op left for the mode
    assert templates["quiet"] == templates["looked"] == templates["replayed"] == 0
    assert templates["templated"] == scopes["replayed"]
    cost, per_saved = hb.MEASURED["gpu.md"], 6.9
    h0 = 20.0
    assert (hb.host_s(templates, h0, cost, per_saved, 5.0)
            < hb.host_s(scopes, h0, cost, per_saved, 5.0))
    # the hooks are charged per saved tensor: the same step with no saved tensor costs less by them
    bare = {**templates, "saved": 0}
    assert hb.host_s(templates, h0, cost, per_saved, 5.0) - hb.host_s(bare, h0, cost, per_saved, 5.0) == (
        pytest.approx(350 * per_saved * 1e-6))
