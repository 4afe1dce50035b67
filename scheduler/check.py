"""Replay a schedule and prove it safe, or say exactly where and why it is not.

``check(schedule)`` walks the step once, function by function, keeping the state of every
variable (the residency model of ``scheduler.schedule``), and raises
:class:`~scheduler.errors.ScheduleError` at the first violation. Every planner calls it
before returning, so a schedule that leaves ``plan()`` is safe by construction.

The residency model
-------------------

Every variable is in one of five states:

==============  =====================================================  ==================
state           meaning                                                device bytes?
==============  =====================================================  ==================
absent          not created yet, or freed                              no
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
  never exceed ``schedule.budget``.

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

from scheduler.errors import ScheduleError
from scheduler.ir import Access, VariableSequence
from scheduler.schedule import Op, Schedule
from vmm.units import format_size

__all__ = ["CheckResult", "check"]

log = logging.getLogger(__name__)

# Variable states (small ints: this loop is the hot path).
ABSENT, RESIDENT, HOST, IN_IN, IN_OUT = range(5)
_STATE_WORDS = {
    ABSENT: "absent (not created yet, or freed)",
    RESIDENT: "resident on the device",
    HOST: "in host memory (the slower tier)",
    IN_IN: "still being swapped in (no wait_in yet)",
    IN_OUT: "being swapped out (no wait_out yet)",
}


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
    ``function`` and ``variable`` attributes carry the indices for programs.
    """
    return _Replay(schedule).run()


class _Replay:
    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.seq: VariableSequence = schedule.sequence
        self.budget = schedule.budget

    # -- messages ------------------------------------------------------------------------

    def var(self, v: int) -> str:
        var = self.seq.variables[v]
        name = f" '{var.name}'" if var.name else ""
        return f"variable {v} ({var.kind.value}{name}, {format_size(var.nbytes)})"

    def fn(self, i: int) -> str:
        if i < 0:
            return "the start of the step"
        return f"function {i} ({self.seq.functions[i].name})"

    def where(self, phase: str, i: int) -> str:
        return f"{phase} {self.fn(i)}"

    def fail(self, msg: str, i: int | None, v: int | None) -> ScheduleError:
        return ScheduleError(msg, function=i, variable=v)

    def over(self, cur: int, what: str, i: int | None, v: int | None) -> ScheduleError:
        return self.fail(
            f"resident bytes {_size(cur)} exceed budget {_size(self.budget)} {what}: wait for "
            f"pending swap-outs or free memory earlier, or raise the budget", i, v)

    # -- the replay ----------------------------------------------------------------------

    def run(self) -> CheckResult:
        seq, s = self.seq, self.s
        variables = seq.variables
        nbytes = {v: var.nbytes for v, var in variables.items()}
        budget = self.budget
        n = len(seq.functions)
        last_use = seq.last_use

        state: dict[int, int] = {}
        clean: dict[int, bool] = {}        # resident and the host copy holds the same bytes
        last_write: dict[int, int] = {}    # for messages about stale host copies
        freed_after: dict[int, str] = {}   # for messages about use after free
        for v, var in variables.items():
            state[v] = HOST if var.live_in else ABSENT
        cur = 0
        for v in sorted(s.initial_resident):
            if v not in variables:
                raise self.fail(f"initial_resident names unknown variable {v}", None, v)
            if not variables[v].live_in:
                raise self.fail(
                    f"initial_resident names {self.var(v)}, which is not live_in: only variables "
                    f"that exist before the step can start resident", None, v)
            state[v] = RESIDENT
            clean[v] = False   # no host copy is assumed for what starts on the device
            cur += nbytes[v]
        if cur > budget:
            raise self.over(cur, "at the start of the step (initial_resident)", None, None)
        peak = cur

        bytes_in = bytes_out = transfers = 0
        resident_bytes: list[int] = []
        before, after = s.before, s.after

        def apply(acts, phase: str, i: int) -> None:
            nonlocal cur, peak, bytes_in, bytes_out, transfers
            for a in acts:
                v, op = a.var, a.op
                st = state[v]
                if op is Op.SWAP_IN:
                    if st != HOST:
                        raise self.fail(
                            f"swap_in of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}, "
                            f"not in host memory", i, v)
                    state[v] = IN_IN
                    cur += nbytes[v]
                    bytes_in += nbytes[v]
                    transfers += 1
                    if cur > budget:
                        raise self.over(cur, f"after swap_in of variable {v} {self.where(phase, i)}", i, v)
                    if cur > peak:
                        peak = cur
                elif op is Op.WAIT_IN:
                    if st != IN_IN:
                        raise self.fail(
                            f"wait_in of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}, "
                            f"there is no swap_in to wait for", i, v)
                    state[v] = RESIDENT
                    clean[v] = True
                elif op is Op.SWAP_OUT:
                    if st != RESIDENT:
                        raise self.fail(
                            f"swap_out of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}, "
                            f"not resident", i, v)
                    state[v] = IN_OUT
                    bytes_out += nbytes[v]
                    transfers += 1
                elif op is Op.WAIT_OUT:
                    if st != IN_OUT:
                        raise self.fail(
                            f"wait_out of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}, "
                            f"there is no swap_out to wait for", i, v)
                    state[v] = HOST
                    cur -= nbytes[v]
                elif op is Op.DROP:
                    if st != RESIDENT:
                        raise self.fail(
                            f"drop of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}, "
                            f"not resident", i, v)
                    if not clean.get(v, False):
                        if v in last_write:
                            why = (f"function {last_write[v]} ({seq.functions[last_write[v]].name}) "
                                   f"wrote it after its host copy was made, so the host copy is stale")
                        else:
                            why = "it has no host copy (it started resident or was created on the device)"
                        raise self.fail(
                            f"drop of {self.var(v)} {self.where(phase, i)} would lose data: {why}; "
                            f"use swap_out + wait_out instead", i, v)
                    state[v] = HOST
                    cur -= nbytes[v]
                elif op is Op.FREE:
                    if st not in (RESIDENT, HOST):
                        raise self.fail(
                            f"free of {self.var(v)} {self.where(phase, i)}: it is {_STATE_WORDS[st]}; "
                            f"only a resident or host-only variable can be freed", i, v)
                    if variables[v].live_out:
                        raise self.fail(
                            f"free of {self.var(v)} {self.where(phase, i)}: it is live_out and must "
                            f"survive the step", i, v)
                    lu = last_use.get(v, -1)
                    if lu > i or (lu == i and phase == "before"):
                        raise self.fail(
                            f"free of {self.var(v)} {self.where(phase, i)}: {self.fn(lu)} uses it "
                            f"later; free it after its last use", i, v)
                    if st == RESIDENT:
                        cur -= nbytes[v]
                    state[v] = ABSENT
                    freed_after[v] = self.where(phase, i)
                else:  # pragma: no cover - Op is closed
                    raise self.fail(f"unknown action {op!r}", i, v)

        for i in range(n):
            apply(before[i], "before", i)
            # -- during f_i: every use resident; a creating write allocates now.
            f = seq.functions[i]
            for u in f.uses:
                v = u.var
                st = state[v]
                if st == RESIDENT:
                    pass
                elif st == ABSENT and not variables[v].live_in and v not in freed_after:
                    # Creating write (the IR guarantees the first use is a write).
                    state[v] = RESIDENT
                    clean[v] = False
                    cur += nbytes[v]
                else:
                    verb = "writes" if u.access is Access.WRITE else "reads"
                    if st == HOST:
                        hint = f"add swap_in + wait_in of variable {v} before it"
                    elif st == IN_IN:
                        hint = f"add wait_in of variable {v} before it"
                    elif st == IN_OUT:
                        hint = "its swap_out has not been undone; wait_out, then swap_in + wait_in before it"
                    else:
                        hint = f"it was freed {freed_after.get(v, 'earlier')}"
                    raise self.fail(
                        f"{self.fn(i)} {verb} {self.var(v)} while it runs, but the variable is "
                        f"{_STATE_WORDS[st]}: {hint}", i, v)
                if u.access is Access.WRITE:
                    clean[v] = False
                    last_write[v] = i
            if cur > budget:
                raise self.over(cur, f"during {self.fn(i)} (with the variables it creates)", i, None)
            if cur > peak:
                peak = cur
            resident_bytes.append(cur)
            apply(after[i], "after", i)

        # -- the end of the step must look like its start.
        final_resident = []
        uses_of = seq.uses_of
        for v, var in variables.items():
            st = state[v]
            if st in (IN_IN, IN_OUT):
                op = "wait_in" if st == IN_IN else "wait_out"
                raise self.fail(
                    f"{self.var(v)} is {_STATE_WORDS[st]} at the end of the step: add {op} of variable {v} "
                    f"after the last function", n - 1 if n else None, v)
            if var.live_out:
                if st == ABSENT:  # pragma: no cover - free of live_out is rejected above
                    raise self.fail(f"{self.var(v)} is live_out but absent at the end", None, v)
                if var.live_in:
                    want = RESIDENT if v in s.initial_resident else HOST
                    if st != want:
                        if want == RESIDENT:
                            hint = "it is in initial_resident: swap it back in (swap_in + wait_in) before the step ends"
                        else:
                            hint = ("it is not in initial_resident: swap_out + wait_out (or drop, if its host "
                                    "copy is current) before the step ends")
                        raise self.fail(
                            f"{self.var(v)} ends the step {_STATE_WORDS[st]} but started "
                            f"{_STATE_WORDS[want]}: {hint}", n - 1 if n else None, v)
                if st == RESIDENT:
                    final_resident.append(v)
            elif st != ABSENT:
                if var.live_in and not uses_of[v]:
                    continue  # never used, not live_out: may stay where it started
                lu = last_use.get(v)
                raise self.fail(
                    f"{self.var(v)} is not live_out but ends the step {_STATE_WORDS[st]}: "
                    f"add free of variable {v} after {self.fn(lu) if lu is not None else 'its last use'}",
                    lu, v)

        log.debug("check: %d functions, peak %d B of budget %d B, %d transfers",
                  n, peak, budget, transfers)
        return CheckResult(
            peak_bytes=peak, resident_bytes=tuple(resident_bytes), bytes_in=bytes_in,
            bytes_out=bytes_out, transfers=transfers, final_resident=frozenset(final_resident))
