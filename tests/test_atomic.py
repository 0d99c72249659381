"""Atomic writes (every report, log and record vramguard writes): a reader sees the old file or the new one."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

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
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_text_atomic(fifo, "report")
    reader.join(10)
    assert got == ["report"] and stat.S_ISFIFO(fifo.stat().st_mode)
