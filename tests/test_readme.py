"""README's Python examples run as printed: a user copies them, so a moved module or a renamed argument
must fail here, not in their hands."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def _block(first_line: str) -> str:
    found = [b for b in _blocks() if b.startswith(first_line)]
    assert len(found) == 1, f"README has {len(found)} python blocks starting {first_line!r}"
    return found[0]


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def test_every_vramguard_import_in_the_readme_resolves() -> None:
    """Each ``from vramguard... import name`` / ``import vramguard...`` of every python block."""
    missing = []
    for block in _blocks():
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vramguard"):
                module = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}"):
                        missing.append(f"{node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("vramguard"):
                        importlib.import_module(a.name)
    assert not missing, missing


def test_the_trainer_and_sft_examples_run(tmp_path, monkeypatch) -> None:
    """The "Measure your own Trainer run" scripts, verbatim: Trainer, then SFTTrainer with the same callback;
    each writes the report and leaves it in ``cb.report``."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_block("import torch\nfrom datasets import Dataset"), "README-trainer", "exec"), scope)
    report = scope["cb"].report
    assert report is not None and report.config["trainer"] == "Trainer" and len(report.steps) == 3
    assert (tmp_path / "trainer.json").is_file()
    exec(compile(_block("from tokenizers import Tokenizer, models"), "README-sft", "exec"), scope)
    report = scope["cb"].report
    assert report is not None and report.config["trainer"] == "SFTTrainer" and len(report.steps) == 3


def test_the_chunked_logprob_reproducer_runs(capsys) -> None:
    """The TRL reproducer prints the two peaks it claims (the wide one far above the narrow one)."""
    pytest.importorskip("trl")
    exec(
        compile(_block("import torch\nfrom trl.kernels import ChunkedLogProbFunction"), "README-trl", "exec"),
        {},
    )
    peaks = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert set(peaks) == {"32768", "512"} and int(peaks["32768"]) > 4 * int(peaks["512"]), peaks
