"""The launcher of ``vramguard audit --world-size N``'s ranks: ``python -m vramguard.audit.launch ranks SPEC``
imports the ranks' model stack once, forks every rank from it (:func:`vramguard.audit.distributed.run_rank`)
and waits; all of them share the launcher's process group.

Why fork: each rank used to be a process of its own (``python -m vramguard.audit.distributed rank SPEC R``)
that imported torch, transformers, PEFT and bitsandbytes again, about 4-5 CPU seconds a rank on the reference
machine (bitsandbytes' ``torch.compile`` decorators import torch._dynamo). A forked rank starts with them
imported, as a DataLoader worker does. Forking is safe here because the launcher runs no torch operation
before it forks: an OpenMP thread pool started in the parent hangs a forked child's first parallel region.

Importing this module imports nothing but the standard library (its usage line costs nothing); the stack is
imported by :func:`launch_ranks`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from vramguard.forking import fork

#: a rank's name in ``ps``/``top`` (``/proc/PID/comm``, at most 15 bytes): ``vg-rank-`` and its number
RANK_NAME = "vg-rank-{rank}"

#: the launcher's line on stderr for the first rank that failed, written before it kills the group (the
#: parent reads it: C as ``os.waitstatus_to_exitcode`` gives it, -N for a rank ended by signal N), and the
#: pattern that finds it at the end of a line (a rank that died mid-line leaves half a line first)
NOTE = "[vramguard] rank {rank} exited with {code}"
NOTED = re.compile(r"\[vramguard\] rank (?P<rank>\d+) exited with (?P<code>-?\d+)$")

#: the signals that end a rank from outside (the out-of-memory killer's SIGKILL, a scheduler's or a user's
#: SIGTERM): not a bug. A rank that dies of another (SIGSEGV, SIGABRT, SIGBUS, ...) crashed.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})


def launch_ranks(spec_path: str) -> int:
    """The launcher: import the stack, fork every rank, wait; when one fails, say which and kill the whole
    process group (the ranks and this launcher), so none is left waiting in a collective."""
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec["sharding"]["world_size"])
    from vramguard.audit.distributed import preload, run_rank

    preload(spec)
    ranks: dict[int, int] = {}
    for r in range(world):
        ranks[_fork(lambda r=r: run_rank(spec_path, r), r)] = r
    while ranks:
        pid, status = os.wait()
        r = ranks.pop(pid, None)
        if r is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            r, code = _first_cause([(r, code), *_exited_too(ranks)])
            print("\n" + NOTE.format(rank=r, code=code), file=sys.stderr, flush=True)  # (after a half line)
            os.killpg(0, signal.SIGKILL)
    return 0


def _exited_too(ranks: dict[int, int]) -> list[tuple[int, int]]:
    """The ranks that have exited already as well (reaped now, without waiting), with their exit codes."""
    found = []
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in ranks:
            found.append((ranks.pop(pid), os.waitstatus_to_exitcode(status)))
    return found


def _first_cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the ranks found failed at once, the one to name: a rank ended by a signal from outside
    (:data:`EXTERNAL_SIGNALS`), then one that crashed, before one that exited with an error, which is what
    its peer does when that peer dies (gloo: "Connection closed by peer"). When the out-of-memory killer ends
    rank 1, rank 0 may exit 1 before the launcher has waited for either, and the kernel then reports rank 0
    first (it reaps in the order the children were made)."""
    failed = [(r, code) for r, code in failed if code != 0]
    return min(failed, key=lambda rc: 0 if -rc[1] in EXTERNAL_SIGNALS else 1 if rc[1] < 0 else 2)


def _fork(rank: Callable[[], int], r: int) -> int:
    """Start ``rank()`` in a forked child (its exit code the child's) and return the child's pid. The child
    never returns here: it leaves through ``os._exit``, so the launcher's exit handlers never run twice."""
    pid = fork()
    if pid:
        return pid
    code = 1
    try:
        _name(RANK_NAME.format(rank=r))
        code = rank()
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # as the interpreter does: the message on stderr, exit 1
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - said on stderr, the launcher relays the exit code
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _name(name: str) -> None:
    """Name this process for ``ps``/``top`` (Linux; elsewhere it keeps the launcher's name)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def main(argv: list[str]) -> int:
    """``ranks SPEC``; anything else exits 2."""
    if len(argv) == 2 and argv[0] == "ranks":
        return launch_ranks(argv[1])
    print("usage: python -m vramguard.audit.launch ranks SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
