"""vramguard.cli.collector: the garbage collector off during an estimate's imports, on again after them, and the
process's collector as it was when the command ends."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramguard.cli.collector import imports_uncollected


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """The test session freezes what collection imported (conftest.py): a process that froze nothing here, the
    session's freeze put back after."""
    gc.unfreeze()
    yield
    gc.freeze()


def test_the_collector_is_off_for_the_imports_and_on_after_them() -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with imports_uncollected() as imported:
        assert not gc.isenabled()
        kept = [object()]  # made during the imports: frozen with them
        imported()
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_collector_is_restored_when_the_command_fails_before_its_imports_end() -> None:
    with pytest.raises(ValueError), imports_uncollected():
        raise ValueError("bad input")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_callers_own_policy_is_kept() -> None:
    gc.disable()
    try:
        with imports_uncollected() as imported:
            imported()
            assert not gc.isenabled()  # off before: stays off
        assert not gc.isenabled() and gc.get_freeze_count() == 0
        gc.freeze()
        frozen = gc.get_freeze_count()
        with imports_uncollected() as imported:  # a caller that froze objects: left alone
            imported()
            assert 0 < gc.get_freeze_count() <= frozen  # nothing frozen more (freed ones leave the count)
        assert 0 < gc.get_freeze_count() <= frozen  # nor unfrozen
    finally:
        gc.unfreeze()
        gc.enable()


def test_an_estimate_through_the_command_is_the_same_with_the_collector_block_run(tmp_path: Path) -> None:
    """In the test session the block is a no-op (conftest froze what collection imported), so no command-line
    test runs an estimate through it: here one does (nothing frozen), and its JSON is the one the no-op block
    gives, byte for byte but its time; the collector is on and nothing is frozen after it (review)."""
    import json

    from vramguard.cli.app import main

    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "16", "--batch", "2", "--quiet", "--json"]
    figures = []
    for freeze in (False, True):
        if freeze:
            gc.freeze()  # a caller that froze objects: the block does nothing
        out = tmp_path / f"frozen-{freeze}.json"
        assert main([*argv, str(out)]) == 0
        assert gc.isenabled() and (gc.get_freeze_count() > 0) is freeze
        gc.unfreeze()
        report = json.loads(out.read_text())
        report.pop("elapsed_s")
        figures.append(report)
    assert figures[0] == figures[1]
