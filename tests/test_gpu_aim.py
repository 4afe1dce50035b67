"""bench_gpu's matched rows aim on the case's GPU profile (``benchmarks/gpu_aim.py``): the
device's peak is not monotone in the budget, so the first try reads the profile's curve, with
what the model missed on the run's own rows as the margin. No GPU: the H200 profile."""

from __future__ import annotations

import sys
from pathlib import Path

import scheduler
from scheduler.arenas import device_peaks
from scheduler.managed import managed_view
from scheduler.recompute import default_hardware

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_aim  # noqa: E402

GIB = 1 << 30
LABEL = "ResNet-50 b256"


def test_the_first_try_fits_its_profiles_curve_with_what_the_model_missed() -> None:
    full = gpu_aim.profile_for(LABEL)
    assert full is not None and full.meta["label"] == LABEL and gpu_aim.profile_for("ResNet-50 b7") is None
    hw = scheduler.hardware(default_hardware(full))
    planned = managed_view(full)
    modelled = device_peaks(full, scheduler.plan(planned, budget=5 * GIB, hardware=hw)).one_arena
    points = [(5 * GIB, modelled + GIB // 2)]   # a row that peaked 0.5 GiB over its model
    aim = gpu_aim.Aim.of(LABEL, hw, points, "pytorch")
    assert aim.missed == GIB // 2
    budget = aim.budget_for(int(9.51 * GIB))
    at = device_peaks(full, scheduler.plan(planned, budget=budget, hardware=hw)).one_arena
    assert at + aim.missed <= int(9.51 * GIB)   # within the peak
    assert aim.budget_for(GIB // 2) is None   # the miss alone is over
    assert gpu_aim.Aim.of(LABEL, hw, [], "pytorch") is None
    assert gpu_aim.Aim.of("no such case", hw, points, "pytorch") is None
