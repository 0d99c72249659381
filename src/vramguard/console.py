"""The console every face prints to (the CLI, the Trainer callback): rich, imported only when used."""

from __future__ import annotations

import os
from typing import Any

UNWRAPPED_WIDTH = 10_000
"""Console width when stdout is not a terminal: tables and the verdict stay one line per row in a log."""


def stdout_console() -> Any:
    """rich's console on stdout; when stdout is no terminal (a log, a pipe) and ``COLUMNS`` is not
    set, wide enough that nothing wraps (rich's default there is 80 columns)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=UNWRAPPED_WIDTH)
    return console
