"""Byte sizes at the edges: the one parser and the one printer.

Inside the code sizes are ints in bytes. Humans write "16GiB" or "512 MB"; both units
families are accepted and kept distinct (1 GB = 10**9 bytes, 1 GiB = 2**30 bytes), because
mixing them silently is a 7% error on a 16 GB card.
"""

from __future__ import annotations

import re

from vmm.errors import OOCError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeError(OOCError, ValueError):
    """A size string or number that is not a positive byte count."""


def parse_size(value: int | float | str, *, what: str = "size") -> int:
    """Return ``value`` as a positive int of bytes.

    Accepts ints, floats and strings such as ``"16GiB"``, ``"512 MB"``, ``"1.5g"``,
    ``"4096"``. Zero, negatives, NaN and words raise :class:`SizeError` naming ``what``.
    """
    if isinstance(value, bool):
        raise SizeError(f"{what}: expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value <= 0 or value == float("inf"):
            raise SizeError(f"{what} must be a positive number of bytes, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise SizeError(f"{what}: expected a byte size like '16GiB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeError(
            f"{what}: {value!r} is not a size; write e.g. '512MiB', '16GiB', '2GB' or a byte count"
        )
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number < 1:
        raise SizeError(f"{what} must be at least 1 byte, got {value!r}")
    return int(number)


def format_size(nbytes: int | float) -> str:
    """Print a byte count in binary units with three significant digits ("1.50 GiB")."""
    sign = "-" if nbytes < 0 else ""
    n = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            # three significant digits, but never an exponent ("1010 MiB", not "1.01e+03")
            return f"{sign}{n:.0f} {unit}" if n >= 100 else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
