"""The ``ooc`` command line: one module per subcommand, each with ``register(subparsers)``.

Errors the user can fix (bad sizes, missing files, budgets too small) end the program with
one line on stderr and exit status 2; a traceback means a bug in ooc. Values are checked
while parsing (``ooc.cli.args``), before any work; what can only be found out later (a file
that is not a trace, a budget the step does not fit in) is an ``OOCError``, an ``OSError``
or a ``ValueError`` from the command, and ``main`` prints it the same way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ooc.cli.args import Parser, UsageError
from vmm.errors import OOCError

# Subcommands, in the order ``ooc --help`` lists them.
COMMANDS = ("demo", "trace", "plan", "simulate", "fit", "frag", "report")


def build_parser() -> argparse.ArgumentParser:
    from ooc import __version__

    parser = Parser(
        prog="ooc", description="Out-of-core training for PyTorch: trace, plan, simulate, train, diagnose.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    parser.add_argument("--version", action="version", version=f"ooc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ooc.cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"ooc.cli.cmd_{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``ooc ARGV``; return the exit status (0, 1 for a demo whose bits differ, 2 for
    bad input, 130 when interrupted). ``--help`` and ``--version`` return 0."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would blame "ooc"; the flag was given to the subcommand
            where = f"ooc {args.command}" if getattr(args, "command", None) else "ooc"
            raise UsageError(where, f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
    except UsageError as exc:
        print(f"{exc.prog}: error: {_one_line(exc.message)}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version: argparse printed them and exits
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (OOCError, OSError, ValueError) as exc:
        # User input found wrong during the work: a foreign file, a budget the step does not
        # fit in, a model option its builder refuses (ValueError), a disk that fills up.
        print(f"ooc {args.command}: error: {_one_line(_describe(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ooc {args.command}: interrupted", file=sys.stderr)
        return 130


def _describe(exc: BaseException) -> str:
    """The error as a user reads it: an OSError by its file and reason ("x.png: Permission
    denied", not "[Errno 13] ..."), anything else by its message."""
    if isinstance(exc, OSError) and not isinstance(exc, OOCError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where else exc.strerror
    return str(exc) or type(exc).__name__


def _one_line(text: str) -> str:
    """A message on one line: wrapped messages (argparse's, multi-line exceptions) joined."""
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
