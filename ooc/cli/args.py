"""What a command-line value must be, checked while the arguments are parsed.

Every flag that takes a value gets a ``type=`` from here, so a bad value (a size such as
"1.5", a negative length, an output file nobody can write, a swap directory that does not
exist) stops the command in the parser: one line on stderr, exit status 2, before any
tracing, planning or training starts. A check that runs after the work would cost the user
the work (a ten-minute demo that ends in "cannot write report.png").

A type raises ``argparse.ArgumentTypeError`` with the problem only; argparse prefixes the
flag ("argument --budget: ..."), and :class:`Parser` turns its errors into
:class:`UsageError`, which ``ooc.cli.main`` prints as that one line.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable, NoReturn

from vmm.units import UNITS_HELP, SizeError, parse_size

SIZE_HELP = f"sizes: {UNITS_HELP}"


class UsageError(Exception):
    """Bad command-line input found by the parser; ``prog`` is e.g. "ooc plan"."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, not a usage block and ``sys.exit``.

    Subparsers are made of the same class (argparse's default), so ``ooc plan --budget x``
    raises ``UsageError("ooc plan", ...)`` like ``ooc --bogus`` does.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message} (see '{self.prog} --help')")


# -- value types ----------------------------------------------------------------------------


def size(text: str) -> int:
    """A byte size ("512MiB", "16GB", "4096"): see ``vmm.units.UNITS_HELP``."""
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def size_or_zero(text: str) -> int:
    """A byte size as ``size``, or 0 ("0", "0B"): an allowance that may be nothing (a margin)."""
    if text.strip().rstrip("B").strip() == "0":
        return 0
    return size(text)


def positive_int(text: str) -> int:
    """A whole number >= 1 (batch sizes, lengths, widths, steps)."""
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    """A whole number >= 0 (a device index)."""
    return _int(text, 0)


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a divisor such as demo's --fraction)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def host_us(text: str) -> tuple[float, float]:
    """``OP[,QUIET]``: microseconds the host takes to queue an op the engine looks at, and a
    quiet one (``QUIET`` defaults to ``OP``); each a finite number >= 0."""
    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give OP or OP,QUIET in microseconds, e.g. 80,20") from None
    if len(values) > 2 or not all(0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give OP or OP,QUIET in microseconds, each >= 0, e.g. 80,20")
    return values[0], values[-1]


def choice(names: tuple[str, ...] | list[str], what: str) -> Callable[[str], str]:
    """One of ``names``; the error lists them (argparse's ``choices`` does too, but also
    prints every choice in the usage line, which is long for hardware presets)."""

    def check(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose one of {', '.join(names)}")
        return text

    check.__name__ = what  # argparse names the type in some messages
    return check


MANAGE_KINDS = ("activations", "params", "grads", "optimizer_state")   # scheduler.managed.MANAGE
MANAGE_HELP = ("plan only what OutOfCore would manage with this `manage` (comma-separated: "
               "activations, params, grads, optimizer_state), from 1 MiB up, activations in whole "
               "2 MiB chunks: a GPU profile or trace planned as the engine plans it")


def manage_kinds(text: str) -> tuple[str, ...]:
    """``--manage``: a comma-separated subset of OutOfCore's ``manage`` kinds."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in MANAGE_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose a comma-separated subset of {', '.join(MANAGE_KINDS)}")
    return kinds


def output_file(suffix: str | None = None) -> Callable[[str], str]:
    """A file this process can create or replace, in a directory that exists.

    Checked by creating (and removing) a scratch file beside it, the way the writers write
    (a temporary name, then a rename): ``os.access`` says yes to root on a read-only mount
    and on ``/sys``. ``suffix`` (".png"): matplotlib appends it to a name without one, so
    ``-o report`` would write ``report.png`` and say it wrote ``report``; such a name is
    refused instead.
    """

    def check(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("empty file name")
        path = os.path.abspath(text)
        if os.path.isdir(path):
            hint = f", e.g. {os.path.join(text, 'out' + (suffix or '.json'))}"
            raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name{hint}")
        if suffix and not text.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(f"{text}: the file name must end in {suffix}")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            what = "is not a directory" if os.path.exists(parent) else "does not exist"
            raise argparse.ArgumentTypeError(f"{text}: {parent} {what}")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text} is read-only; remove it or give another name")
        try:
            fd, scratch = tempfile.mkstemp(prefix=".ooc-write-check-", dir=parent)
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"{text}: cannot write in {parent} ({exc.strerror}); give a writable place") from None
        os.close(fd)
        os.unlink(scratch)
        return text

    check.__name__ = "output file"
    return check


def swap_directory(text: str) -> str:
    """An existing directory in which ooc may create its private swap directory.

    The same checks the engine makes (``ooc.storage.private_dir.check_parent``: no foreign
    symlink, no world-writable directory without the sticky bit), plus a real write, made here
    so that a demo stops before its in-core run rather than after it.
    """
    from ooc.errors import OOCError
    from ooc.storage.private_dir import check_parent

    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(
            f"{text}: no such directory; create it, or leave the flag out for a private "
            f"directory under $TMPDIR")
    try:
        check_parent(text)
        os.rmdir(tempfile.mkdtemp(prefix=".ooc-write-check-", dir=text))
    except OOCError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot create a directory in it ({exc.strerror})") from None
    return text


def zoo_model(text: str) -> str:
    """A model name of ``ooc.models`` (imports torch: only used by commands that need it)."""
    from ooc import models

    if text not in models.NAMES:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; the zoo has: {', '.join(models.NAMES)}")
    return text


def trace_device(text: str) -> str:
    """meta, cpu or cuda[:N]; cuda only where PyTorch sees a GPU."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use meta, cpu or cuda") from None
    if device.type not in ("meta", "cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: trace on meta, cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text}: no CUDA device here (torch.cuda.is_available() is False); trace on "
                f"meta (shapes only, the default) or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text
