"""The ``ooc`` command line: one module per subcommand, each with ``register(subparsers)``.

Errors the user can fix (bad sizes, missing files, budgets too small) end the program with
one line on stderr and exit status 2; a traceback means a bug in ooc.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from vmm.errors import OOCError

# Subcommands, in the order ``ooc --help`` lists them.
COMMANDS = ("demo", "trace", "plan", "simulate", "frag", "report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ooc", description="Out-of-core training for PyTorch: trace, plan, simulate, train, diagnose.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (OOCError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(f"ooc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ooc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
