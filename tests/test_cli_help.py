"""``--help`` reads as plain text: no reStructuredText markup quoted from a docstring, each command's
description a whole sentence, every option that takes a value with its default said."""

from __future__ import annotations

import argparse
import re

import pytest

from vramguard.cli.app import SUBCOMMAND_MODULES, build_parser

COMMANDS = [name.rsplit(".", 1)[1] for name in SUBCOMMAND_MODULES]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_markup_and_whole_sentences(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    p = _subparser(command)
    text = p.format_help()
    assert re.findall(r"`|:(?:func|mod|class|attr|data|meth):", text) == [], text
    description = " ".join(text.split("\n\n")[1].split())  # the paragraph after the usage
    assert description.endswith("."), description  # report's had stopped at "... markdown) of a"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_with_a_value_says_its_default(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    p = _subparser(command)
    formatter = p._get_formatter()
    silent = [
        a.option_strings[-1]
        for a in p._actions
        if a.option_strings
        and a.nargs != 0
        and a.help is not argparse.SUPPRESS
        and a.default not in (None, [], (), argparse.SUPPRESS)
        and "default" not in formatter._expand_help(a).lower()
    ]
    assert silent == []


def test_audit_and_estimate_name_the_device_alike() -> None:
    """One name for one idea: ``--device`` on both (estimate's was ``--target``: still taken, hidden, as the
    other earlier names are)."""
    for command in ("audit", "estimate"):
        assert "--device" in _subparser(command).format_help()
    assert "--target " not in _subparser("estimate").format_help()
    for flag in ("--device", "--target"):
        assert build_parser("estimate").parse_args(["estimate", flag, "cpu"]).target == "cpu"
