"""Byte sizes at the edges: the one parser and the one printer.

Inside the code sizes are ints in bytes. Humans write "16GiB" or "512 MB"; both units
families are accepted and kept distinct (1 GB = 10**9 bytes, 1 GiB = 2**30 bytes), because
mixing them silently is a 7% error on a 16 GB card. A bare "G" is the decimal unit, like
"GB" (as in SI and as ``df -H`` prints it); "Gi" is short for "GiB". A number without a unit
is a byte count and must be whole: "1.5" is refused rather than read as 1 byte.
"""

from __future__ import annotations

import re
from fractions import Fraction

from vmm.errors import OOCError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
    "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

# What the units mean, in one sentence: for --help texts and error messages.
UNITS_HELP = ("K/M/G/T and KB/MB/GB/TB are powers of 1000 (16G = 16GB = 16*10^9 bytes); "
              "KiB/MiB/GiB/TiB (or Ki/Mi/Gi/Ti) are powers of 1024 (16GiB = 16*2^30 bytes); "
              "no unit: a whole number of bytes")


class SizeError(OOCError, ValueError):
    """A size string or number that is not a positive byte count.

    ``problem`` is the message without the name of what was parsed, for callers (the
    command line) that name it themselves.
    """

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(f"{what}: {problem}")


def parse_size(value: int | float | str, *, what: str = "size") -> int:
    """Return ``value`` as a positive int of bytes.

    Accepts ints, floats (rounded down to whole bytes) and strings such as ``"16GiB"``,
    ``"512 MB"``, ``"1.5g"``, ``"4096"``; units as in ``UNITS_HELP``. A string with a unit
    is rounded down to whole bytes ("0.3MiB" is 314572); one without a unit must be whole.
    Zero, negatives, NaN and words raise :class:`SizeError` naming ``what``.
    """
    if isinstance(value, bool):
        raise SizeError(what, f"expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value <= 0 or value == float("inf"):
            raise SizeError(what, f"must be a positive number of bytes, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise SizeError(what, f"expected a byte size like '16GiB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeError(what, f"{value!r} is not a size; write e.g. 512MiB, 16GiB (2^30 bytes), "
                              f"16GB (10^9 bytes) or a whole number of bytes")
    number, unit = Fraction(match.group(1)), _UNITS[match.group(2).lower()]
    if unit == 1 and number.denominator != 1:
        text = match.group(1)
        raise SizeError(what, f"{value!r} is a fraction of a byte; give a unit ({text}MiB = "
                              f"{text}*2^20 bytes, {text}GiB = {text}*2^30, {text}GB = "
                              f"{text}*10^9) or a whole number of bytes")
    nbytes = int(number * unit)  # exact: "1.1GB" is 1100000000, not 1100000000.0000002
    if nbytes < 1:
        raise SizeError(what, f"must be at least 1 byte, got {value!r}")
    return nbytes


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
