"""The ``vramguard`` command's exit codes: an unexpected exception is never read as a verdict."""

from __future__ import annotations

import argparse
import errno
from collections.abc import Callable

import pytest

from vramguard.cli import app as cli
from vramguard.errors import RunKilled


def _crashing_subcommand(
    monkeypatch: pytest.MonkeyPatch, func: Callable[[object], int] = lambda args: 1 / 0
) -> None:
    real = cli.build_parser

    def build(command: str | None = None) -> argparse.ArgumentParser:
        parser = real(command)
        parser.set_defaults(func=func)
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


def test_a_run_killed_from_outside_is_one_line_exit_3_and_no_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process of the run ended by a signal (the out-of-memory killer): the run did not finish (3), but the
    line says what happened instead of asking for a bug report."""

    def killed(args: object) -> int:
        raise RunKilled("rank 1 of 2 was killed by SIGKILL before the run finished")

    _crashing_subcommand(monkeypatch, killed)
    assert cli.main([]) == cli.EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert err == "vramguard: error: rank 1 of 2 was killed by SIGKILL before the run finished\n"


def test_a_path_the_system_refuses_is_bad_input_and_other_os_errors_are_bugs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """A name too long for the file system (found by fuzzing ``report`` and ``compare --html``) is the user's
    path: one line naming it, exit 2; a rename names its destination. A missing file that reaches the top
    (the commands name the user's missing files themselves) or an OSError about no file stays a bug."""
    long = str(tmp_path / ("a" * 300))
    assert cli.main(["report", long, "-o", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err == f"vramguard: error: {long}: File name too long\n"
    raised = [
        OSError(errno.EISDIR, "Is a directory", "/tmp/.out.tmp", None, "/home/u/out"),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/tmp/vramguard-ranks-x/rank1.json"),
        OSError(errno.EIO, "Input/output error"),
    ]
    _crashing_subcommand(monkeypatch, lambda args: (_ for _ in ()).throw(raised.pop(0)))
    assert cli.main([]) == 2
    assert capsys.readouterr().err == "vramguard: error: /home/u/out: Is a directory\n"
    for name in ("FileNotFoundError: [Errno 2]", "OSError: [Errno 5] Input/output error"):
        assert cli.main([]) == cli.EXIT_INTERNAL_ERROR
        assert capsys.readouterr().err.startswith(f"vramguard: internal error: {name}")


def test_vramguard_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _crashing_subcommand(monkeypatch)
    monkeypatch.setenv("VRAMGUARD_DEBUG", "1")
    assert cli.main([]) == cli.EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("module", cli.SUBCOMMAND_MODULES)
def test_a_subcommand_parsed_alone_is_the_same_parser(module: str) -> None:
    """``vramguard NAME ...`` registers NAME's module alone: the same options, defaults and help as when every
    subcommand is registered; an unknown name registers them all (argparse's message lists every choice)."""
    name = module.rsplit(".", 1)[1]
    alone, every = _subcommands(cli.build_parser(name)), _subcommands(cli.build_parser())
    assert list(alone) == [name] and name in every
    assert alone[name].format_help() == every[name].format_help()
    defaults = [
        {(a.dest, repr(a.default), a.required) for a in p._actions} for p in (alone[name], every[name])
    ]
    assert defaults[0] == defaults[1]
    assert list(_subcommands(cli.build_parser("nope"))) == list(every)


def test_sweep_and_bisect_parse_without_torch() -> None:
    """A usage error of ``vramguard sweep`` or ``bisect`` comes before torch is imported (it costs seconds)."""
    import subprocess
    import sys

    code = (
        "import sys; from vramguard.cli import main\n"
        "codes = [main(['sweep', '--nope']), main(['bisect', '--nope']), main(['report', '--nope'])]\n"
        "print(codes, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.split("\n")[0] == "[2, 2, 2] False", proc.stdout + proc.stderr
    assert proc.stderr.count("vramguard: error:") == 3 and "Traceback" not in proc.stderr


def test_a_bad_model_is_refused_before_trl_is_imported() -> None:
    """``vramguard estimate --model nope`` (trl sft's defaults, the default trainer) refuses the model before TRL
    is imported to read its defaults: a typo costs ~1.5 s, not the ~6.5 s of every library's import."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from vramguard.cli import main\n"
        "code = main(['estimate', '--model', 'nope'])\n"
        "print(code, 'trl' in sys.modules)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.split("\n")[0] == "2 False", proc.stdout + proc.stderr
    assert "unknown model 'nope'" in proc.stderr and "Traceback" not in proc.stderr
