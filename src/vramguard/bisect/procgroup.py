"""Run a command in its own process group that cannot outlive this process, and keep a bounded output tail.

Used by ``vramguard bisect`` for probes and for ``pip install``. The command is started by a small
supervisor: a second Python process that leads a new session (so the command and everything it starts
share its process group and no terminal signal reaches them) and holds the read end of a pipe whose only
write end is this process's. When this process ends for any reason - SIGKILL included - the kernel
closes that write end, the supervisor reads end-of-file and kills the whole group with SIGKILL.

Why not ``prctl(PR_SET_PDEATHSIG)``: it reaches only the direct child (``pytest -n``, ``bash -c`` or
pip's build processes would survive), it fires when the *thread* that forked exits rather than the
process, it is Linux-only, and setting it needs ``preexec_fn``, which is unsafe while other threads run
(rich's progress spinner is one). A pipe's end-of-file needs none of that and covers the group.

A timeout, or an exception here (KeyboardInterrupt, SIGTERM turned into an exception by the caller),
kills the group at once; when the command exits, what it left running in its group is killed too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import IO

#: Bytes of output kept from the end of a command's output; a log stays small whatever a probe prints.
TAIL_BYTES = 8192
TAIL_LINES = 20

# Runs as ``python -I -S -c _SUPERVISOR FD COMMAND...``: -I so the probe's PYTHONPATH (the overlay) does
# not reach it; the environment is passed to COMMAND unchanged.
_SUPERVISOR = r"""
import os, signal, sys, threading
fd, cmd = int(sys.argv[1]), sys.argv[2:]

def watch():
    try:
        os.read(fd, 1)  # nothing is ever written: this returns when the parent has ended
    finally:
        os.killpg(0, signal.SIGKILL)  # the whole group, this supervisor included

threading.Thread(target=watch, daemon=True).start()
os.set_inheritable(fd, False)
try:
    pid = os.posix_spawnp(cmd[0], cmd, os.environ, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
except OSError as exc:
    print(f"[vramguard] cannot run {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
    os._exit(127)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if code < 0:  # died by a signal: die by the same one, so the caller sees what the command got
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    os._exit(128 - code)
os._exit(code)
"""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def run_in_group(
    cmd: Sequence[str], env: Mapping[str, str] | None, timeout: float | None, output: IO[bytes]
) -> int | None:
    """Run ``cmd`` with stdout and stderr to ``output``; its exit code, or None after ``timeout``.

    A command killed by signal N gives ``-N``, as with :mod:`subprocess`. Whatever happens, nothing of
    the command's process group is left running when this returns or raises, or when this process dies.
    """
    if not cmd:
        raise ValueError("empty command")
    read_end, write_end = os.pipe()  # both close-on-exec: only the supervisor gets read_end (pass_fds)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _SUPERVISOR, str(read_end), *cmd],
            env=None if env is None else dict(env),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(read_end,),
        )
        os.close(read_end)
        read_end = -1
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    finally:
        if read_end >= 0:
            os.close(read_end)
        if proc is not None:
            _kill_group(proc.pid)  # the timeout, an exception, or what the command left behind
            proc.wait()
        os.close(write_end)


def read_tail(output: IO[bytes], max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last lines of ``output``, reading at most its last ``max_bytes`` bytes (never the whole file).

    When earlier output was cut, the first line says how much.
    """
    size = output.seek(0, os.SEEK_END)
    start = max(0, size - max_bytes)
    output.seek(start)
    lines = output.read(max_bytes).decode(errors="replace").splitlines()
    lines = lines[-max_lines:]
    if start > 0:
        lines.insert(0, f"[vramguard] output cut: only its last {size - start} of {size} bytes are kept")
    return lines


def run_with_tail(
    cmd: Sequence[str],
    env: Mapping[str, str] | None,
    timeout: float | None,
    max_lines: int = TAIL_LINES,
    max_bytes: int = TAIL_BYTES,
) -> tuple[int | None, list[str]]:
    """:func:`run_in_group` with the output in a temporary file; the exit code and the output's tail."""
    with tempfile.TemporaryFile(mode="w+b") as out:
        code = run_in_group(cmd, env, timeout, out)
        return code, read_tail(out, max_lines, max_bytes)
