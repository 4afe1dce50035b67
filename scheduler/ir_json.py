"""The variable sequence's file format (``ooc.sequence``, JSON): written whole, read with one
clear error per flaw.

A sequence file comes from elsewhere (``ooc trace -o``, a committed GPU profile, a user's own
converter), so nothing in it is trusted: every field is checked for type and range, and each
flaw is a ``SequenceFormatError`` saying which file, which variable or function, and which
field, never a ``KeyError`` or a plan built on a wrong number. ``schedule.py``'s plan files use
the same readers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from scheduler.errors import SequenceFormatError
from scheduler.ir import (FLAGS, SCHEMA, VERSION, Access, Cost, Function, Kind, Use, Variable,
                          VariableSequence)


def sequence_to_dict(seq: VariableSequence) -> dict[str, Any]:
    """``seq`` as the JSON object of its file (``VariableSequence.to_dict``)."""
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "meta": seq.meta,
        "variables": [
            {"id": v.id, "nbytes": v.nbytes, "kind": v.kind.value, "name": v.name,
             "live_in": v.live_in, "live_out": v.live_out,
             **({"held_to": v.held_to} if v.held_to is not None else {})}
            for v in seq.variables.values()
        ],
        "functions": [
            {"name": f.name,
             "uses": [[u.var, "w" if u.access is Access.WRITE else "r"] for u in f.uses],
             "flops": f.cost.flops, "bytes": f.cost.bytes, "seconds": f.cost.seconds,
             **{k: True for k in FLAGS if getattr(f, k)},
             **({"needs": list(f.needs)} if f.needs else {})}
            for f in seq.functions
        ],
    }


def load_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file's value, with one clear error for a missing, unreadable or broken file."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise SequenceFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SequenceFormatError(f"{path}: is a directory, not a trace or plan file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SequenceFormatError(f"{path}: not a JSON file ({exc})") from None
    except OSError as exc:
        raise SequenceFormatError(f"{path}: cannot read ({exc.strerror})") from None


def read_json(path: str | os.PathLike[str], schema: str, version: int = VERSION) -> dict[str, Any]:
    """Load a JSON file of ours (``schema``, ``version``), with one clear error for a missing,
    broken or foreign file."""
    data = load_json(path)
    if not isinstance(data, dict) or data.get("schema") != schema:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise SequenceFormatError(f"{path}: not an {schema} file (schema is {found!r})")
    if data.get("version") != version:
        raise SequenceFormatError(
            f"{path}: {schema} version {data.get('version')!r} is not supported (this ooc reads {version})")
    return data


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` whole or not at all (a temporary file renamed over ``path``)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, separators=(",", ":"))
    os.replace(tmp, path)


def field_of(obj: Any, key: str, types: type | tuple[type, ...], where: str) -> Any:
    """``obj[key]`` checked for type, or a SequenceFormatError that says where."""
    if not isinstance(obj, dict):
        raise SequenceFormatError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise SequenceFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SequenceFormatError(f"{where}.{key}: expected {_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise SequenceFormatError(f"{where}.{key}: expected {_names(types)}, got {type(value).__name__}")
    return value


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def sequence_from_dict(data: Any, where: str) -> VariableSequence:
    """The sequence a file's JSON object holds, or a SequenceFormatError naming the flaw and
    where it is (``where``: the file, or the object holding it)."""
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
        for k in FLAGS:   # absent (every file written before recomputation): False
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
            cost=Cost(flops=_count(raw, "flops", w), bytes=int(_count(raw, "bytes", w)),
                      seconds=None if seconds is None else float(seconds)), **flags, needs=tuple(needs)))
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return VariableSequence(tuple(functions), variables, dict(meta) if isinstance(meta, dict) else {})


def _held_to(raw: dict[str, Any], where: str) -> int | None:
    """A variable's optional ``held_to``: a function index, or absent (every file before it)."""
    value = raw.get("held_to")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SequenceFormatError(f"{where}.held_to: expected a function index or null, got {value!r:.40}")
    return value


def _count(raw: dict[str, Any], key: str, where: str) -> float:
    """An optional non-negative finite number (FLOPs, bytes); missing or null is 0."""
    value = raw.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise SequenceFormatError(f"{where}.{key}: expected a non-negative number or null, "
                                  f"got {value!r:.40}")
    return float(value)
