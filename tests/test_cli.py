"""The ``vramguard`` command's exit codes: an unexpected exception is never read as a verdict."""

from __future__ import annotations

import argparse

import pytest

from vramguard.cli import app as cli


def _crashing_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cli.build_parser

    def build() -> argparse.ArgumentParser:
        parser = real()
        parser.set_defaults(func=lambda args: 1 / 0)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)


def test_an_internal_error_is_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _crashing_subcommand(monkeypatch)
    monkeypatch.delenv("VRAMGUARD_DEBUG", raising=False)
    assert cli.main([]) == cli.EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("vramguard: internal error: ZeroDivisionError: division by zero")


def test_vramguard_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _crashing_subcommand(monkeypatch)
    monkeypatch.setenv("VRAMGUARD_DEBUG", "1")
    assert cli.main([]) == cli.EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
