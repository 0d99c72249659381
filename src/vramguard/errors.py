"""The exceptions the CLI turns into one line: :class:`UsageError` (the user asked for something wrong, exit
code 2) and :class:`RunKilled` (a process of the run was ended from outside, exit code 3 without calling it a
bug)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input: the CLI prints ``vramguard: error: <message>`` and exits with code 2."""


class RunKilled(Exception):
    """A process of the run ended by a signal it did not send itself (on Linux the out-of-memory killer's
    SIGKILL is the likely one for a run that holds a model per rank): the CLI prints ``vramguard: error:
    <message>`` and exits with code 3. The run did not finish, but neither the input nor vramguard is at
    fault."""


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type's name when it says nothing): what a one-line error
    quotes of a library's message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
