"""Our JSON files (sequences, plans): written whole, read with one clear error per flaw.

A trace or plan file comes from elsewhere (``ooc trace -o``, a committed GPU profile, a
user's own converter), so nothing in it is trusted: a missing, unreadable, broken or foreign
file, a field of the wrong type or out of range, each is a ``SequenceFormatError`` that names
the file and the field, never a ``KeyError`` or a plan built on a wrong number. The readers
know nothing of what the files hold (``ir.py``, ``schedule.py`` build from them).
"""

from __future__ import annotations

import json
import os
from typing import Any

from scheduler.errors import SequenceFormatError


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


def read_json(path: str | os.PathLike[str], schema: str, version: int) -> dict[str, Any]:
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


def optional_count(raw: dict[str, Any], key: str, where: str) -> float:
    """An optional non-negative finite number (FLOPs, bytes); missing or null is 0."""
    value = raw.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise SequenceFormatError(f"{where}.{key}: expected a non-negative number or null, "
                                  f"got {value!r:.40}")
    return float(value)
