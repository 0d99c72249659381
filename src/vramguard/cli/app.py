"""The ``vramguard`` command: one subcommand per module, each exposing ``register(subparsers)``.

A subcommand's ``register`` adds its parser and sets ``func(args) -> int``. Bad input anywhere
raises :class:`UsageError`, which becomes one line on stderr and exit code 2, never a traceback; so does
an OSError about a file (a name too long, a folder where a file was asked for): the user's path.

Exit codes: 0 fine, 1 the verdict is a failure (a regression, a weight copy, a leak), 2 bad input,
3 the run did not finish: an internal error (a bug: one line, and the traceback with
``VRAMGUARD_DEBUG=1``) or a process of the run killed from outside (:class:`~vramguard.errors.RunKilled`:
the line names the signal and calls it no bug), 130 interrupted. An unexpected exception must never exit 1,
which a CI job would read as a verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from vramguard import __version__
from vramguard.cli.helptext import PlainHelpFormatter
from vramguard.errors import RunKilled, UsageError

# Modules that contribute a subcommand (``register(subparsers) -> None``).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "vramguard.cli.audit",
    "vramguard.cli.estimate",
    "vramguard.cli.compare",
    "vramguard.cli.sweep",
    "vramguard.cli.report",
    "vramguard.cli.bisect",
)

#: Exit code of a run that did not finish (an unexpected exception, a bug, or a process of the run killed
#: from outside), distinct from a failed verdict (1) and bad input (2).
EXIT_INTERNAL_ERROR = 3


# Log lines of the libraries that say nothing about the user's run: (logger, message prefix).
# bitsandbytes (0.50.2 at least) warns at import, on a CPU with AVX-512 BF16, that the optional
# ``kernels`` package is absent; it then uses its own fused CPU kernel, which is what is measured.
# DeepSpeed (where the distributed extra is installed) is imported by transformers and accelerate whenever it is
# there, and its accelerator detection then warns, on stdout, that a machine without a GPU runs on the CPU.
# liger-kernel's dispatcher (where the liger extra is installed) imports every implementation it knows of an op at its
# first use and warns for each whose package is absent (CuTe DSL, Ascend's); it then takes its Triton one, which is
# what the estimate prices.
LIBRARY_NOISE: tuple[tuple[str, str], ...] = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    (
        "DeepSpeed",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    ),
    ("liger_kernel.backends.registry", "Backend impl '"),
)


class _NoiseFilter(logging.Filter):
    """Drops the known library lines of :data:`LIBRARY_NOISE`, remembering each (once) for --verbose."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.seen: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if message not in self.seen:
            self.seen.append(message)
        return False


@contextlib.contextmanager
def library_noise_hidden() -> Iterator[list[str]]:
    """Within the block, the lines of :data:`LIBRARY_NOISE` are not logged; yields the hidden ones.

    The filters sit on those exact loggers (not on a handler or the root), so every other message
    of the same libraries still gets through.
    """
    hidden: list[str] = []
    installed = []
    for name, prefix in LIBRARY_NOISE:
        f = _NoiseFilter(prefix)
        logging.getLogger(name).addFilter(f)
        installed.append((name, f))
    try:
        yield hidden
    finally:
        for name, f in installed:
            logging.getLogger(name).removeFilter(f)
            hidden.extend(m for m in f.seen if m not in hidden)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every usage error takes the same one-line path; its help is
    plain text with the defaults shown (:class:`~vramguard.cli.helptext.PlainHelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``vramguard`` argument parser with every subcommand's module registered (bad options raise
    UsageError); with ``command``, the name of a subcommand, that subcommand's module alone: the modules of
    ``audit``, ``estimate`` and ``compare`` import torch, seconds before ``sweep``, ``bisect`` or ``report``
    could even parse. Any other ``command`` (a typo, an option) registers them all, as argparse's message
    names every choice."""
    parser = _Parser(
        prog="vramguard",
        description="Where the memory of quantized fine-tuning goes: audit a QLoRA step, compare "
        "benchmark runs, bisect the release that changed memory or gradients.",
    )
    parser.add_argument("--version", action="version", version=f"vramguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = [name for name in SUBCOMMAND_MODULES if name.rsplit(".", 1)[1] == command]
    for name in chosen or SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vramguard`` with ``argv`` and return its exit code (0 fine, 1 failed verdict, 2 bad input, 3 the
    run did not finish); library log noise is hidden unless ``--verbose``."""
    parsed: list[argparse.Namespace] = []
    with library_noise_hidden() as hidden:
        code = _run(argv, parsed)
    if parsed and getattr(parsed[0], "verbose", False):
        for message in hidden:
            print(f"vramguard: note: a library logged (hidden without --verbose): {message}", file=sys.stderr)
    return code


def _run(argv: Sequence[str] | None, parsed: list[argparse.Namespace]) -> int:
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser(argv[0] if argv else None)
        args = parser.parse_args(argv)
        parsed.append(args)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args))
    except UsageError as exc:
        print(f"vramguard: error: {exc}", file=sys.stderr)
        return 2
    except RunKilled as exc:
        print(f"vramguard: error: {exc}", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    except KeyboardInterrupt:
        print("vramguard: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.filename is None or exc.errno not in PATH_ERRNOS:  # a missing file of vramguard's own is a bug
            return _internal_error(exc)
        # a path the system refused (too long a name, a folder where a file was asked for, no permission): the
        # user's path or their machine, not a bug. filename2: the destination of a rename
        print(f"vramguard: error: {exc.filename2 or exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never exit 1
        return _internal_error(exc)


PATH_ERRNOS = frozenset(
    {errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP}
)
"""What the system says of a path itself. ENOENT is not among them: the commands name the user's missing
files themselves, so a missing file that reaches here is one of vramguard's own (a rank's record)."""


def _internal_error(exc: BaseException) -> int:
    """One line naming ``exc`` as a bug (the traceback with ``VRAMGUARD_DEBUG=1``); exit 3."""
    if os.environ.get("VRAMGUARD_DEBUG"):
        traceback.print_exception(exc)
    print(
        f"vramguard: internal error: {type(exc).__name__}: {exc} "
        "(a bug; VRAMGUARD_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return EXIT_INTERNAL_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
