"""Where a matched row aims: the budget read off the device-peak curve of the case's GPU profile.

A row matched to an alternative's peak (``bench_gpu._matched``) needs the budget at which
ooc's whole device peak is that peak. Its first tries aimed on a line through the ooc rows'
(budget, peak) points, but the device's peak is not monotone in the budget
(``scheduler.device_fit``): on the H200 on 2026-11-28 the line aimed ResNet-50 at
checkpointing every block's 9.51 GiB with a budget of 8.15 GiB, which peaked at 10.75 GiB, and
then 6.85 GiB, 8.54 GiB and slower. Where ``benchmarks/profiles`` holds the case's profile (its
label is the case's), the first try takes the fastest budget of that profile's curve whose
modelled peak plus what the model missed on this run's own ooc rows (the largest measured
minus modelled peak among them) is within the alternative's peak; the later tries, and a case
without a profile, keep the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).resolve().parent / "profiles"


def profile_for(label: str, profiles: Path = PROFILES) -> Any:
    """The profile recorded of the case labelled ``label`` (a ``VariableSequence``), or None."""
    from scheduler.ir import VariableSequence

    for path in sorted(profiles.glob("*.json")):
        try:
            meta = json.loads(path.read_text()).get("meta", {})
        except (OSError, ValueError):
            continue
        if meta.get("label") == label:
            return VariableSequence.from_json(path)
    return None


def missed(full: Any, hw: Any, points: list[tuple[int, int]], arena: str) -> int:
    """The most a measured row peaked over the modelled peak of the plan at its budget."""
    import scheduler
    from scheduler.arenas import device_peaks
    from scheduler.managed import managed_view

    planned = managed_view(full)
    gaps = []
    for budget, peak in points:
        m = device_peaks(full, scheduler.plan(planned, budget=budget, hardware=hw))
        gaps.append(peak - (m.one_arena if arena == "pytorch" else m.two_arenas))
    return max(0, *gaps) if gaps else 0


def aimed_budget(label: str, hw: Any, points: list[tuple[int, int]], peak: int, arena: str,
                 profiles: Path = PROFILES) -> tuple[int, int] | None:
    """(budget, the model's miss) for a first try at ``peak``, or None where the case has no
    profile, no measured point, or no budget of its curve fits."""
    from scheduler.device_fit import fit_device
    from scheduler.managed import managed_view

    full = profile_for(label, profiles)
    if full is None or not points:
        return None
    gap = missed(full, hw, points, arena)
    if gap >= peak:
        return None
    fit = fit_device(full, managed_view(full), hw, peak, arena=arena, margin=gap)
    return None if fit.best is None else (fit.best.budget, gap)
