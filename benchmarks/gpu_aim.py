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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).resolve().parent / "profiles"


def profile_for(label: str, profiles: Path = PROFILES) -> Any:
    """The profile recorded of the case labelled ``label`` (a ``VariableSequence``), or None;
    each file is read and parsed once."""
    from scheduler.ir import VariableSequence

    for path in sorted(profiles.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("meta", {}).get("label") == label:
            return VariableSequence.from_dict(data, where=str(path))
    return None


@dataclass(frozen=True)
class Aim:
    """One case's curve, in one arena: its profile (``full``) and the view the engine plans
    (``planned``), and what the model missed on the run's own rows (``missed``). Made once per
    matched method; each alternative's peak is one ``budget_for``."""

    full: Any
    planned: Any
    hw: Any
    arena: str
    missed: int

    @staticmethod
    def of(label: str, hw: Any, points: list[tuple[int, int]], arena: str,
           profiles: Path = PROFILES) -> Aim | None:
        """The aim for the case labelled ``label`` from its measured (budget, peak) ``points``
        (the most one peaked over the modelled peak of the plan at its budget is the margin),
        or None where the case has no profile or no point was measured."""
        import scheduler
        from scheduler.arenas import device_peaks
        from scheduler.managed import managed_view

        full = profile_for(label, profiles)
        if full is None or not points:
            return None
        planned = managed_view(full)
        missed = max(0, *(peak - device_peaks(full, scheduler.plan(planned, budget=budget, hardware=hw)).of(arena)
                          for budget, peak in points))
        return Aim(full, planned, hw, arena, missed)

    def budget_for(self, peak: int) -> int | None:
        """The fastest budget whose modelled peak plus ``missed`` is within ``peak``, or None
        where none of the curve's budgets is."""
        from scheduler.device_fit import fit_device

        if self.missed >= peak:
            return None
        fit = fit_device(self.full, self.planned, self.hw, peak, arena=self.arena, margin=self.missed)
        return None if fit.best is None else fit.best.budget
