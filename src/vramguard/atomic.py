"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read from ``/proc/self/status`` where Linux says it (no change to it, so no race
    with another thread creating a file), else set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode(path: Path) -> int:
    """The mode ``open(path, "w")`` would leave: an existing file's own, else 0666 less the umask (mkstemp's
    temporary is 0600 whatever the umask: a report others should read was private)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: :func:`write_bytes_atomic`."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same directory and ``os.replace``.

    A symlink's target is what is replaced, not the link (``--json /dev/stdout`` redirected to a file, as
    root, had replaced ``/dev/stdout`` itself). A device or a pipe (``--json /dev/null``, a FIFO a reader
    waits on) is written into: replacing it would put a regular file in its place. A FIFO nobody reads is an
    OSError (ENXIO) at once, not a wait for ever. The file's mode is what a plain open would give
    (:func:`new_file_mode`): the umask's for a new file, an existing file's own."""
    given = Path(path)
    path = Path(os.path.realpath(given))
    if given.exists() and not path.is_file() and not path.is_dir():
        fd = os.open(given, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: a FIFO with no reader
        os.set_blocking(fd, True)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return given
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = new_file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return given
