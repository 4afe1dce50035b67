"""The budget at which a step fits a device: the fastest plan whose modelled device peak fits.

The budget bounds ooc's bytes. The device holds PyTorch's beside them (weights, the backward's
gradients of activations, its temporaries), which peak where they peak, and a plan whose
swap-ins or replays land there adds to that peak: so the device's peak is not monotone in the
budget. On the H200 profile of ResNet-50 b256 (``benchmarks/profiles/resnet50.json``, one
arena) a budget of 8.0 GiB models a device peak of 10.38 GiB and 8.5 GiB one of 9.33 GiB; on the
H200 on 2026-11-28 budgets of 6.85, 8.15 and 10.27 GiB peaked at 8.54, 10.75 and 10.64 GiB. A
user who has a device of some size, and a benchmark's row matched to an alternative's peak,
need the budget read off that curve, not off a line through two of its points.

:func:`fit_device` plans the step at budgets spread from the smallest any plan can take (its
largest working set) to the one that moves nothing (the managed in-core peak), simulates each
plan and models its device peak (``scheduler.arenas.device_peaks``), and keeps the fastest
plan whose peak plus ``margin`` is within the device. Both are predictions: the simulator's
step, and a peak in bytes without the allocator's rounding or cuDNN's workspaces (on the H200
the measured peaks were 0.07-1.04 GiB over the model; that is what ``margin`` is for).

With one arena it can also try plans bounded by the device itself (``bounded=True``,
``scheduler.beside``: at each function the plan holds at most the device less what PyTorch
holds there), at device sizes from three quarters of the limit up to it: each fits by
construction, and the greedy planner is not monotone in its bound either, so the fastest of a
few is kept. On the H200 profile of ResNet-50 b256 such a plan within 10.07 GiB is predicted at
141.2 ms where the fastest flat budget under it is 149.2 ms (``benchmarks/results/device-bound.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.arenas import device_peaks
from scheduler.beside import unmanaged_bytes
from scheduler.errors import BudgetTooSmall
from scheduler.ir import VariableSequence
from scheduler.planner import plan
from scheduler.simulate import simulate
from scheduler.working_sets import working_sets

__all__ = ["ARENAS", "BOUNDED_TRIES", "Candidate", "Fit", "budgets_between", "fit_device"]

ARENAS = ("pytorch", "pool")   # Options(arena=...): one arena, or ooc's pool beside PyTorch's
BOUNDED_TRIES = 6   # device sizes a fit tries plans bounded by the device at


@dataclass(frozen=True, slots=True)
class Candidate:
    """One budget's plan: its predicted step, modelled device peak and traffic."""

    budget: int
    step_s: float
    device_peak: int
    bytes_moved: int
    bytes_recomputed: int
    bounded: bool = False   # planned bounded by the device: ``budget`` is the device's, the whole step's


@dataclass(frozen=True, slots=True)
class Fit:
    """Every budget tried, in increasing order, and the fastest whose peak is within ``limit``
    (the device less the margin); ``best`` is None where none is."""

    candidates: tuple[Candidate, ...]
    best: Candidate | None
    limit: int

    @property
    def smallest_peak(self) -> Candidate | None:
        """The candidate with the lowest modelled peak: what to say when nothing fits."""
        return min(self.candidates, key=lambda c: (c.device_peak, c.step_s), default=None)


def budgets_between(low: int, high: int, n: int, granule: int) -> list[int]:
    """``n`` budgets from ``low`` to ``high`` inclusive, evenly spaced, each rounded up to a
    multiple of ``granule`` (a chunk: budgets between two multiples plan alike), distinct."""
    if n < 2 or high <= low:
        return [-(-max(low, high) // granule) * granule]
    out: list[int] = []
    for k in range(n):
        b = low + (high - low) * k // (n - 1)
        b = -(-b // granule) * granule
        if not out or b > out[-1]:
            out.append(b)
    return out


def fit_device(full: VariableSequence, planned: VariableSequence, hw: Any, device_bytes: int, *,
               arena: str = "pytorch", margin: int = 0, n: int = 32, granule: int = 2 << 20,
               plan_options: dict[str, Any] | None = None, bounded: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Fit:
    """Plan ``planned`` (``full`` or a managed view of it) at ``n`` budgets on ``hw``, and keep
    the fastest plan whose modelled device peak in ``arena`` plus ``margin`` is within
    ``device_bytes``. ``plan_options`` go to ``scheduler.plan`` (``recompute=``); ``bounded``
    (one arena only): also plans bounded by the device at ``BOUNDED_TRIES`` sizes up to the
    limit. ``progress(done, total)`` is called after each plan."""
    if arena not in ARENAS:
        raise ValueError(f"arena must be one of {ARENAS}, got {arena!r}")
    if bounded and arena != "pytorch":
        raise ValueError("a plan bounded by the device needs one arena (arena='pytorch'): with ooc's pool "
                         "beside PyTorch's allocator the device holds the sum of two peaks")
    low = max(working_sets(planned), default=0)
    budgets = budgets_between(max(low, granule), max(planned.in_core_peak_bytes, granule), n, granule)
    limit = device_bytes - margin
    beside = unmanaged_bytes(full, planned)[:len(planned.functions)]
    caps = _caps(max(w + b for w, b in zip(working_sets(planned), beside)), limit, granule) if bounded else []
    tries = [(b, False) for b in budgets] + [(c, True) for c in caps]
    candidates: list[Candidate] = []
    for k, (budget, bound) in enumerate(tries):
        try:
            schedule = plan(planned, budget=budget, hardware=hw, **(plan_options or {}),
                            **({"beside": beside} if bound else {}))
        except BudgetTooSmall:   # over every working set, under what the step needs beside them
            schedule = None
        if schedule is not None:
            result = simulate(schedule, hw)
            peaks = device_peaks(full, schedule)
            candidates.append(Candidate(budget, result.total_s, peaks.of(arena),
                                        result.bytes_in + result.bytes_out, result.bytes_recomputed, bound))
        if progress is not None:
            progress(k + 1, len(tries))
    fitting = [c for c in candidates if c.device_peak <= limit]
    best = min(fitting, key=lambda c: (c.step_s, c.device_peak), default=None)
    return Fit(tuple(candidates), best, limit)


def _caps(low: int, limit: int, granule: int) -> list[int]:
    """Device sizes for plans bounded by the device: ``BOUNDED_TRIES`` from three quarters of
    ``limit`` (or ``low``, the least any takes) up to ``limit``, in whole ``granule``s within it."""
    top = limit // granule * granule
    if top < low:
        return []
    out = budgets_between(max(low, limit * 3 // 4), top, BOUNDED_TRIES, granule)
    return [c for c in out if c <= top] or [top]
