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
exposures, a 1-2-5 series from 1 (nothing hides) down to 1/10, plans with each, once with
chains that start from resident inputs only and once also through inputs discarded at that
point (``scheduler.replay.chain_through``: more recomputed, and more held while a chain runs,
which a tight budget may not afford), and keeps the plan that ``scheduler.simulate`` predicts
fastest on the hardware, the swap-only plan included (ties go to it). The winning exposure
need not be a grid end: on the V100 at ResNet-50 batch 1440 (through chains, wide window)
every exposure from 0.15 to 0.3 gives 0.699-0.710 of in-core speed, 0.5 gives 0.683 and 0.1
gives 0.624, so the grid needs a point in between.

When the caller names no window, the ``WIDE_TRIES`` fastest plans are made again with twice
nnabla's default (``WIDE_WINDOW``). The window only bounds how far ahead a swap-in may be
issued; this planner's prefetch is bounded by the device bytes already, and a plan that needs a swap-in
far back (a replay's inputs before a backward that holds most of the budget) is faster with
the wider one (ResNet-50 batch 1440 on the V100: 0.670 -> 0.710 of in-core speed), while the
link's first-come order can make it slower elsewhere, hence both, judged by ``simulate``. Only
where the link runs beside compute (``Hardware.moved_byte_s`` 0, a GPU's copy engines): on a
CPU device every read takes compute time wherever it is issued, the default window already
leaves no stall (bench_cpu: 0.002 s per step), and on ResNet-50 batch 8 at 1/4 the wider one
gained nothing measurable (median +0.02x in-core over 12 paired fresh-process rounds).
A sequence in which no function is replayable (every trace before recomputation) gets the
swap-only plan at the default window, unchanged.

Where the link runs beside compute (a GPU), the plans tried are mostly of another kind
(issue 38; predicted on the H200 profiles at 1/2 and 1/4 of the in-core peak: ResNet-50 b256
from 0.82x / 0.65x to 0.89x / 0.77x in-core, GPT-2 small from 0.90x / 0.86x to 0.95x / 0.92x,
the Llama from 0.89x / 0.81x to 0.93x / 0.90x; one plan of the old kind, through chains at
``GPU_THROUGH_EXPOSURES``, stays in the grid for links that cannot keep up whatever the plan):

- replays are *shared* (``SHARED``, ``scheduler.segments``): a chain whose input was
  discarded moves that input's own recompute before it instead of making the input again
  as a temporary, so each function of a discarded segment reruns once per backward (through
  chains had rerun 12 of ResNet-50's 33 ms of recompute a second time), and a chain is priced
  on its own functions only, the ones it adds;
- a swap's price adds the wait for its copy on the device-to-host queue
  (``scheduler.link_clock``): the forward makes activations faster than the link takes them
  (ResNet-50's forward: 43 ms, 2.2 GiB of link; the plan swapped 3.45 GiB there and stalled
  35 ms), so a tensor is swapped while the link is idle and recomputed when its copy would
  keep the compute stream waiting.

Last, the winner (or, with nothing to replay or ``mode="never"``, the swap-only plan) is made
once more with its waits for swap-outs placed by time (``scheduler.release``: a victim's bytes
come back as soon as its copy should be done, not at the overflow point, so a prefetch can use
them), and that plan is kept where ``simulate`` predicts it faster. It moves the same bytes.
Only when there is hardware to price on: ``plan(seq, budget)`` with no ``hardware`` option and
nothing to replay still gives the plan of old.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from scheduler.check import check
from scheduler.errors import BudgetTooSmall, ScheduleError
from scheduler.hardware import Hardware, hardware
from scheduler.ir import VariableSequence
from scheduler.pins import Pins, pinned_rule
from scheduler.release import Release, timed_release
from scheduler.replay import Chain, chain_for, chain_through, recompute_candidates
from scheduler.schedule import Schedule
from scheduler.simulate import simulate
from scheduler.window import Recompute, plan_window
from scheduler.working_sets import INF, Infeasible, default_window

__all__ = ["EXPOSURES", "GPU_EXPOSURES", "GPU_THROUGH_EXPOSURES", "RECOMPUTE_MODES", "SHARED", "WIDE_TRIES", "WIDE_WINDOW",
           "candidate_grid", "chain_seconds", "default_hardware", "plan_swap_or_recompute", "swap_or_recompute"]

log = logging.getLogger(__name__)

EXPOSURES = (1.0, 0.5, 0.2, 0.1)
#: Where the link runs beside compute (a GPU's copy engines), only shared replays with swaps
#: priced on the link's queue, at two exposures (the queue's wait is priced apart, so the
#: exposure is only what a copy that waits for nothing still costs). On the H200 profiles of
#: ResNet-50 b256, GPT-2 small b8x1024 and a ~320 M Llama b4x2048 (benchmarks/profiles/), at
#: 1/2 and 1/4 of the managed peak, over 0.2, 0.1, 0.05 and 0.02, 0.05 won five of six times
#: and 0.1 the sixth (Llama at 1/4: 0.881 vs 0.866), and shared replays beat chains through
#: discarded inputs in all six (by 0.03-0.12x in-core). The full grid (12 plans) took 0.6 s
#: for the Llama's 5,872 functions: a re-plan that costs several GPU steps.
GPU_EXPOSURES = (0.1, 0.05)
#: Beside them, chains through discarded inputs, not shared, at these exposures: where the
#: link cannot carry what the budget forces out whatever the plan (ResNet-50 b1440 on the
#: V100 preset, meta trace, roofline times, at 14-15 GiB: 150 GB moved per 3.1 s of compute),
#: shared replays hold more in the backward and predict 0.57x in-core against 0.62x.
GPU_THROUGH_EXPOSURES = (0.2,)
#: With no window named, plans are also made with this many times nnabla's default window,
#: for the ``WIDE_TRIES`` fastest (exposure, through) pairs at the default window only: the
#: window shifts them alike (ResNet-50 b1440 on the V100: the same top four at both windows;
#: on the H200 profiles the wide window won once in six, with the fastest pair, before replays
#: were shared). A wider window only lets swap-ins start earlier, so it is tried only where
#: the best plan's compute stream waits at all: shared, with swaps priced on the link's
#: queue, the wide window gave the same prediction as the default in all 15 profile plans
#: (3 profiles, 1/8 to 3/4 of the peak), and 6 of them wait for nothing.
WIDE_WINDOW = 2
WIDE_TRIES = 1
RECOMPUTE_MODES = ("auto", "prefer", "never")
SHARED = "shared"


def default_hardware(seq: VariableSequence) -> Hardware:
    """The hardware a plan is priced on when the caller names none: the CPU preset for a
    sequence recorded on a CPU; for a GPU profile (``benchmarks/gpu_profiles.py``: its
    ``meta`` holds the pinned link it measured, ``link_bytes_per_s``), the H100 PCIe preset
    with that link (its op times are the GPU's own); else the seed paper's V100."""
    device = str(seq.meta.get("device", ""))
    if device.startswith("cpu"):
        return hardware("cpu-edge")
    link = seq.meta.get("link_bytes_per_s")
    if isinstance(link, dict) and all(isinstance(link.get(k), (int, float)) and link[k] > 0
                                      for k in ("h2d", "d2h")):
        return hardware("h100-80gb-pcie5", h2d_bandwidth=float(link["h2d"]), d2h_bandwidth=float(link["d2h"]))
    return hardware("v100-16gb-nvlink")


def chain_seconds(seq: VariableSequence, chain: Chain, hw: Hardware) -> float:
    """Seconds the chain takes on the compute stream (what ``simulate`` charges)."""
    return sum(hw.function_s(seq.functions[k].cost) for k in chain.functions)


def swap_or_recompute(seq: VariableSequence, hw: Hardware, exposure: float, through: bool = False,
                      shared: bool = False) -> Recompute:
    """The rule: ``rule(v, at)`` is the chain to recompute ``v`` with before function ``at``
    when that costs less than swapping it (priced as the module says), else None. ``through``:
    the rule takes ``absent`` too and prices the chain through inputs discarded then
    (``chain_through``). ``shared``: the planner moves the recomputes of a chain's discarded
    inputs before it (``scheduler.segments``; asked without ``absent``, the rule prices the
    chain's own functions) and passes ``stall_s``, the wait a swap-out would cause on the
    link's queue (``link``, ``scheduler.link_clock``), which the swap's price includes."""

    def rule(v: int, at: int, absent: Callable[[int], bool] | None = None, stall_s: float = 0.0) -> Chain | None:
        chain = chain_for(seq, v, at)
        if chain is not None and absent is not None:
            chain = chain_through(seq, chain, absent)
        if chain is None:
            return None
        nb = seq.variables[v].nbytes
        swap_s = (exposure * (hw.transfer_s(nb, to_device=False) + hw.transfer_s(nb, to_device=True))
                  + 2 * nb * hw.moved_byte_s + stall_s)
        return chain if chain_seconds(seq, chain, hw) < swap_s else None

    rule.through = through   # type: ignore[attr-defined]
    rule.shared = shared     # type: ignore[attr-defined]
    rule.link = hw if shared else None   # type: ignore[attr-defined]
    return rule


def plan_swap_or_recompute(seq: VariableSequence, budget: int, window: int | None = None,
                           hw: Hardware | str | None = None, mode: str = "auto",
                           pins: Pins = Pins(), beside: Sequence[int] = ()) -> Schedule:
    """Policy "window" with recomputation: the swap-only plan, and one plan per exposure in
    ``EXPOSURES`` with the rule choosing swap or recompute per victim, each at ``window``
    (when it is None on a device whose link runs beside compute, the ``WIDE_TRIES`` fastest
    also at ``WIDE_WINDOW`` times the default window); the fastest on ``hw``
    (``simulate``) wins, ties to the swap-only plan at the default window. ``mode="prefer"``:
    every victim that has a chain is recomputed (if that plan does not fit, as ``"auto"``:
    recomputing every one can hold more chain inputs than the budget allows where recomputing
    some fits); ``"never"``: the swap-only plan. ``pins`` (``scheduler.pins``) apply to every
    plan tried (a swap-only plan follows only ``keep``). The plan returned is the winner or
    the same plan with its waits placed by time (``scheduler.release``), whichever ``simulate``
    predicts faster; with ``mode="never"`` or nothing to replay, that choice is made only when
    ``hw`` is given. ``beside``: per function, bytes held outside the plan (``scheduler.beside``)."""
    swap_only = plan_window(seq, budget, window, None, pins.swap_only(), beside=beside)
    if mode == "never" or not recompute_candidates(seq):
        if hw is None:
            return swap_only     # nothing may be replayed nor priced: the plan of old, byte for byte
        hw = hardware(hw)
        return _sooner(seq, swap_only, simulate(swap_only, hw, timeline=False).total_s, hw,
                       lambda release: plan_window(seq, budget, window, None, pins.swap_only(), release, beside))
    if mode == "prefer":
        try:
            candidate = plan_window(seq, budget, window, pinned_rule(seq, pins, lambda v, at: chain_for(seq, v, at)),
                                    pins, beside=beside)
            check(candidate)
            return candidate
        except (Infeasible, BudgetTooSmall) as err:   # the priced plans below recompute less
            log.info("recompute='prefer' does not fit; pricing swap against recompute instead: %s", err)
    hw = default_hardware(seq) if hw is None else hardware(hw)

    stall = [0.0]   # the last prediction's stall

    def predicted(candidate: Schedule | None) -> float:   # None: it did not fit
        if candidate is None:
            return INF
        try:
            r = simulate(candidate, hw, timeline=False)
            stall[0] = r.stall_s
            return r.total_s
        except ScheduleError as err:   # unchecked yet (``_safe``): a planner bug, never the winner
            log.warning("a window+recompute candidate is unsafe, ignored: %s", err)
            return INF

    overlapped = not hw.moved_byte_s   # the link runs beside compute: a GPU
    tried = []   # (predicted seconds, exposure, through), in the order tried
    best, best_s, best_how, best_stall = None, INF, (window, None, False), 0.0
    for exposure, through in candidate_grid(overlapped):
        baseline = exposure is None and not (pins.prefer or pins.must)
        candidate = swap_only if baseline else _candidate(seq, budget, window, pins, hw, exposure, through,
                                                                 beside=beside)
        t = predicted(candidate)
        log.debug("exposure %s, through %s -> %.6f s", exposure, through, t)
        tried.append((t, exposure, through))
        if t < best_s and (baseline or _safe(candidate)):
            best, best_s, best_how, best_stall = candidate, t, (window, exposure, through), stall[0]
    assert best is not None   # the baseline always fits: swap-only did
    if window is None and overlapped and best_stall > 0:   # the module docstring says why
        wide = WIDE_WINDOW * default_window(budget)
        for _, exposure, through in sorted(tried, key=lambda r: r[0])[:WIDE_TRIES]:
            candidate = _candidate(seq, budget, wide, pins, hw, exposure, through, beside=beside)
            t = predicted(candidate)
            log.debug("wide window, exposure %s, through %s -> %.6f s", exposure, through, t)
            if t < best_s and _safe(candidate):
                best, best_s, best_how = candidate, t, (wide, exposure, through)
    if overlapped:   # waits placed by time won none of the six H200 profile plans (GPU_EXPOSURES)
        return best
    at_window, exposure, through = best_how
    return _sooner(seq, best, best_s, hw,
                   lambda release: _candidate(seq, budget, at_window, pins, hw, exposure, through, release, beside))


def candidate_grid(beside: bool) -> list[tuple[float | None, bool | str]]:
    """The (exposure, through) pairs ``plan_swap_or_recompute`` plans at, in the order it tries
    them: first the baseline (None: swap only), then, where the link runs beside compute (a
    GPU), shared replays at ``GPU_EXPOSURES`` and chains through at ``GPU_THROUGH_EXPOSURES``,
    else each of ``EXPOSURES`` with chains through and without."""
    grid = ([(e, SHARED) for e in GPU_EXPOSURES] + [(e, True) for e in GPU_THROUGH_EXPOSURES] if beside
            else [(e, t) for e in EXPOSURES for t in (False, True)])
    return [(None, False), *grid]


def _sooner(seq: VariableSequence, best: Schedule, best_s: float, hw: Hardware,
            make: Callable[[Release], Schedule | None]) -> Schedule:
    """``best``, or the same plan made with its waits for swap-outs placed by time
    (``scheduler.release``) where ``simulate`` predicts that faster."""
    early = make(timed_release(seq, hw))
    t = INF if early is None else simulate(early, hw, timeline=False).total_s
    log.debug("waits placed by time -> %.6f s (else %.6f s)", t, best_s)
    return early if t < best_s and _safe(early) else best


def _safe(candidate: Schedule | None) -> bool:
    """Whether ``scheduler.check`` proves the candidate safe. Asked only of a candidate that
    would win (``plan`` checks the one it returns again): checking each of a dozen plans cost
    a quarter of the planning time. A failure is a planner bug, and never costs the plan
    that is safe."""
    if candidate is None:
        return False
    try:
        check(candidate)
        return True
    except (Infeasible, BudgetTooSmall, ScheduleError) as err:
        log.warning("a window+recompute candidate is unsafe, ignored: %s", err)
        return False


def _candidate(seq: VariableSequence, budget: int, window: int, pins: Pins, hw: Hardware,
               exposure: float | None, through: bool, release: Release | None = None,
               beside: Sequence[int] = ()) -> Schedule | None:
    """One plan of the default planner, or None where it does not fit. ``exposure`` None: the
    baseline, which follows the user's recompute pins where they fit and is the swap-only
    plan otherwise."""
    if exposure is None:
        if pins.prefer or pins.must:   # the user's recompute pins bind every plan tried
            try:
                pinned = plan_window(seq, budget, window, pinned_rule(seq, pins), pins, release, beside)
                check(pinned)
                return pinned
            except (Infeasible, BudgetTooSmall) as err:
                log.info("the recompute pins do not fit this budget; swapping those tensors: %s", err)
        return plan_window(seq, budget, window, None, pins.swap_only(), release, beside)
    try:   # checked only if it wins (``_safe``)
        return plan_window(seq, budget, window,
                           pinned_rule(seq, pins, swap_or_recompute(seq, hw, exposure, bool(through),
                                                             through == SHARED)), pins,
                           release, beside)
    except (Infeasible, BudgetTooSmall) as err:   # recomputing here does not fit: swap-only does
        log.debug("window+recompute at exposure %.2f does not fit, ignored: %s", exposure, err)
    except ScheduleError as err:   # a planner bug: never let it cost the swap-only plan
        log.warning("window+recompute at exposure %.2f is unsafe, ignored: %s", exposure, err)
    return None
