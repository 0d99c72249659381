"""vramguard.bisect.matrix: the release x suite table reads pytest's JUnit XML honestly, and a warm overlay
cache installs nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# what an inner session imports (the root conftest names the processor: torch's CPU capability) is imported
# here first: pytester restores sys.modules when a test ends, and torch refuses to be imported twice
import torch

from vramguard.bisect import matrix, overlay
from vramguard.bisect.overlay import MARKER, OverlayCache
from vramguard.grad import capabilities

pytest_plugins = ["pytester"]


def _run_pytest(pytester: pytest.Pytester, body: str, xml: Path) -> None:
    """pytest's own JUnit XML of a small suite (``test_fake.py``), from a session in this process (a process
    of its own costs a second of imports: the matrix runs its suites in processes, this reads their XML)."""
    pytester.makepyfile(test_fake="import pytest\n" + body)
    pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "addopts=")


GREEN = """
def test_ok(): pass
@pytest.mark.skip(reason="lacks fp4_cpu")
def test_skip(): pass
@pytest.mark.xfail(strict=True, reason="known defect")
def test_xfail(): assert False
"""


def test_table_counts_outcomes_and_flags_strict_xpass(pytester: pytest.Pytester, tmp_path: Path) -> None:
    _run_pytest(pytester, GREEN, tmp_path / "r" / "bitsandbytes-0.46.0" / "tests_grad.xml")
    _run_pytest(
        pytester,
        GREEN + '@pytest.mark.xfail(strict=True, reason="fixed?")\ndef test_xpass(): pass\n',
        tmp_path / "r" / "bitsandbytes-0.50.2" / "tests_grad.xml",
    )
    text, green = matrix.table(tmp_path / "r")
    assert not green, text
    rows = text.splitlines()
    assert rows[2].startswith("| bitsandbytes-0.46.0 | not recorded | 1 passed, 1 skipped, 1 xfailed ("), text
    assert "**1 passed, 1 skipped, 1 xfailed, 1 xpassed" in rows[3], text
    assert "test_xpass" in text


def test_table_is_green_only_when_every_suite_is(pytester: pytest.Pytester, tmp_path: Path) -> None:
    _run_pytest(pytester, GREEN, tmp_path / "r" / "bitsandbytes-0.47.0" / "tests_grad.xml")
    assert matrix.table(tmp_path / "r")[1]
    _run_pytest(
        pytester, "def test_bad(): assert 0\n", tmp_path / "r" / "bitsandbytes-0.47.0" / "tests_memory.xml"
    )
    text, green = matrix.table(tmp_path / "r")
    assert not green and "**1 failed" in text


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x" / "a").mkdir(parents=True)
    (tmp_path / "x" / "a" / "s.xml").write_text("not xml")
    assert matrix.main(["table", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vramguard matrix: error:")
    assert matrix.main(["table", str(tmp_path / "missing")]) == 2
    assert matrix.main(["releases", "bitsandbytes", "not a spec"]) == 2


def test_warm_cache_installs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    cache = OverlayCache(tmp_path, 10**9)
    entry = cache.entry_dir("bitsandbytes", "0.47.0")
    entry.mkdir(parents=True)
    (entry / MARKER).write_text(json.dumps({"import_names": ["bitsandbytes"], "size": 1}))

    def no_pip(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("pip was called for a cached overlay")

    monkeypatch.setattr(overlay, "run_with_tail", no_pip)  # how the cache runs pip
    monkeypatch.setenv("VRAMGUARD_CACHE", str(tmp_path))
    assert matrix.main(["overlay", "bitsandbytes", "0.47.0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(entry) and "cached: installed nothing" in err
    # and a cold entry does go to pip (the check above can fail)
    with pytest.raises(AssertionError, match="pip was called"):
        matrix.main(["overlay", "bitsandbytes", "0.48.0"])


def test_each_row_names_the_processor_its_run_recorded(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root conftest records this machine's processor in every JUnit XML; the table shows it per row,
    and a run that did not record one says so. Its copy runs in this process: what else its hooks do to a
    process (one intra-op thread where the run records nothing, ``gc.freeze``) must not reach this session,
    which may be a recording run that keeps torch's threads."""
    import gc

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    monkeypatch.setattr(gc, "freeze", lambda: None)
    threads = torch.get_num_threads()
    out = tmp_path / "r" / "bitsandbytes-0.50.2" / "tests_grad.xml"
    repo = Path(__file__).resolve().parents[1]
    (pytester.path / "conftest.py").write_text((repo / "conftest.py").read_text())
    _run_pytest(pytester, GREEN, out)
    (pytester.path / "conftest.py").unlink()
    _run_pytest(pytester, GREEN, tmp_path / "r" / "bitsandbytes-0.50.0" / "tests_grad.xml")
    text, _ = matrix.table(tmp_path / "r")
    rows = text.splitlines()
    assert rows[2].startswith("| bitsandbytes-0.50.0 | not recorded |"), text
    assert rows[3].startswith(f"| bitsandbytes-0.50.2 | {capabilities.processor()} |"), text
    assert torch.get_num_threads() == threads
