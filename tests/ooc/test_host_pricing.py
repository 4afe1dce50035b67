"""A CPU engine prices its plan with the bandwidth its swap file measured, not the preset's."""

from __future__ import annotations

import pytest
import torch

import ooc
import scheduler
from ooc.engine.host_pricing import MIN_TIMED_BYTES, priced_hardware
from scheduler.hardware import hardware
from scheduler.ir import VariableSequence

GB = 1e9


def _seq(device: str) -> VariableSequence:
    return VariableSequence(functions=(), variables={}, meta={"device": device})


def test_each_direction_timed_enough_takes_the_measured_rate() -> None:
    preset = hardware("cpu-edge")
    stats = {"bytes_read": 2 * MIN_TIMED_BYTES, "read_s": 2 * MIN_TIMED_BYTES / (1.6 * GB),
             "bytes_written": MIN_TIMED_BYTES - 1, "write_s": 0.01}   # too few bytes written
    hw = priced_hardware(_seq("cpu"), stats)
    assert hw.h2d_bandwidth == pytest.approx(1.6 * GB)
    assert hw.d2h_bandwidth == preset.d2h_bandwidth
    assert (hw.moved_byte_s, hw.full_duplex, hw.peak_flops) == (
        preset.moved_byte_s, preset.full_duplex, preset.peak_flops)   # the rest is the preset's


@pytest.mark.parametrize("device, stats", [
    ("cpu", {}),                                                    # nothing timed yet
    ("cpu", {"bytes_read": 1 << 30, "read_s": 0.0}),                # no time: no rate
    ("cuda:0", {"bytes_read": 1 << 30, "read_s": 0.5}),             # a GPU swaps to host memory
])
def test_the_preset_stands_where_nothing_was_measured(device, stats) -> None:
    assert priced_hardware(_seq(device), stats) == scheduler.recompute.default_hardware(_seq(device))


def test_the_engine_plans_with_what_its_tier_timed(monkeypatch) -> None:
    """The recording step swaps on demand; the plan made after it is priced on the tier's
    counters (here a tier reporting a 3 GB/s read rate, so the check does not hang on timing)."""
    seen = []
    real_plan = scheduler.plan

    def plan(seq, **kw):
        if "hardware" in kw:   # the plan (the update's feasibility check prices nothing)
            seen.append(kw["hardware"])
        return real_plan(seq, **kw)

    monkeypatch.setattr(scheduler, "plan", plan)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ooc.OutOfCore(model, opt, budget="8MiB") as engine:
        real_stats = engine._mem.tier.stats
        monkeypatch.setattr(engine._mem.tier, "stats", lambda: {
            **real_stats(), "bytes_read": 1 << 30, "read_s": (1 << 30) / (3 * GB)})
        with engine.step():
            model(torch.randn(4, 64)).sum().backward()
            engine.optimizer_step()
    assert seen and seen[0].h2d_bandwidth == pytest.approx(3 * GB)
    assert seen[0].d2h_bandwidth == hardware("cpu-edge").d2h_bandwidth
