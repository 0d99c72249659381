"""The ``vramguard`` command: one subcommand per module, each exposing ``register(subparsers)``.

A subcommand's ``register`` adds its parser and sets ``func(args) -> int``. Bad input anywhere
raises :class:`UsageError`, which becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vramguard import __version__
from vramguard.errors import UsageError

# Modules that contribute a subcommand (``register(subparsers) -> None``).
SUBCOMMAND_MODULES: tuple[str, ...] = ("vramguard.audit", "vramguard.bisect", "vramguard.compare")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every usage error takes the same one-line path."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vramguard",
        description="Where the memory of quantized fine-tuning goes: audit a QLoRA step, compare "
        "benchmark runs, bisect the release that changed memory or gradients.",
    )
    parser.add_argument("--version", action="version", version=f"vramguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args))
    except UsageError as exc:
        print(f"vramguard: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vramguard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
