"""The one exception that means "the user asked for something wrong" (one line, exit code 2)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input: the CLI prints ``vramguard: error: <message>`` and exits with code 2."""
