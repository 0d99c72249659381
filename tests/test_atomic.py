"""Atomic writes (every report, log and record vramguard writes): a reader sees the old file or the new
one."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from vramguard.atomic import write_text_atomic


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_pipe_is_written_to_not_replaced(tmp_path: Path) -> None:
    """``--json`` naming a FIFO (or a device: ``/dev/null``) writes into it; replacing it had left a regular
    file in its place, and as root that is ``/dev/null`` itself (found by fuzzing the CLI)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reader is there before the write: no race
    try:
        write_text_atomic(fifo, "report")
        assert os.read(reader, 100) == b"report" and stat.S_ISFIFO(fifo.stat().st_mode)
    finally:
        os.close(reader)


def test_a_pipe_nobody_reads_is_an_error_not_a_wait(tmp_path: Path) -> None:
    import errno

    import pytest

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    late_reader = threading.Timer(10, lambda: os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)))
    late_reader.daemon = True  # were the write to wait for a reader, one comes: the test fails, not hangs
    late_reader.start()
    with pytest.raises(OSError) as raised:
        write_text_atomic(fifo, "report")
    late_reader.cancel()
    assert raised.value.errno == errno.ENXIO and stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_symlink_keeps_pointing_at_its_target_which_is_replaced(tmp_path: Path) -> None:
    """As root, ``--json /dev/stdout`` with stdout redirected to a file had replaced the link ``/dev/stdout``
    itself with a regular file (the reviewer's finding); here a link in a scratch folder."""
    target = tmp_path / "out.txt"
    target.write_text("old")
    link = tmp_path / "stdout"
    link.symlink_to(target)
    assert write_text_atomic(link, "new") == link
    assert link.is_symlink() and target.read_text() == "new"


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_new_file_follows_the_umask_like_a_plain_open(tmp_path: Path, umask: int, mode: int) -> None:
    """mkstemp's temporary is 0600 whatever the umask: reports and records were private to their writer."""
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "report.json", "{}")
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == mode


def test_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    path.chmod(0o640)
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
