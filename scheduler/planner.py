"""``plan()``: turn a variable sequence and a device budget into a proven-safe Schedule.

>>> from scheduler import Cost, Kind, Variable, build_sequence, plan
>>> seq = build_sequence(
...     [("fwd", [(0, "r"), (1, "w")], Cost()), ("bwd", [(1, "r"), (0, "r"), (2, "w")], Cost()),
...      ("opt", [(2, "r"), (0, "w")], Cost())],
...     [Variable(0, 100, Kind.PARAM, "w", live_in=True, live_out=True),
...      Variable(1, 400, Kind.ACTIVATION, "a"), Variable(2, 100, Kind.GRAD, "g")])
>>> plan(seq, budget=1000).bytes_in          # everything fits: nothing moves
0
>>> plan(seq, budget=600, policy="window-paper").bytes_in > 0
True

Policies (``POLICIES``):

- ``"window"`` (default): the adaptive window scheduler, moving only what the budget forces
  out (Belady victims, drops instead of copies where the host copy is current), each victim
  swapped or recomputed, whichever costs less on ``hardware`` (option; a ``Hardware`` or a
  preset name, default ``scheduler.recompute.default_hardware``); option ``recompute``:
  ``"auto"`` (that rule), ``"prefer"`` (recompute every victim that has a chain),
  ``"never"`` (swap only); option ``pins``: ``{variable id: pin}``, the user's say per
  tensor (``"keep"``, ``"offload"``, ``"prefer_recompute"``, ``"must_recompute"``; see
  ``scheduler.pins``). Moves nothing when
  ``budget >= seq.in_core_peak_bytes``. See ``scheduler.window``, ``scheduler.recompute``.
- ``"milp"``: the reference, an exact MILP over keep / swap / recompute per tensor
  (``scheduler.milp``; needs scipy; graphs up to a few hundred functions). Options
  ``hardware``, ``time_limit`` (seconds for the solver).
- ``"window-paper"``: the same paper's algorithm as published (nnabla): swap out after every
  use that is the last inside the window. See ``scheduler.window``.
- ``"vdnn"``, ``"lms"``, ``"none"``, ``"on-demand"`` (NNTrainer's synchronous swap, no
  prefetch): baselines, see ``scheduler.baselines``.

Guarantees: the result is deterministic (same input, same schedule), and ``check`` has
replayed it (``plan`` raises instead of returning an unsafe schedule). When no schedule of
the policy fits, ``BudgetTooSmall`` names the function and reports ``minimum``, a budget at
which the same call succeeds. Cost: linear in uses for the window planners (plus a
window-bounded prefetch search); policy "window" with recomputation plans, checks and
simulates up to 13 candidates (``scheduler.recompute``; the last is the winner again with its
waits placed by time, ``scheduler.release``): 0.3 s for ResNet-50 at batch 1440 (1,379
functions; 0.4 s with that last one, on a slower host), 10.6 s for a 192-layer GPT-2 (54,035
functions; results/plan.md, before the last one).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

from scheduler.baselines import (LMS_SWAPIN_AHEAD, LMS_SWAPOUT_THRESHOLD, plan_lms, plan_none,
                                 plan_on_demand, plan_vdnn)
from scheduler.beside import limits
from scheduler.check import check
from scheduler.errors import BudgetTooSmall
from scheduler.ir import VariableSequence
from scheduler.pins import Pins
from scheduler.schedule import Schedule
from scheduler.recompute import RECOMPUTE_MODES, plan_swap_or_recompute
from scheduler.window import Infeasible, plan_window_paper

__all__ = ["plan", "POLICIES"]

log = logging.getLogger(__name__)

POLICIES = ("window", "window-paper", "vdnn", "lms", "none", "on-demand", "milp")

_OPTIONS: dict[str, dict[str, Any]] = {
    "window": {"hardware": None, "recompute": "auto", "pins": None, "beside": ()},
    "milp": {"hardware": None, "time_limit": 60.0},
    "window-paper": {},
    "vdnn": {"backward_start": None},
    "lms": {"swapout_threshold": LMS_SWAPOUT_THRESHOLD, "swapin_ahead": LMS_SWAPIN_AHEAD},
    "none": {},
    "on-demand": {},
}


def plan(
    seq: VariableSequence,
    budget: int | None,
    window: int | None = None,
    policy: str = "window",
    **options: Any,
) -> Schedule:
    """Plan one training step of ``seq`` within ``budget`` device bytes.

    Args:
        seq: the step's variable sequence (``ooc.trace`` or a JSON file).
        budget: device bytes, a positive int (parse "16GiB" with ``parse_size`` first).
            Only ``policy="none"`` accepts ``None``: the budget is then the in-core peak.
        window: prefetch window in bytes for the window policies (default 1.5 x budget,
            nnabla's default; policy "window" with recomputation, given none on hardware whose
            link runs beside compute (a GPU), also tries twice that and keeps the plan
            ``simulate`` predicts faster, see ``scheduler.recompute``); other policies ignore
            it and record 0.
        policy: one of ``POLICIES``.
        **options: ``vdnn``: ``backward_start`` (function index); ``lms``:
            ``swapout_threshold`` (functions, >= 1), ``swapin_ahead`` (functions, >= 0).

    Raises:
        BudgetTooSmall: no schedule of this policy fits; ``minimum`` is a budget that does.
        ValueError / TypeError: bad policy, budget, window or option.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if not isinstance(seq, VariableSequence):
        raise TypeError(f"seq must be a VariableSequence, got {type(seq).__name__}")
    if budget is None and policy != "none":
        raise ValueError(f"policy {policy!r} needs a budget (only 'none' plans without one)")
    if budget is not None:
        _positive_int(budget, "budget")
    if window is not None:
        _positive_int(window, "window")
    unknown = set(options) - set(_OPTIONS[policy])
    if unknown:
        accepted = ", ".join(_OPTIONS[policy]) or "none"
        raise TypeError(f"policy {policy!r} does not take option(s) {', '.join(sorted(unknown))} "
                        f"(it accepts: {accepted})")
    opts = {**_OPTIONS[policy], **options}
    if policy == "lms":
        _positive_int(opts["swapout_threshold"], "swapout_threshold")
        if not isinstance(opts["swapin_ahead"], int) or isinstance(opts["swapin_ahead"], bool) \
                or opts["swapin_ahead"] < 0:
            raise ValueError(f"swapin_ahead must be an int >= 0, got {opts['swapin_ahead']!r}")
    if policy == "vdnn" and opts["backward_start"] is not None:
        bs = opts["backward_start"]
        if not isinstance(bs, int) or isinstance(bs, bool) or not 0 <= bs <= len(seq.functions):
            raise ValueError(f"backward_start must be a function index in 0..{len(seq.functions)}, got {bs!r}")
    if window is not None and policy not in ("window", "window-paper", "milp"):
        log.info("policy %r ignores window=%d", policy, window)

    # Planning allocates millions of small, acyclic objects (actions, heap entries); the
    # cyclic garbage collector would rescan them all again and again for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(seq, budget, window, policy, opts)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(seq: VariableSequence, budget: int | None, window: int | None, policy: str,
          opts: dict[str, Any]) -> Schedule:
    t0 = time.perf_counter()
    if policy == "window":
        hw, mode, pins = opts["hardware"], opts["recompute"], Pins.of(seq, opts["pins"])
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
        beside = tuple(opts["beside"] or ())
        limits(budget, beside, len(seq.functions))   # one count per function, or ValueError
        schedule = _with_minimum(seq, budget, lambda b: plan_swap_or_recompute(seq, b, window, hw, mode, pins, beside),
                                 max(beside, default=0))
    elif policy == "milp":
        from scheduler.milp import plan_milp   # scipy, imported only for this policy

        schedule = plan_milp(seq, budget, window, **opts)
    elif policy == "window-paper":
        schedule = _with_minimum(seq, budget, lambda b: plan_window_paper(seq, b, window))
    elif policy == "vdnn":
        schedule = plan_vdnn(seq, budget, **opts)
    elif policy == "lms":
        schedule = plan_lms(seq, budget, **opts)
    elif policy == "on-demand":
        schedule = plan_on_demand(seq, budget)
    else:
        if budget is not None and seq.in_core_peak_bytes > budget:
            live = seq.live_bytes
            i = next((k for k, b in enumerate(live) if b > budget), 0)
            raise BudgetTooSmall(
                function=i, name=seq.functions[i].name if seq.functions else "<no functions>",
                working_set=live[i] if live else seq.in_core_peak_bytes, budget=budget,
                minimum=seq.in_core_peak_bytes)
        schedule = plan_none(seq, budget)
    t1 = time.perf_counter()
    result = check(schedule)  # never hand out a schedule that is not proven safe
    log.info("plan %s: %d functions, budget %d B, peak %d B, %d B in, %d B out "
             "(planned in %.3f s, checked in %.3f s)", policy, len(seq.functions), schedule.budget,
             result.peak_bytes, result.bytes_in, result.bytes_out, t1 - t0, time.perf_counter() - t1)
    return schedule


def _positive_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int number of bytes, got {type(value).__name__} {value!r} "
                        f"(parse strings such as '16GiB' with scheduler.parse_size)")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")


def _with_minimum(seq: VariableSequence, budget: int, planner: Callable[[int], Schedule], beside: int = 0) -> Schedule:
    """Run ``planner(budget)``; if it cannot place some function, report a true minimum.

    The window planners only fail below the largest working set (``BudgetTooSmall`` comes
    straight from them). Should one ever fail above it, the minimum is found by bisection
    on the budget, so the message never names a budget that does not work (``beside``: the
    most held beside the plan, which every budget tried has on top).
    """
    try:
        return planner(budget)
    except Infeasible as err:
        failed = err
    lo, hi = budget, max(budget + 1, sum(v.nbytes for v in seq.variables.values()) + beside)
    planner(hi)  # everything fits at once: this cannot fail
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            check(planner(mid))
            hi = mid
        except (Infeasible, BudgetTooSmall):
            lo = mid
    log.warning("planner needs %d B, more than the largest working set, at function %d",
                hi, failed.index)
    i = failed.index
    raise BudgetTooSmall(function=i, name=seq.functions[i].name, working_set=failed.needed,
                         budget=budget, minimum=hi)
