"""Read a CSV of ``time, action, address, bytes`` rows into a
:class:`~ooc.frag.trace_data.Trace`: the simplest input, for traces made by other tools.

Apart from the other readers: each format has its own parsing and its own errors.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from vmm.replay import Event

from ooc.frag.trace_data import FragInputError, Trace

__all__ = ["load_csv"]

_COLUMNS = {"time": ("time", "time_s", "t"), "action": ("action", "op"),
            "address": ("address", "addr", "key"), "bytes": ("bytes", "size", "nbytes")}


def load_csv(path: str | os.PathLike[str]) -> Trace:
    """Read a CSV of ``time, action, address, bytes`` rows (header first; action is ``alloc`` or
    ``free``; address is any key, ``0x`` hex or decimal; bytes may be empty on a free)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except UnicodeDecodeError:
        raise FragInputError(f"{path}: not a snapshot, an ooc JSON file or a text CSV "
                             f"(binary data that is not a pickle)") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise FragInputError(f"{path}: empty file") from None
    except csv.Error as exc:
        raise FragInputError(f"{path}: line 1: not CSV ({exc})") from None
    names = [h.strip().lower() for h in header]
    col: dict[str, int] = {}
    for want, aliases in _COLUMNS.items():
        for a in aliases:
            if a in names:
                col[want] = names.index(a)
                break
        else:
            raise FragInputError(
                f"{path}: line 1: the header must name the columns time, action, address, bytes "
                f"(got {', '.join(repr(h) for h in header[:6]) or 'nothing'})")
    width = max(col.values()) + 1
    events: list[Event] = []
    live: dict[Any, int] = {}
    try:
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < width:
                raise FragInputError(f"{path}: row {line}: expected {width} columns, got {len(row)}")
            action = row[col["action"]].strip().lower()
            key = _key(row[col["address"]].strip())
            if key == "":
                raise FragInputError(f"{path}: row {line}: empty address")
            t_s = row[col["time"]].strip()
            try:
                time = float(t_s) if t_s else 0.0
            except ValueError:
                raise FragInputError(f"{path}: row {line}: time {t_s!r} is not a number") from None
            b_s = row[col["bytes"]].strip()
            nbytes = None
            if b_s:
                try:
                    nbytes = int(b_s)
                except ValueError:
                    raise FragInputError(f"{path}: row {line}: bytes {b_s!r} is not an integer") from None
            if action == "alloc":
                if nbytes is None or nbytes <= 0:
                    raise FragInputError(f"{path}: row {line}: alloc needs a positive byte count, "
                                         f"got {b_s!r}")
                if key in live:
                    raise FragInputError(f"{path}: row {line}: alloc of address {row[col['address']].strip()}"
                                         f", which is already allocated")
                live[key] = nbytes
                events.append(Event("alloc", key, nbytes, time))
            elif action in ("free", "free_completed"):
                if key not in live:
                    raise FragInputError(f"{path}: row {line}: free of address {row[col['address']].strip()}"
                                         f", which is not allocated")
                size = live.pop(key)
                if nbytes not in (None, 0, size):
                    raise FragInputError(f"{path}: row {line}: free of {nbytes} bytes at "
                                         f"{row[col['address']].strip()}, which was allocated with {size}")
                events.append(Event("free", key, size, time))
            else:
                raise FragInputError(f"{path}: row {line}: action {row[col['action']].strip()!r} is "
                                     f"not 'alloc' or 'free'")
    except csv.Error as exc:
        raise FragInputError(f"{path}: row {reader.line_num}: not CSV ({exc})") from None
    if not events:
        raise FragInputError(f"{path}: no alloc or free rows after the header")
    return Trace(name=os.path.basename(path), kind="csv", events=events)


def _key(s: str) -> int | str:
    try:
        return int(s, 0)
    except ValueError:
        return s
