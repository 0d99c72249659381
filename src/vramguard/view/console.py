"""The consoles every face prints to (the CLI, the pytest plugins, the Trainer callback) and the audit's
progress bar: rich, imported only when one is asked for.

None of them reads rich markup in what it prints: the data in a line (a benchmark's name such as
``test_step[tiny-llama-r8]``, a path, a library's message) is printed as it is, where markup would drop
``[tiny-llama-r8]`` as an unknown style and fail on ``[/]``. Styles are given as ``style=`` or
``rich.text.Text``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

UNWRAPPED_WIDTH = 10_000
"""Console width when stdout is not a terminal: tables and the verdict stay one line per row in a log."""


def stdout_console() -> Any:
    """rich's console on stdout; when stdout is no terminal (a log, a pipe) and ``COLUMNS`` is not
    set, wide enough that nothing wraps (rich's default there is 80 columns)."""
    from rich.console import Console

    console = Console(markup=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=UNWRAPPED_WIDTH, markup=False)
    return console


def wide_stdout_console() -> Any:
    """rich's console on stdout, 200 columns wide when stdout is no terminal (``vramguard compare``)."""
    from rich.console import Console

    return Console(file=sys.stdout, width=200 if not sys.stdout.isatty() else None, markup=False)


def stderr_console() -> Any:
    """rich's console on stderr (progress and status lines)."""
    from rich.console import Console

    return Console(stderr=True, markup=False)


def text_console(file: Any, width: int = 200) -> Any:
    """A rich console writing plain text (no colour, no terminal codes) to ``file``."""
    from rich.console import Console

    return Console(file=file, width=width, force_terminal=False, color_system=None, markup=False)


def progress_bar(quiet: bool) -> Any:
    """The audit's progress bar on stderr: a description, a bar and the time elapsed; off with ``quiet`` and
    when stderr is no terminal (rich would leave a blank line in a log)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = stderr_console()
    return Progress(
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )
