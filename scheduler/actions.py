"""What each memory action means: one transition table, read by every layer that moves bytes.

A schedule (``scheduler.schedule``) is a list of actions around each function. This module
says, once, what every action *requires* and what it *does*, so that ``check`` (the proof),
``simulate`` (the cost model), the planners and the runtime's executor cannot disagree:

==========  =====================  ==============  ======  =========  ======================
action      from                   to              device  in flight  slower tier
==========  =====================  ==============  ======  =========  ======================
swap_in     host                   in flight in    +bytes  +bytes     read (stays current)
wait_in     in flight in           resident          0     -bytes     current (same bytes)
swap_out    resident               in flight out     0     +bytes     being written
wait_out    in flight out          host            -bytes  -bytes     current
drop        resident, tier current host            -bytes    0        current (required)
free        resident               dead            -bytes    0        forgotten
free        host                   dead              0       0        forgotten
free        discarded              dead              0       0        forgotten
discard     resident               discarded       -bytes    0        forgotten
recompute   discarded              resident        +bytes    0        stale
==========  =====================  ==============  ======  =========  ======================

Why memory moves where it does: a swap-in takes its device bytes when it is *issued* (the
copy needs a destination), a swap-out gives them back only when it is *waited for* (until
then the copy still reads them). ``drop`` needs the slower tier to hold the current bytes,
or data would be lost; ``free`` needs the variable to be dead (never used again, not
``live_out``). A function's uses need *resident*; its creating write (first use of a
variable that is not ``live_in``) takes it from *absent* to *resident*, and any write
makes the slower tier's copy stale.

Recomputation (``scheduler.replay``) is two rows: ``discard`` gives a variable's bytes back
with no copy anywhere (after its last use before a gap), ``recompute`` re-creates it before
its next use by rerunning the action's ``chain`` (function indices, in order). Its
precondition is the chain's: the one ``scheduler.replay.chain_for`` finds for that variable
and that use (or that chain through its inputs discarded then, ``chain_through``, or through
those and inputs back by then that it makes again), every input of the chain resident. Its
effect: the variable's bytes are taken, and while the chain runs its temporaries too (the
peak counts them); the compute stream spends the chain's seconds (``simulate``).

A new action is one more row of ``TRANSITIONS`` and one more entry of ``NEEDS``; every
consumer picks it up. The :class:`Ledger` applies actions to
per-variable states and running byte totals and raises :class:`Refused`, naming the
action, the variable and the function, when a precondition fails.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from scheduler.errors import ScheduleError
from scheduler.ir import Access
from scheduler.replay import chain_for, chain_through
from vmm.units import format_size

if TYPE_CHECKING:
    from scheduler.ir import VariableSequence

__all__ = ["Effect", "Ledger", "NEEDS", "Op", "Refused", "Residency", "TRANSITIONS", "refusal", "replay"]


class Op(str, Enum):
    """The memory actions a schedule may put before or after a function."""

    SWAP_IN = "swap_in"
    WAIT_IN = "wait_in"
    SWAP_OUT = "swap_out"
    WAIT_OUT = "wait_out"
    DROP = "drop"
    FREE = "free"
    DISCARD = "discard"
    RECOMPUTE = "recompute"


class Residency(Enum):
    """Where a variable's bytes are. Device bytes are held in IN, RESIDENT and OUT."""

    ABSENT = "absent (not created yet)"
    HOST = "in host memory (the slower tier)"
    IN = "still being swapped in (no wait_in yet)"
    RESIDENT = "resident on the device"
    OUT = "being swapped out (no wait_out yet)"
    DEAD = "absent (freed)"
    DISCARDED = "absent (discarded, to be recomputed)"

    # Identity, in C (members are singletons, compared by identity): Enum's own hash is a
    # Python method, and the runtime looks states up a few thousand times a step (an anchored
    # Llama step on an H200: 9,288 calls of it, 5 ms under cProfile). A str enum (Op) hashes
    # in C already.
    __hash__ = object.__hash__


ABSENT, HOST, IN, RESIDENT, OUT, DEAD = (Residency.ABSENT, Residency.HOST, Residency.IN,
                                         Residency.RESIDENT, Residency.OUT, Residency.DEAD)
DISCARDED = Residency.DISCARDED


@dataclass(frozen=True, slots=True)
class Effect:
    """One row of the table: what an action does to a variable in a given state.

    ``device`` and ``in_flight`` are -1, 0 or +1 times the variable's bytes. ``tier``: the
    slower tier holds the current bytes afterwards (True), no longer does (False), or as
    before (None). ``needs_tier_current``: refused unless it holds them now (no data lost).
    ``needs_dead``: refused unless nothing uses the variable later and it is not live_out.
    ``needs_chain``: refused unless the action's chain re-creates the variable for its next
    use (``scheduler.replay.chain_for``) and the chain's inputs are resident.
    """

    to: Residency
    device: int
    in_flight: int
    tier: bool | None
    needs_tier_current: bool = False
    needs_dead: bool = False
    needs_chain: bool = False


TRANSITIONS: dict[tuple[Op, Residency], Effect] = {
    # swap-in: the destination is taken now; the copy is unusable until waited for.
    (Op.SWAP_IN, HOST): Effect(IN, device=+1, in_flight=+1, tier=None),
    # wait_in: the copy landed; device and slower tier hold the same bytes.
    (Op.WAIT_IN, IN): Effect(RESIDENT, device=0, in_flight=-1, tier=True),
    # swap_out: the copy reads the device bytes, which stay taken (and unusable) until wait_out.
    (Op.SWAP_OUT, RESIDENT): Effect(OUT, device=0, in_flight=+1, tier=None),
    # wait_out: the copy is safely out; only now are the device bytes given back.
    (Op.WAIT_OUT, OUT): Effect(HOST, device=-1, in_flight=-1, tier=True),
    # drop: skip a redundant transfer, the slower tier already holds these bytes.
    (Op.DROP, RESIDENT): Effect(HOST, device=-1, in_flight=0, tier=True, needs_tier_current=True),
    # free: a dead variable gives back whatever it holds, on the device and in the tier.
    (Op.FREE, RESIDENT): Effect(DEAD, device=-1, in_flight=0, tier=False, needs_dead=True),
    (Op.FREE, HOST): Effect(DEAD, device=0, in_flight=0, tier=False, needs_dead=True),
    (Op.FREE, DISCARDED): Effect(DEAD, device=0, in_flight=0, tier=False, needs_dead=True),
    # discard: give the bytes back with no copy; only a recompute brings the variable back.
    (Op.DISCARD, RESIDENT): Effect(DISCARDED, device=-1, in_flight=0, tier=False),
    # recompute: rerun the chain on resident inputs; its bytes (and, while the chain runs,
    # its temporaries) are taken now, on the compute stream.
    (Op.RECOMPUTE, DISCARDED): Effect(RESIDENT, device=+1, in_flight=0, tier=False, needs_chain=True),
}

# Why an action is refused in any state the table has no row for (the precondition, in words).
NEEDS: dict[Op, str] = {
    Op.SWAP_IN: "not in host memory",
    Op.WAIT_IN: "there is no swap_in to wait for (no swap_in issued, or it was waited for already)",
    Op.SWAP_OUT: "not resident",
    Op.WAIT_OUT: "there is no swap_out to wait for (no swap_out issued, or it was waited for already)",
    Op.DROP: "not resident",
    Op.FREE: "only a resident or host-only variable can be freed (or a discarded one)",
    Op.DISCARD: "not resident",
    Op.RECOMPUTE: "only a discarded variable is recomputed",
}

USE = "use"   # what a Refused error names when a function's use, not an action, is refused


def refusal(op: Op, state: Residency, tier_current: bool) -> str | None:
    """The state part of ``op``'s precondition: None if it holds, else why not (in words).

    ``needs_dead`` is a property of the sequence, not of the state: the :class:`Ledger`
    checks it, and the runtime relies on ``check`` having proven it before the plan runs.
    """
    eff = TRANSITIONS.get((op, state))
    if eff is None:
        return f"it is {state.value}, {NEEDS[op]}"
    if eff.needs_tier_current and not tier_current:
        return "the slower tier does not hold its current bytes"
    return None


class Refused(ScheduleError):
    """An action, or a function's use, whose precondition does not hold.

    ``action`` is the :class:`Op` (or ``"use"``), ``variable`` and ``function`` the indices,
    ``phase`` ``"before"``, ``"during"`` or ``"after"`` the function, ``state`` the
    variable's :class:`Residency` at that point, ``reason`` what failed, in words. Two consumers refusing the same schedule
    raise errors with equal ``verdict``.
    """

    def __init__(self, message: str, *, action: Op | str, variable: int, function: int | None,
                 phase: str, state: Residency, reason: str = "") -> None:
        super().__init__(message, function=function, variable=variable)
        self.action = action
        self.reason = reason   # the precondition that failed, in words
        self.phase = phase
        self.state = state

    @property
    def verdict(self) -> tuple[str, int, int | None, str]:
        act = self.action.value if isinstance(self.action, Op) else self.action
        return act, self.variable, self.function, self.phase


class Names:
    """How errors name variables and functions of ``seq`` (one wording for every consumer)."""

    def __init__(self, seq: "VariableSequence") -> None:
        self.seq = seq

    def var(self, v: int) -> str:
        var = self.seq.variables[v]
        name = f" '{var.name}'" if var.name else ""
        return f"variable {v} ({var.kind.value}{name}, {format_size(var.nbytes)})"

    def fn(self, i: int | None) -> str:
        if i is None or i < 0:
            return "the start of the step"
        return f"function {i} ({self.seq.functions[i].name})"

    def where(self, phase: str, i: int) -> str:
        return f"{phase} {self.fn(i)}"

    def refused(self, op: Op, v: int, i: int, phase: str, state: Residency, why: str) -> Refused:
        return Refused(f"{op.value} of {self.var(v)} {self.where(phase, i)}: {why}",
                       action=op, variable=v, function=i, phase=phase, state=state, reason=why)


class Ledger:
    """Per-variable residency and the step's running byte totals, changed only by the table.

    ``state[v]`` is a :class:`Residency`; ``tier_current[v]`` whether the slower tier holds
    v's current bytes; ``device`` the bytes held on the device (resident, both kinds of in
    flight, and what the running function creates), ``in_flight`` the bytes being copied;
    ``peak`` the most ``device`` has been, first reached at ``peak_function`` (None: at
    the start). ``apply`` runs one action, ``run`` one function's uses.
    """

    def __init__(self, seq: "VariableSequence", initial_resident) -> None:
        self.seq = seq
        self.names = Names(seq)
        variables = seq.variables
        self.nbytes = {v: var.nbytes for v, var in variables.items()}
        self.live_out = {v for v, var in variables.items() if var.live_out}
        self.last_use = seq.last_use
        self.state: dict[int, Residency] = {v: HOST if var.live_in else ABSENT for v, var in variables.items()}
        # A live_in variable in the slower tier has its bytes there; one starting on the
        # device has no copy assumed.
        self.tier_current: dict[int, bool] = {v: var.live_in for v, var in variables.items()}
        self.last_write: dict[int, int] = {}    # for messages about stale host copies
        self.freed_at: dict[int, str] = {}       # for messages about use after free
        self.device = self.in_flight = 0
        self.recomputed = 0                      # bytes re-created by recompute actions
        self.chain = None                        # the last recompute's Chain (scheduler.replay)
        for v in sorted(initial_resident):
            if v not in variables:
                raise ScheduleError(f"initial_resident names unknown variable {v}", variable=v)
            if not variables[v].live_in:
                raise ScheduleError(
                    f"initial_resident names {self.names.var(v)}, which is not live_in: only "
                    f"variables that exist before the step can start resident", variable=v)
            self.state[v] = RESIDENT
            self.tier_current[v] = False
            self.device += self.nbytes[v]
        self.peak = self.device
        self.peak_function: int | None = None

    def apply(self, op: Op, v: int, i: int, phase: str, chain: tuple[int, ...] = ()) -> Effect:
        """Run action ``op`` on variable ``v`` ``phase`` (before/after) function ``i``;
        ``chain`` is a recompute's functions to rerun (the action's ``chain``)."""
        st = self.state[v]
        eff = TRANSITIONS.get((op, st))
        if eff is None or (eff.needs_tier_current and not self.tier_current[v]):
            raise self._refuse(op, v, i, phase, st)
        if eff.needs_dead:
            self._require_dead(op, v, i, phase, st)
            self.freed_at[v] = self.names.where(phase, i)
        if eff.needs_chain:
            # While the chain runs, its temporaries hold device bytes beside v's.
            transient = self.device + self.nbytes[v] + self._require_chain(op, v, i, phase, st, chain)
            if transient > self.peak:
                self.peak, self.peak_function = transient, i
            self.recomputed += self.nbytes[v]
        self.state[v] = eff.to
        if eff.tier is not None:
            self.tier_current[v] = eff.tier
        nb = self.nbytes[v]
        if eff.in_flight:
            self.in_flight += eff.in_flight * nb
        if eff.device:
            self.device += eff.device * nb
            if self.device > self.peak:
                self.peak, self.peak_function = self.device, i
        return eff

    def run(self, i: int) -> list[int]:
        """Function ``i`` runs: every use needs its variable resident; a creating write
        takes an absent variable to resident (its bytes count from now). Returns the
        variables it created."""
        state, created = self.state, []
        for u in self.seq.functions[i].uses:
            v = u.var
            st = state[v]
            if st is RESIDENT:
                pass
            elif st is ABSENT:   # the IR guarantees a first use is a write: a creation
                state[v] = RESIDENT
                self.tier_current[v] = False
                self.device += self.nbytes[v]
                created.append(v)
            else:
                raise self._refuse_use(u.access, v, i, st)
            if u.access is Access.WRITE:
                self.tier_current[v] = False
                self.last_write[v] = i
        if self.device > self.peak:
            self.peak, self.peak_function = self.device, i
        return created

    def replay(self, before, after) -> "Ledger":
        """Run a whole step: ``before[i]``, function ``i``, ``after[i]`` for every ``i``."""
        apply = self.apply
        for i in range(len(self.seq.functions)):
            for a in before[i]:
                apply(a.op, a.var, i, "before", a.chain)
            self.run(i)
            for a in after[i]:
                apply(a.op, a.var, i, "after", a.chain)
        return self

    # -- why not -------------------------------------------------------------------------

    def _refuse(self, op: Op, v: int, i: int, phase: str, st: Residency) -> Refused:
        n = self.names
        if TRANSITIONS.get((op, st)) is None:
            sep = "; " if op in (Op.FREE, Op.RECOMPUTE) else ", "
            return n.refused(op, v, i, phase, st, f"it is {st.value}{sep}{NEEDS[op]}")
        lw = self.last_write.get(v)
        if lw is not None:
            why = (f"function {lw} ({self.seq.functions[lw].name}) wrote it after its host copy "
                   f"was made, so the host copy is stale")
        else:
            why = "it has no host copy (it started resident or was created on the device)"
        return Refused(f"{op.value} of {n.var(v)} {n.where(phase, i)} would lose data: {why}; "
                       f"use swap_out + wait_out instead",
                       action=op, variable=v, function=i, phase=phase, state=st, reason=why)

    def _require_dead(self, op: Op, v: int, i: int, phase: str, st: Residency) -> None:
        n = self.names
        if v in self.live_out:
            raise n.refused(op, v, i, phase, st, "it is live_out and must survive the step")
        lu = self.last_use.get(v, -1)
        if lu > i or (lu == i and phase == "before"):
            raise n.refused(op, v, i, phase, st, f"{n.fn(lu)} uses it later; free it after its last use")

    def _require_chain(self, op: Op, v: int, i: int, phase: str, st: Residency,
                       chain: tuple[int, ...]) -> int:
        """A recompute's precondition: ``chain`` re-creates v for its next use and its inputs
        are resident. Returns the chain's temporaries' peak bytes."""
        n = self.names
        uses = self.seq.uses_of[v]
        k = (bisect_left if phase == "before" else bisect_right)(uses, i)
        if k == len(uses):
            raise n.refused(op, v, i, phase, st, "nothing uses it later; there is nothing to recompute it for")
        found = chain_for(self.seq, v, uses[k])
        if found is None:
            raise n.refused(op, v, i, phase, st,
                            f"no replayable chain re-creates it for {n.fn(uses[k])} "
                            f"(see scheduler.replay for the rules)")
        if tuple(chain) != found.functions:   # through inputs discarded now (chain_through)?
            through = chain_through(self.seq, found, lambda x: self.state[x] is DISCARDED)
            if through is None or tuple(chain) != through.functions:
                # and inputs it makes again, gone when the planner chose it, back by now (two
                # backward passes: retain_graph): a replay like any other, a temporary counted
                again, producer = set(chain), self.seq.producer
                through = chain_through(self.seq, found, lambda x: self.state[x] is DISCARDED
                                        or producer.get(x) in again)
            if through is None or tuple(chain) != through.functions:
                raise n.refused(op, v, i, phase, st,
                                f"the action's chain {list(chain)} is not the functions that wrote it, "
                                f"{list(found.functions)}")
            found = through
        for x in found.inputs:
            if self.state[x] is not RESIDENT:
                raise n.refused(op, v, i, phase, st,
                                f"the chain's input {n.var(x)} is {self.state[x].value}; it must be resident")
        self.chain = found
        return found.temporaries_bytes

    def _refuse_use(self, access: Access, v: int, i: int, st: Residency) -> Refused:
        if st is DISCARDED:
            hint = f"add recompute of variable {v} before it"
        elif st is HOST:
            hint = f"add swap_in + wait_in of variable {v} before it"
        elif st is IN:
            hint = f"add wait_in of variable {v} before it"
        elif st is OUT:
            hint = "its swap_out has not been undone; wait_out, then swap_in + wait_in before it"
        else:
            hint = f"it was freed {self.freed_at.get(v, 'earlier')}"
        verb = "writes" if access is Access.WRITE else "reads"
        n = self.names
        return Refused(f"{n.fn(i)} {verb} {n.var(v)} while it runs, but the variable is {st.value}: {hint}",
                       action=USE, variable=v, function=i, phase="during", state=st, reason=hint)


def replay(schedule) -> Ledger:
    """The ledger at the end of ``schedule``'s step (a ``scheduler.schedule.Schedule``), its
    ``peak`` the most device bytes at any point; raises :class:`Refused` at the first action
    or use the table refuses. The budget and the end-of-step rules are ``check``'s."""
    return Ledger(schedule.sequence, schedule.initial_resident).replay(schedule.before, schedule.after)
