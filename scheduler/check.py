"""Replay a schedule and prove it safe, or say exactly where and why it is not.

``check(schedule)`` walks the step once, function by function, keeping the state of every
variable (the residency model of ``scheduler.schedule``), and raises
:class:`~scheduler.errors.ScheduleError` at the first violation. Every planner calls it
before returning, so a schedule that leaves ``plan()`` is safe by construction.

The residency model
-------------------

The states and the meaning of every action are ``scheduler.actions``' transition table,
which ``simulate``, the planners and the runtime read too; this module adds the rules of a
whole step (the budget, and the end of the step looking like its start).
Every variable is in one of six states:

==============  =====================================================  ==================
state           meaning                                                device bytes?
==============  =====================================================  ==================
absent          not created yet                                        no
dead            freed                                                  no
resident        on the device, usable                                  yes
host            only in the slower tier                                no
in-flight-in    ``swap_in`` issued, not yet ``wait_in``-ed; unusable    yes
in-flight-out   ``swap_out`` issued, not yet ``wait_out``-ed; unusable  yes
==============  =====================================================  ==================

- At the start, a ``live_in`` variable is *resident* if it is in
  ``schedule.initial_resident`` and *host* otherwise; every other variable is *absent*.
  ``initial_resident`` may only name ``live_in`` variables.
- Every use by function ``f_i`` needs the variable *resident*, except its creating write
  (the first use of a variable that is not ``live_in``), which takes it from *absent* to
  *resident*; its bytes count while ``f_i`` runs.
- ``before[i]`` runs in order, then ``f_i``, then ``after[i]``. Any action may appear in
  either list (planners put swap-ins and waits before a function, swap-outs, drops and frees
  after it; restoring the start state at the end of the step needs swap-ins after the last
  function).
- ``swap_in`` needs *host*; ``wait_in`` needs *in-flight-in*; ``swap_out`` needs *resident*;
  ``wait_out`` needs *in-flight-out* (it ends in *host*); ``drop`` needs *resident* and a
  current host copy (the variable came in by ``swap_in`` and nothing wrote it since);
  ``free`` needs *resident* or *host* (forgetting a host-only copy is allowed), the variable
  must not be ``live_out`` and nothing may use it later.
- A write makes the host copy stale: a later ``drop`` is illegal until a ``swap_out``
  completes and a ``swap_in`` brings it back.
- Device bytes (resident + both kinds of in flight, + creations while a function runs) are
  checked after every action that can raise them and while every function runs; they must
  never exceed ``schedule.budget``, less ``schedule.beside[i]`` around function i where the
  plan is bounded by the device's whole peak (``scheduler.beside``).

At the end of the step nothing may be in flight; a ``live_in`` + ``live_out`` variable
must be *resident* if it is in ``initial_resident`` and *host* otherwise (the next step
starts where this one began); a ``live_out`` variable created during the step may end
*resident* or *host* (``CheckResult.final_resident`` says which); every variable that is
not ``live_out`` must end *absent* (freed after its last use). The one exception to the
last rule keeps it simple: a ``live_in`` variable that is neither used nor ``live_out``
may stay where it started.

Cost: one pass, O(actions + uses); ~100k functions check in about a second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scheduler.actions import ABSENT, DEAD, DISCARDED, HOST, IN, OUT, RESIDENT, Ledger, Names
from scheduler.errors import ScheduleError
from scheduler.schedule import Schedule
from vmm.units import format_size

__all__ = ["CheckResult", "check"]

log = logging.getLogger(__name__)


def _size(nbytes: int) -> str:
    """``"17.2 GiB (18468359372 B)"``; small sizes once (``"40 B"``)."""
    text = format_size(nbytes)
    return text if text.endswith(" B") and not text.endswith("iB") else f"{text} ({nbytes} B)"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What replaying a safe schedule measured.

    ``resident_bytes[i]`` is the device bytes while function ``i`` runs (creations
    included); ``peak_bytes`` is the maximum over every point of the step (start, after
    each action, during each function). ``transfers`` counts swap-ins plus swap-outs.
    ``final_resident`` is the set of ``live_out`` variables resident at the end.
    """

    peak_bytes: int
    resident_bytes: tuple[int, ...]
    bytes_in: int
    bytes_out: int
    transfers: int
    final_resident: frozenset[int]


def check(schedule: Schedule) -> CheckResult:
    """Replay ``schedule`` and return its measurements; raise ``ScheduleError`` if unsafe.

    The error names the function (index and name), the variable (id, kind, name, size),
    the phase (before / during / after the function) and what to do about it; its
    ``function`` and ``variable`` attributes carry the indices for programs. An action or
    use refused by the transition table raises ``scheduler.actions.Refused`` (a
    ``ScheduleError``), the error ``simulate`` and the runtime raise for the same action.
    """
    seq = schedule.sequence
    budget, limit = schedule.budget, schedule.limit
    names = Names(seq)

    def over(cur: int, what: str, i: int | None, v: int | None) -> ScheduleError:
        held = schedule.beside[0 if i is None else i] if schedule.beside else 0
        bound = f"budget {_size(budget)}" + (f" less {_size(held)} held beside the plan there" if held else "")
        return ScheduleError(
            f"resident bytes {_size(cur)} exceed {bound} {what}: wait for "
            f"pending swap-outs or free memory earlier, or raise the budget", function=i, variable=v)

    ledger = Ledger(seq, schedule.initial_resident)
    if ledger.device > (limit(0) if seq.functions else budget):
        raise over(ledger.device, "at the start of the step (initial_resident)", None, None)
    nbytes = ledger.nbytes
    bytes_in = bytes_out = transfers = 0
    resident_bytes: list[int] = []
    apply = ledger.apply
    peak = ledger.peak

    def run(acts, phase: str, i: int) -> None:
        nonlocal bytes_in, bytes_out, transfers, peak
        budget = limit(i)
        for a in acts:
            ledger.peak = ledger.device   # from here, the most this action holds
            eff = apply(a.op, a.var, i, phase, a.chain)
            peak = max(peak, ledger.peak)
            if eff.in_flight > 0:      # a copy starts: count what it moves
                transfers += 1
                if eff.to is IN:
                    bytes_in += nbytes[a.var]
                else:
                    bytes_out += nbytes[a.var]
            if eff.device > 0 and ledger.peak > budget:
                # ledger.peak, not device: a recompute's temporaries count while its chain runs
                cur = max(ledger.device, ledger.peak)
                what = "during" if eff.needs_chain else "after"
                raise over(cur, f"{what} {a.op.value} of variable {a.var} {names.where(phase, i)}",
                           i, a.var)

    n = len(seq.functions)
    for i in range(n):
        if schedule.before[i]:
            run(schedule.before[i], "before", i)
        ledger.run(i)
        peak = max(peak, ledger.device)
        if ledger.device > limit(i):
            raise over(ledger.device, f"during {names.fn(i)} (with the variables it creates)", i, None)
        resident_bytes.append(ledger.device)
        if schedule.after[i]:
            run(schedule.after[i], "after", i)

    final_resident = _end_of_step(schedule, ledger, names)
    log.debug("check: %d functions, peak %d B of budget %d B, %d transfers",
              n, peak, budget, transfers)
    return CheckResult(
        peak_bytes=peak, resident_bytes=tuple(resident_bytes), bytes_in=bytes_in,
        bytes_out=bytes_out, transfers=transfers, final_resident=frozenset(final_resident))


def _end_of_step(schedule: Schedule, ledger: Ledger, names: Names) -> list[int]:
    """The end of the step must look like its start; returns the live_out variables resident."""
    seq = schedule.sequence
    n = len(seq.functions)
    last = n - 1 if n else None
    final_resident = []
    uses_of, last_use = seq.uses_of, seq.last_use
    for v, var in seq.variables.items():
        st = ledger.state[v]
        if st is IN or st is OUT:
            op = "wait_in" if st is IN else "wait_out"
            raise ScheduleError(
                f"{names.var(v)} is {st.value} at the end of the step: add {op} of variable {v} "
                f"after the last function", function=last, variable=v)
        if var.live_out:
            if st is ABSENT or st is DEAD or st is DISCARDED:
                raise ScheduleError(f"{names.var(v)} is live_out but {st.value} at the end of the step: "
                                    f"it must survive the step", function=last, variable=v)
            if var.live_in:
                want = RESIDENT if v in schedule.initial_resident else HOST
                if st is not want:
                    if want is RESIDENT:
                        hint = "it is in initial_resident: swap it back in (swap_in + wait_in) before the step ends"
                    else:
                        hint = ("it is not in initial_resident: swap_out + wait_out (or drop, if its host "
                                "copy is current) before the step ends")
                    raise ScheduleError(
                        f"{names.var(v)} ends the step {st.value} but started {want.value}: {hint}",
                        function=last, variable=v)
            if st is RESIDENT:
                final_resident.append(v)
        elif st is not ABSENT and st is not DEAD:
            if var.live_in and not uses_of[v]:
                continue  # never used, not live_out: may stay where it started
            lu = last_use.get(v)
            raise ScheduleError(
                f"{names.var(v)} is not live_out but ends the step {st.value}: "
                f"add free of variable {v} after {names.fn(lu) if lu is not None else 'its last use'}",
                function=lu, variable=v)
    return final_resident
