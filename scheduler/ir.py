"""The variable sequence: what one training step does to memory, in execution order.

This is the contract between the recorder (``ooc.trace`` or the runtime's first step) and
the planners. A step is a list of functions (aten ops, in order); each function uses
variables (storages: every view of a storage is the same variable) for reading or writing.

Lifetimes follow eager PyTorch:
- a variable with ``live_in`` exists before the first function (parameters, optimizer state,
  the input batch); any other variable comes into existence at its first use, which must be
  a write (the op that allocates it);
- a variable with ``live_out`` must still exist after the last function (parameters,
  optimizer state, gradients kept for accumulation); any other variable dies right after
  its last use.

What the program held longer is a fact apart (``Variable.held_to``, ``held_after_use_sized``):
a recorder saw the storage die later than its last use (a Python name kept it, as Adam's
``denom`` until the next parameter's is made; every gradient lives until ``zero_grad``). Only
what bounds the bytes beside the managed tensors reads it (``scheduler.whole_step``,
``scheduler.beside``): a plan decides when a managed variable's bytes go, not the rest's.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, Callable, Iterable

from scheduler.errors import SequenceFormatError
from scheduler.json_files import field_of, optional_count, read_json, write_json

SCHEMA = "ooc.sequence"
VERSION = 1
# Function flags about replaying an op, written to JSON only when true (older files lack them).
_FLAGS = ("replayable", "rng", "updates_stats")


class Kind(str, Enum):
    PARAM = "param"
    GRAD = "grad"
    ACTIVATION = "activation"
    OPTIMIZER_STATE = "optimizer_state"
    INPUT = "input"
    TEMPORARY = "temporary"


class Access(str, Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class Variable:
    id: int
    nbytes: int
    kind: Kind
    name: str = ""
    live_in: bool = False
    live_out: bool = False
    # The last function during which the program still held it past its last use, as the
    # recorder saw it die (None: not seen later than its last use).
    held_to: int | None = None


@dataclass(frozen=True, slots=True)
class Use:
    var: int
    access: Access


@dataclass(frozen=True, slots=True)
class Cost:
    """What a function costs: FLOPs and bytes for a roofline, or seconds when measured."""

    flops: float = 0.0
    bytes: int = 0
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Function:
    """One op of the step. The three flags are the recorder's, about replaying the op
    (recomputation, ``scheduler.replay``); absent, as in every older file, they say "never
    replay it", so plans of such sequences only keep or swap.

    ``replayable``: rerunning the op on the same inputs gives the same bytes and touches
    nothing outside its uses (no side effects; a random op only with its generator state
    captured, which ``rng`` says). ``rng``: the op draws random numbers; a replay restores
    the generator state recorded for it. ``updates_stats``: the op also updates running
    statistics the IR does not list (BatchNorm in training mode); a replay must not update
    them again (momentum 0, or restore the buffers).

    ``needs``: earlier functions whose results this one reads although the sequence has no
    variable for them (a temporary nobody saves, such as the scores a softmax reads, which
    the runtime does not manage). A replay must rerun those first: they are part of every
    chain this function is in (``scheduler.replay``).
    """

    index: int
    name: str
    uses: tuple[Use, ...]
    cost: Cost = Cost()
    replayable: bool = False
    rng: bool = False
    updates_stats: bool = False
    needs: tuple[int, ...] = ()

    @property
    def var_ids(self) -> tuple[int, ...]:
        """The distinct variables this function touches, in first-use order."""
        return tuple(dict.fromkeys(u.var for u in self.uses))


@dataclass(frozen=True)
class VariableSequence:
    """Functions in execution order plus the variable table, validated on construction."""

    functions: tuple[Function, ...]
    variables: dict[int, Variable]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    # -- derived facts the planners share -------------------------------------------------

    @cached_property
    def uses_of(self) -> dict[int, tuple[int, ...]]:
        """Variable id -> sorted indices of the functions that use it."""
        out: dict[int, list[int]] = {v: [] for v in self.variables}
        for f in self.functions:
            for v in f.var_ids:
                out[v].append(f.index)
        return {v: tuple(ix) for v, ix in out.items()}

    @cached_property
    def writers(self) -> dict[int, tuple[int, ...]]:
        """Variable id -> sorted indices of the functions that write it."""
        out: dict[int, list[int]] = {v: [] for v in self.variables}
        for f in self.functions:
            for v in dict.fromkeys(u.var for u in f.uses if u.access is Access.WRITE):
                out[v].append(f.index)
        return {v: tuple(ix) for v, ix in out.items()}

    @cached_property
    def producer(self) -> dict[int, int]:
        """Variable id -> the function that creates it (its first use, a write), for every
        variable that is not ``live_in`` and is used."""
        return {v: ix[0] for v, ix in self.uses_of.items()
                if ix and not self.variables[v].live_in}

    @cached_property
    def first_use(self) -> dict[int, int]:
        return {v: ix[0] for v, ix in self.uses_of.items() if ix}

    @cached_property
    def last_use(self) -> dict[int, int]:
        return {v: ix[-1] for v, ix in self.uses_of.items() if ix}

    def working_set_bytes(self, index: int) -> int:
        """Bytes that must be resident while function ``index`` runs."""
        return sum(self.variables[v].nbytes for v in self.functions[index].var_ids)

    @cached_property
    def live_bytes(self) -> tuple[int, ...]:
        """Live bytes during each function when nothing is swapped (eager PyTorch)."""
        return self.live_bytes_sized(lambda nbytes: nbytes)

    def live_bytes_sized(self, size: Callable[[int], int]) -> tuple[int, ...]:
        """``live_bytes`` with each variable taking ``size(nbytes)`` (an allocator's rounding)."""
        n = len(self.functions)
        delta = [0] * (n + 1)
        for v, var in self.variables.items():
            ix = self.uses_of[v]
            if not var.live_in and not ix:
                continue
            start = 0 if var.live_in else ix[0]
            end = n if var.live_out else (ix[-1] + 1 if ix else start)
            if end > start:
                delta[start] += size(var.nbytes)
                delta[end] -= size(var.nbytes)
        return tuple(itertools.accumulate(delta[:n]))

    def held_after_use_sized(self, size: Callable[[int], int],
                             counts: Callable[[Variable], bool] = lambda var: True) -> tuple[int, ...]:
        """Per function, the bytes of variables (those ``counts`` says) that the program still
        held after their last use there (``Variable.held_to``), each taking ``size(nbytes)``:
        what eager lifetimes leave out of ``live_bytes``."""
        n = len(self.functions)
        delta = [0] * (n + 1)
        for v, var in self.variables.items():
            last = self.last_use.get(v)
            if var.held_to is None or var.live_out or last is None or var.held_to <= last or not counts(var):
                continue
            delta[last + 1] += size(var.nbytes)
            delta[min(var.held_to, n - 1) + 1] -= size(var.nbytes)
        return tuple(itertools.accumulate(delta[:n]))

    @cached_property
    def in_core_peak_bytes(self) -> int:
        """Peak live bytes with nothing swapped and every variable freed after its last use."""
        live = self.live_bytes
        return max(live) if live else sum(v.nbytes for v in self.variables.values() if v.live_in)

    @property
    def total_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables.values())

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "meta": self.meta,
            "variables": [
                {"id": v.id, "nbytes": v.nbytes, "kind": v.kind.value, "name": v.name,
                 "live_in": v.live_in, "live_out": v.live_out,
                 **({"held_to": v.held_to} if v.held_to is not None else {})}
                for v in self.variables.values()
            ],
            "functions": [
                {"name": f.name,
                 "uses": [[u.var, "w" if u.access is Access.WRITE else "r"] for u in f.uses],
                 "flops": f.cost.flops, "bytes": f.cost.bytes, "seconds": f.cost.seconds,
                 **{k: True for k in _FLAGS if getattr(f, k)},
                 **({"needs": list(f.needs)} if f.needs else {})}
                for f in self.functions
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "sequence") -> "VariableSequence":
        return _sequence_from_dict(data, where)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> "VariableSequence":
        return cls.from_dict(read_json(path, SCHEMA, VERSION), where=os.fspath(path))


# -- validation and parsing (the checked readers: json_files.py) -------------------------


def _validate(seq: VariableSequence) -> None:
    for i, f in enumerate(seq.functions):
        if f.index != i:
            raise SequenceFormatError(f"functions[{i}]: index is {f.index}, expected {i}")
        for j, u in enumerate(f.uses):
            if u.var not in seq.variables:
                raise SequenceFormatError(
                    f"functions[{i}] ({f.name}).uses[{j}]: unknown variable {u.var}")
    for v, var in seq.variables.items():
        if var.id != v:
            raise SequenceFormatError(f"variables: key {v} holds variable id {var.id}")
        if var.nbytes < 0:
            raise SequenceFormatError(f"variables[{v}]: nbytes {var.nbytes} is negative")
    # A variable that does not exist at the start must be created by a write.
    seen: set[int] = set()
    for f in seq.functions:
        for u in f.uses:
            if u.var in seen:
                continue
            seen.add(u.var)
            var = seq.variables[u.var]
            if not var.live_in and u.access is not Access.WRITE:
                raise SequenceFormatError(
                    f"functions[{f.index}] ({f.name}): variable {u.var} ({var.name or var.kind.value})"
                    f" is read before anything writes it and is not live_in")


def _sequence_from_dict(data: Any, where: str) -> VariableSequence:
    variables: dict[int, Variable] = {}
    for k, raw in enumerate(field_of(data, "variables", list, where)):
        w = f"{where}: variables[{k}]"
        kind_s = field_of(raw, "kind", str, w)
        try:
            kind = Kind(kind_s)
        except ValueError:
            raise SequenceFormatError(
                f"{w}.kind: {kind_s!r} is not one of {[x.value for x in Kind]}") from None
        vid = field_of(raw, "id", int, w)
        if vid in variables:
            raise SequenceFormatError(f"{w}.id: duplicate variable id {vid}")
        variables[vid] = Variable(
            id=vid, nbytes=field_of(raw, "nbytes", int, w), kind=kind,
            name=str(raw.get("name", "")), live_in=bool(raw.get("live_in", False)),
            live_out=bool(raw.get("live_out", False)), held_to=_held_to(raw, w))
    functions: list[Function] = []
    for i, raw in enumerate(field_of(data, "functions", list, where)):
        w = f"{where}: functions[{i}]"
        uses = []
        for j, u in enumerate(field_of(raw, "uses", list, w)):
            if (not isinstance(u, list) or len(u) != 2 or not isinstance(u[0], int)
                    or isinstance(u[0], bool) or u[1] not in ("r", "w")):
                raise SequenceFormatError(f"{w}.uses[{j}]: expected [variable id, 'r' or 'w'], got {u!r}")
            uses.append(Use(u[0], Access.WRITE if u[1] == "w" else Access.READ))
        seconds = raw.get("seconds")
        if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)):
            raise SequenceFormatError(f"{w}.seconds: expected a number or null")
        flags = {}
        for k in _FLAGS:   # absent (every file written before recomputation): False
            value = raw.get(k, False)
            if not isinstance(value, bool):
                raise SequenceFormatError(f"{w}.{k}: expected true or false, got {value!r:.40}")
            flags[k] = value
        needs = raw.get("needs", [])
        if (not isinstance(needs, list)
                or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < i for k in needs)):
            raise SequenceFormatError(f"{w}.needs: expected a list of earlier function indices, got {needs!r:.60}")
        functions.append(Function(
            index=i, name=field_of(raw, "name", str, w), uses=tuple(uses),
            cost=Cost(flops=optional_count(raw, "flops", w), bytes=int(optional_count(raw, "bytes", w)),
                      seconds=None if seconds is None else float(seconds)), **flags, needs=tuple(needs)))
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return VariableSequence(tuple(functions), variables, dict(meta) if isinstance(meta, dict) else {})


def _held_to(raw: dict[str, Any], where: str) -> int | None:
    """A variable's optional ``held_to``: a function index, or absent (every file before it)."""
    value = raw.get("held_to")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SequenceFormatError(f"{where}.held_to: expected a function index or null, got {value!r:.40}")
    return value


def build_sequence(
    functions: Iterable[tuple[str, Iterable[tuple[int, str]], Cost]],
    variables: Iterable[Variable],
    meta: dict[str, Any] | None = None,
) -> VariableSequence:
    """Convenience constructor: ``functions`` as (name, [(var, 'r'|'w'), ...], cost), or
    (name, uses, cost, flags) with ``flags`` a dict of :class:`Function`'s replay flags."""
    fs = tuple(
        Function(i, name, tuple(Use(v, Access.WRITE if a in ("w", Access.WRITE) else Access.READ)
                                for v, a in uses), cost, **(rest[0] if rest else {}))
        for i, (name, uses, cost, *rest) in enumerate(functions))
    return VariableSequence(fs, {v.id: v for v in variables}, dict(meta or {}))
