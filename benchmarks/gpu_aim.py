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


def missed_by_model(full: Any, planned: Any, hw: Any, points: list[tuple[int, int]], arena: str) -> int:
    """The most a measured (budget, peak) point peaked over the model of its plan (``planned``,
    a managed view of the profile ``full``, at that budget on ``hw``: its device peak in
    ``arena``, ``scheduler.arenas``); ``points`` not empty."""
    import scheduler
    from scheduler.arenas import device_peaks

    return max(peak - device_peaks(full, scheduler.plan(planned, budget=budget, hardware=hw)).of(arena)
               for budget, peak in points)


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
        from scheduler.managed import managed_view

        full = profile_for(label, profiles)
        if full is None or not points:
            return None
        planned = managed_view(full)
        return Aim(full, planned, hw, arena, max(0, missed_by_model(full, planned, hw, points, arena)))

    def budget_for(self, peak: int) -> int | None:
        """The fastest budget whose modelled peak plus ``missed`` is within ``peak``, or None
        where none of the curve's budgets is."""
        from scheduler.device_fit import fit_device

        if self.missed >= peak:
            return None
        fit = fit_device(self.full, self.planned, self.hw, peak, arena=self.arena, margin=self.missed)
        return None if fit.best is None else fit.best.budget


def matched_budget(points: list[tuple[int, int]], peak: int) -> int | None:
    """The budget at which ooc's peak should be ``peak``, on the line through two measured
    (budget, peak) ``points``: the largest budget under ``peak`` and the smallest over it where
    the points bracket it (a peak is not linear in the budget: the H100's one-arena rows bent
    upwards past 1/2), else the two nearest it (the two smallest budgets where every point is
    over it, the two largest where none is). None where that line gives no positive budget
    (ooc's fixed part alone is over ``peak``) or the points cannot tell."""
    pts = sorted(points)
    under, over = [q for q in pts if q[1] <= peak], [q for q in pts if q[1] > peak]
    if under and over and under[-1][0] < over[0][0]:
        pair = [under[-1], over[0]]
    else:
        pair = pts[:2] if not under else pts[-2:]
    if len(pair) < 2:
        return None
    (b1, p1), (b2, p2) = pair
    if b2 == b1 or p2 <= p1:
        return None
    budget = b1 + (peak - p1) * (b2 - b1) / (p2 - p1)
    return int(budget) if budget > 0 else None


MATCH_TRIES = 2   # a try whose peak overshoots adds its point, and the next aims between
AIM = 0.97        # of the alternative's peak: where a matched try aims
SHORT = 0.95      # of it: a slower try that peaked under this left memory unused; try nearer


def tries_again(peak: int, step_ms: float | None, alt_peak: int, alt_step_ms: float | None) -> bool:
    """After a matched try that ran: whether to try once more, its point added to the line.
    Over the alternative's peak: between it and the points below (it is not at no more
    memory). Well under it (``SHORT``) and slower than the alternative: nearer it, where a plan
    moves less. On the H200 at db63edf ResNet-50's try matched to checkpointing every block
    peaked at 8.73 GiB of 9.32 (aimed at 9.04) and ran 163.1 ms against 159.2: a tie left
    with 0.6 GiB unused, and no second try."""
    if peak > alt_peak:
        return True
    return peak < SHORT * alt_peak and step_ms is not None and alt_step_ms is not None and step_ms > alt_step_ms
