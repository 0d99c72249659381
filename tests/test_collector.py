"""vramguard.cli.collector: the garbage collector off during an estimate's imports, on again after them, and the
process's collector as it was when the command ends."""

from __future__ import annotations

import gc
from collections.abc import Iterator

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
