"""A schedule: for every function, the transfers before it and after it.

Semantics (what ``check`` proves and the runtime executes), per variable:

- ``swap_in v`` (before f_i): device memory for v is taken now and a copy from the slower
  tier starts. v is *in flight in* until ``wait_in v``; only then may a function use it.
- ``wait_in v`` (before f_i): block until that copy is done; v is resident.
- ``swap_out v`` (after f_i): a copy of v to the slower tier starts. v's device memory stays
  taken, and v may not be used, until ``wait_out v``; then the memory is given back.
- ``wait_out v`` (before f_i, or after f_i): block until that copy is done; memory is freed.
- ``drop v`` (after f_i): discard the device copy of v without a transfer, because the
  slower tier already holds the same bytes (v was swapped in and only read since).
- ``free v`` (after f_i): v is dead (never used again); its memory is given back.
- ``discard v`` (after f_i): v's memory is given back with no copy anywhere; v will be
  recomputed before its next use.
- ``recompute v`` (before f_i): rerun the action's ``chain`` (function indices, in order;
  ``scheduler.replay``) on resident inputs; v is resident again. The chain's temporaries
  hold memory while it runs.

Device memory counts every resident variable, every transfer in flight in either direction,
and the variables a function creates (first write) while it runs. A schedule is safe when
that never exceeds ``budget`` (less ``beside[i]`` around function i, where the plan is bounded by
the device's whole peak: ``scheduler.beside``), every use finds its variable resident, and the
step ends in the state it started in (``initial_resident`` for live-out variables, nothing in
flight).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import AbstractSet, Any

from scheduler.actions import Ledger, Op, replay
from scheduler.errors import SequenceFormatError
from scheduler.ir import VariableSequence
from scheduler.json_files import field_of, read_json, write_json

SCHEMA = "ooc.schedule"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Action:
    """``op`` on variable ``var``; a ``recompute`` also names the functions to rerun, in
    order (``chain``), so the runtime executes exactly what ``check`` proved."""

    op: Op
    var: int
    chain: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """A plan for one step, carrying its sequence so a plan file stands alone. ``beside``:
    per function, bytes the device holds outside the plan there (empty: none counted, the
    budget is the plan's own, flat)."""

    sequence: VariableSequence
    budget: int
    policy: str
    window: int
    before: tuple[tuple[Action, ...], ...]
    after: tuple[tuple[Action, ...], ...]
    initial_resident: frozenset[int]
    beside: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.sequence.functions)
        if len(self.before) != n or len(self.after) != n:
            raise SequenceFormatError(
                f"schedule has {len(self.before)}/{len(self.after)} action lists for {n} functions")
        for lists in (self.before, self.after):
            for i, acts in enumerate(lists):
                for a in acts:
                    if a.var not in self.sequence.variables:
                        raise SequenceFormatError(f"actions of function {i}: unknown variable {a.var}")
        if self.beside and len(self.beside) != n:
            raise SequenceFormatError(f"schedule has {len(self.beside)} bytes beside it for {n} functions")

    def limit(self, i: int) -> int:
        """The most the plan may hold before, during and after function ``i``."""
        return self.budget - self.beside[i] if self.beside else self.budget

    def _moved(self, op: Op) -> int:
        nb = self.sequence.variables
        return sum(nb[a.var].nbytes for acts in (*self.before, *self.after) for a in acts if a.op is op)

    @cached_property
    def bytes_in(self) -> int:
        """Bytes copied from the slower tier to the device in one step."""
        return self._moved(Op.SWAP_IN)

    @cached_property
    def bytes_out(self) -> int:
        """Bytes copied from the device to the slower tier in one step."""
        return self._moved(Op.SWAP_OUT)

    @cached_property
    def bytes_recomputed(self) -> int:
        """Bytes re-created by ``recompute`` actions in one step."""
        return self._moved(Op.RECOMPUTE)

    @cached_property
    def peak_resident_bytes(self) -> int:
        """Peak device bytes the schedule needs (replayed through ``scheduler.actions``,
        as ``check`` replays it; a schedule the table refuses raises ``Refused``)."""
        return replay(self).peak

    @cached_property
    def bounded_peak_bytes(self) -> int:
        """The most the plan and what the step holds beside it take at one point ``check``
        bounds (after an action that takes bytes, with a recompute's temporaries; while a
        function runs): at most ``budget``; the plan's own peak where nothing beside it is
        counted."""
        if not self.beside:
            return self.peak_resident_bytes
        ledger = Ledger(self.sequence, self.initial_resident)
        most = ledger.device + self.beside[0]
        for i, held in enumerate(self.beside):
            for phase, acts in (("before", self.before[i]), ("after", self.after[i])):
                for a in acts:
                    eff = ledger.apply(a.op, a.var, i, phase, a.chain)
                    if eff.device > 0:
                        most = max(most, ledger.device + held
                                   + (ledger.chain.temporaries_bytes if eff.needs_chain else 0))
                if phase == "before":
                    ledger.run(i)
                    most = max(most, ledger.device + held)
        return most

    @cached_property
    def in_step_order(self) -> tuple[tuple[int, Action], ...]:
        """Every action with the gap it runs at, in step order: gap ``g`` is before function
        ``g`` and after function ``g - 1`` (``scheduler.anchors``: an anchored plan has all its
        actions before functions, but the last's after). What a hook-driven step runs, made
        once per plan, not once per step."""
        return tuple((g + k, a) for g in range(len(self.sequence.functions))
                     for k, actions in ((0, self.before[g]), (1, self.after[g])) for a in actions)

    @cached_property
    def recomputes(self) -> dict[int, tuple[tuple[int, tuple[int, ...]], ...]]:
        """var -> (function, chain) of each of its ``recompute`` actions, in step order: a variable
        pinned "must_recompute" is re-created more than once a step, each time with the writers
        it had by then (before its ``relu_``, the producer alone; before the backward, all)."""
        out: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for i, actions in enumerate(self.before):
            for a in actions:
                if a.op is Op.RECOMPUTE:
                    out.setdefault(a.var, []).append((i, a.chain))
        return {var: tuple(each) for var, each in out.items()}

    @cached_property
    def discarded(self) -> frozenset[int]:
        """The variables some ``discard`` action drops."""
        return frozenset(a.var for _, a in self.in_step_order if a.op is Op.DISCARD)

    @cached_property
    def leaving(self) -> frozenset[int]:
        """The variables whose bytes leave the device at some point of the step before their
        death: swapped out or discarded."""
        return frozenset(a.var for _, a in self.in_step_order if a.op in (Op.SWAP_OUT, Op.DISCARD))

    def summary(self) -> dict[str, Any]:
        """The fields ``ooc plan --json`` prints: plain data, stable keys."""
        return {
            "policy": self.policy,
            "budget": self.budget,
            "window": self.window,
            "functions": len(self.sequence.functions),
            "variables": len(self.sequence.variables),
            "in_core_peak_bytes": self.sequence.in_core_peak_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
            "bounded_peak_bytes": self.bounded_peak_bytes,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "bytes_recomputed": self.bytes_recomputed,
        }

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        enc = lambda lists: [[[a.op.value, a.var, list(a.chain)] if a.chain else [a.op.value, a.var]  # noqa: E731
                              for a in acts] for acts in lists]
        return {
            "schema": SCHEMA, "version": VERSION, "policy": self.policy, "budget": self.budget,
            "window": self.window, "initial_resident": sorted(self.initial_resident),
            "before": enc(self.before), "after": enc(self.after),
            "sequence": self.sequence.to_dict(), **({"beside": list(self.beside)} if self.beside else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "schedule") -> "Schedule":
        seq = VariableSequence.from_dict(field_of(data, "sequence", dict, where), where=f"{where}: sequence")

        def dec(key: str) -> tuple[tuple[Action, ...], ...]:
            out = []
            for i, acts in enumerate(field_of(data, key, list, where)):
                if not isinstance(acts, list):
                    raise SequenceFormatError(f"{where}: {key}[{i}]: expected a list of actions")
                row = []
                for j, a in enumerate(acts):
                    if (not isinstance(a, list) or len(a) not in (2, 3) or a[0] not in Op._value2member_map_
                            or not isinstance(a[1], int) or isinstance(a[1], bool)
                            or (len(a) == 3 and not (isinstance(a[2], list) and all(
                                isinstance(k, int) and not isinstance(k, bool) for k in a[2])))):
                        raise SequenceFormatError(
                            f"{where}: {key}[{i}][{j}]: expected [op, variable id] or [op, variable id, "
                            f"[function, ...]] with op one of {[o.value for o in Op]}, got {a!r}")
                    row.append(Action(Op(a[0]), a[1], tuple(a[2]) if len(a) == 3 else ()))
                out.append(tuple(row))
            return tuple(out)

        initial = field_of(data, "initial_resident", list, where)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in initial):
            raise SequenceFormatError(f"{where}: initial_resident must be a list of variable ids")
        beside = data.get("beside", [])
        if not isinstance(beside, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                   for b in beside):
            raise SequenceFormatError(f"{where}: beside must be a list of byte counts, one per function")
        return cls(
            sequence=seq, budget=field_of(data, "budget", int, where),
            policy=field_of(data, "policy", str, where), window=field_of(data, "window", int, where),
            before=dec("before"), after=dec("after"), initial_resident=frozenset(initial),
            beside=tuple(beside))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> "Schedule":
        return cls.from_dict(read_json(path, SCHEMA, VERSION), where=os.fspath(path))


def quiet_functions(schedule: Schedule, made: AbstractSet[int] = frozenset()) -> frozenset[int]:
    """The functions a planned per-op step may run with no bookkeeping of its own: no action
    before or after them, no variable of the plan used or made (``made``: the functions the
    runtime binds a variable at), in no recompute chain. On the GPU profiles 60-79% of a
    step's ops (ResNet-50 b256, GPT-2, the Llama at 1/2 and 1/4): each skips the per-op
    path's residency checks, rollback copies, bindings and actions, and is only recorded
    (``ooc/runtime/step_recording.py``)."""
    chained = {w for actions in schedule.before for a in actions for w in a.chain}
    before, after = schedule.before, schedule.after
    return frozenset(i for i, f in enumerate(schedule.sequence.functions)
                     if not (f.uses or before[i] or after[i] or i in chained or i in made))
