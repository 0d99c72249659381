"""The one way vramguard forks a process: the audit's ranks (:mod:`vramguard.audit.launch`) and ``--fit``'s worker
processes (:mod:`vramguard.estimate.workers`)."""

from __future__ import annotations

import os
import sys
import warnings


def fork() -> int:
    """``os.fork()`` with this process's output flushed first (a child would write the parent's buffered lines
    again) and Python's warning about forking a process with threads silenced: Python >= 3.12 warns on every fork
    of a process with a second thread, and torch starts one at import (an idle OpenMP helper; rich's progress bar
    is another); the children start no parallel region the parent began and take none of those threads' locks."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
        return os.fork()


__all__ = ["fork"]
