"""The launcher of ``vramguard audit --world-size N``'s ranks: ``python -m vramguard.audit.launch ranks SPEC``
starts every rank (``python -m vramguard.audit.distributed rank SPEC R``) in its own process group and waits.

Standard library only: it is one process more per distributed run, and the imports of
:mod:`vramguard.audit.distributed` (torch and the model stack) cost it ~2 CPU seconds it never used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def launch_ranks(spec_path: str) -> int:
    """The launcher: start every rank, wait; when one fails, say which and kill the whole process group
    (the ranks and this launcher), so none is left waiting in a collective."""
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec["sharding"]["world_size"])
    procs = [
        subprocess.Popen([sys.executable, "-m", "vramguard.audit.distributed", "rank", spec_path, str(r)])
        for r in range(world)
    ]
    pending = set(range(world))
    while pending:
        for r in sorted(pending):
            code = procs[r].poll()
            if code is None:
                continue
            pending.discard(r)
            if code != 0:
                print(f"[vramguard] rank {r} exited with {code}", file=sys.stderr, flush=True)
                os.killpg(0, signal.SIGKILL)
        time.sleep(0.05)
    return 0


def main(argv: list[str]) -> int:
    """``ranks SPEC``; anything else exits 2."""
    if len(argv) == 2 and argv[0] == "ranks":
        return launch_ranks(argv[1])
    print("usage: python -m vramguard.audit.launch ranks SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
