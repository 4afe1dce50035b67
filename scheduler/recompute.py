"""Swap or recompute: the default planner's rule for each tensor the budget forces out.

The window planner (``scheduler.window``) decides *which* variables leave the device (Belady:
the farthest next use first) and keeps its free exits, step (d): a variable never used yet
starts in the slower tier, one whose host copy is current is dropped. For every other victim
it asks this module's rule, which compares what each way out costs on the hardware:

- swap: the copy out and the copy back in (``Hardware.transfer_s``), times the share of
  transfer time that compute cannot hide (``exposure``), plus on a CPU device the compute
  time the moved bytes take (``2 x bytes x Hardware.moved_byte_s``);
- recompute: the seconds of the chain that re-creates it (``scheduler.replay``), measured
  when the recorder timed the ops, else the roofline; it runs on the compute stream.

Recompute wins when it is cheaper. How much of a transfer hides depends on the whole plan
(the link is free while compute runs, until it is not), so the planner prices with a few
exposures, 1 (nothing hides), 1/2 and 1/10, plans with each, and keeps the plan that
``scheduler.simulate`` predicts fastest on the hardware, the swap-only plan included (ties go
to it). A sequence in which no function is replayable (every trace before recomputation)
gets the swap-only plan, unchanged.
"""

from __future__ import annotations

import logging

from scheduler.check import check
from scheduler.errors import BudgetTooSmall, ScheduleError
from scheduler.hardware import Hardware, hardware
from scheduler.ir import VariableSequence
from scheduler.replay import Chain, chain_for, recompute_candidates
from scheduler.schedule import Schedule
from scheduler.simulate import simulate
from scheduler.window import Recompute, plan_window
from scheduler.working_sets import Infeasible

__all__ = ["EXPOSURES", "RECOMPUTE_MODES", "chain_seconds", "default_hardware", "plan_swap_or_recompute", "swap_or_recompute"]

log = logging.getLogger(__name__)

EXPOSURES = (1.0, 0.5, 0.1)
RECOMPUTE_MODES = ("auto", "prefer", "never")


def default_hardware(seq: VariableSequence) -> Hardware:
    """The hardware a plan is priced on when the caller names none: the CPU preset for a
    sequence recorded on a CPU, else the seed paper's V100."""
    device = str(seq.meta.get("device", ""))
    return hardware("cpu-edge" if device.startswith("cpu") else "v100-16gb-nvlink")


def chain_seconds(seq: VariableSequence, chain: Chain, hw: Hardware) -> float:
    """Seconds the chain takes on the compute stream (what ``simulate`` charges)."""
    return sum(hw.function_s(seq.functions[k].cost) for k in chain.functions)


def swap_or_recompute(seq: VariableSequence, hw: Hardware, exposure: float) -> Recompute:
    """The rule: ``rule(v, at)`` is the chain to recompute ``v`` with before function ``at``
    when that costs less than swapping it (priced as the module says), else None."""

    def rule(v: int, at: int) -> Chain | None:
        chain = chain_for(seq, v, at)
        if chain is None:
            return None
        nb = seq.variables[v].nbytes
        swap_s = (exposure * (hw.transfer_s(nb, to_device=False) + hw.transfer_s(nb, to_device=True))
                  + 2 * nb * hw.moved_byte_s)
        return chain if chain_seconds(seq, chain, hw) < swap_s else None

    return rule


def plan_swap_or_recompute(seq: VariableSequence, budget: int, window: int | None = None,
                           hw: Hardware | str | None = None, mode: str = "auto") -> Schedule:
    """Policy "window" with recomputation: the swap-only plan, and one plan per exposure in
    ``EXPOSURES`` with the rule choosing swap or recompute per victim; the fastest on ``hw``
    (``simulate``) wins, ties to the swap-only plan. ``mode="prefer"``: every victim that
    has a chain is recomputed (the swap-only plan only if that one does not fit);
    ``"never"``: the swap-only plan."""
    best = plan_window(seq, budget, window)
    if mode == "never" or not recompute_candidates(seq):
        return best     # nothing may be replayed: today's plan, byte for byte
    if mode == "prefer":
        try:
            candidate = plan_window(seq, budget, window, lambda v, at: chain_for(seq, v, at))
            check(candidate)
            return candidate
        except (Infeasible, BudgetTooSmall) as err:
            log.info("recompute='prefer' does not fit; swapping instead: %s", err)
            return best
    hw = default_hardware(seq) if hw is None else hardware(hw)
    best_s = simulate(best, hw, timeline=False).total_s
    for exposure in EXPOSURES:
        try:
            candidate = plan_window(seq, budget, window, swap_or_recompute(seq, hw, exposure))
            check(candidate)
        except (Infeasible, BudgetTooSmall) as err:   # recomputing here does not fit: swap-only does
            log.debug("window+recompute at exposure %.2f does not fit, ignored: %s", exposure, err)
            continue
        except ScheduleError as err:   # a planner bug: never let it cost the swap-only plan
            log.warning("window+recompute at exposure %.2f is unsafe, ignored: %s", exposure, err)
            continue
        t = simulate(candidate, hw, timeline=False).total_s
        log.debug("window+recompute: exposure %.2f -> %.6f s (%d B recomputed)", exposure, t,
                  candidate.bytes_recomputed)
        if t < best_s:
            best, best_s = candidate, t
    return best
