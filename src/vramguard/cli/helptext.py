"""What ``--help`` prints: plain text (no reStructuredText markup from the docstrings it quotes), whole
sentences, and each option's default."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_QUOTED = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ``:func:`~a.b.name``` -> ``name`` (the dotted path as
    written when it has no ``~``), double and single backquotes dropped around their text."""

    def role(m: re.Match[str]) -> str:
        whole = m.group(0)
        target = m.group(1)
        return target.rsplit(".", 1)[-1] if ":`~" in whole else target

    return _QUOTED.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(role, text)))


def summary(doc: str | None) -> str:
    """A docstring's first paragraph as one plain line: a command's description, whole (its first line alone
    had stopped mid-sentence)."""
    paragraph = (doc or "").strip().split("\n\n", 1)[0]
    return plain(" ".join(line.strip() for line in paragraph.splitlines()))


def _says_default(help_text: str) -> bool:
    return "default" in help_text.lower()


class PlainHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with :func:`plain` descriptions and help, and ``(default: X)`` after the help of
    an option that takes a value whose default is one (not None, empty or suppressed) and whose help does not
    say it (a switch's default is its absence)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = action.nargs != 0 and default is not argparse.SUPPRESS and default not in (None, [], ())
        if shown and action.option_strings and not _says_default(text):
            text += " (default: %(default)s)"
        return text
