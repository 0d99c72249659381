"""The one exception that means "the user asked for something wrong" (one line, exit code 2)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input: the CLI prints ``vramguard: error: <message>`` and exits with code 2."""


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type's name when it says nothing): what a one-line error
    quotes of a library's message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
