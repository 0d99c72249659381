"""What ``vramguard bisect`` and ``vramguard sweep`` share on the command line: the options for the
releases of one package over the overlay cache (one definition, one default), the ``PACKAGE [options]
-- COMMAND`` split, and the end by a signal. Each command adds only its own options."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from vramguard.bisect.pkgindex import IndexOptions, check_package_name
from vramguard.bisect.run import Terminated, signals_end_the_run
from vramguard.errors import UsageError
from vramguard.units import SIZE_HELP


MAX_TIMEOUT_S = 365 * 24 * 3600


def positive_float(text: str) -> float:
    """argparse type of a timeout: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"a timeout must be positive and finite: {text!r}")
    if value > MAX_TIMEOUT_S:  # the OS's timers stop at about 2**63 ns (292 years); a year is never meant
        raise UsageError(f"a timeout must be at most {MAX_TIMEOUT_S:,} s (a year): {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """Raises UsageError (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise the parse error as a :class:`UsageError` (one line, exit 2) instead of printing usage and
        exiting."""
        raise UsageError(message)


def add_release_options(p: argparse.ArgumentParser, *, versions_help: str, timeout_help: str) -> None:
    """The options of the releases of one package: which ones, where pip finds them, the overlay cache
    they are installed into, the JSON log, the per-run timeout and the import check."""
    p.add_argument("--versions", metavar="LIST", help=versions_help)
    p.add_argument("--pre", action="store_true", help="include pre-releases and dev releases")
    p.add_argument("--index-url", metavar="URL", help="package index (default: pip's configuration)")
    p.add_argument(
        "--find-links",
        action="append",
        default=[],
        metavar="DIR",
        help="local wheel directory or page; alone, it means offline (--no-index)",
    )
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S", help=timeout_help)
    p.add_argument(
        "--index-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="network timeout for the package index (default 30)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="overlay cache, shared by bisect and sweep (default $VRAMGUARD_CACHE or ~/.cache/vramguard/overlays)",
    )
    p.add_argument(
        "--cache-max",
        default="10 GiB",
        metavar="SIZE",
        help=f"cache bound, LRU eviction; {SIZE_HELP} (default: 10 GiB)",
    )
    p.add_argument(
        "--log",
        type=Path,
        default=None,
        metavar="PATH",
        help="JSON log of the run (default: a new file under the cache dir)",
    )
    p.add_argument(
        "--no-import-check",
        dest="import_check",
        action="store_false",
        help="do not verify that the overlay version is the one imported",
    )


def register_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    add_options: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
    **parser_kwargs: str,
) -> None:
    """Add the subcommand ``name`` (``usage``, ``help``, ``description`` in ``parser_kwargs``): its options
    for ``--help``, and everything from PACKAGE on taken raw, for :func:`split_command` to parse again."""
    p = subparsers.add_parser(name, **parser_kwargs)
    add_options(p)
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="PACKAGE [options] -- COMMAND")
    p.set_defaults(func=handler)


def split_command(
    args: argparse.Namespace, prog: str, add_options: Callable[[argparse.ArgumentParser], None]
) -> tuple[argparse.Namespace, list[str]]:
    """argparse cannot mix a positional PACKAGE, options and ``-- COMMAND`` in a subparser, so everything
    from PACKAGE on arrives raw in ``args.rest``: split it at the first ``--`` and parse what precedes it
    (``add_options``' options and PACKAGE) on top of what was parsed already. The package name and a
    ``--log`` path are checked here, before the first install rather than after the first run."""
    rest = list(args.rest)
    before, command = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    inner = Parser(prog=prog, add_help=False)
    add_options(inner)
    inner.add_argument("package", metavar="PACKAGE")
    ns = inner.parse_args(before, namespace=argparse.Namespace(**vars(args)))
    check_package_name(ns.package)
    if ns.log is not None:
        parent = next((p for p in ns.log.absolute().parents if p.exists()), None)
        if ns.log.is_dir() or parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise UsageError(f"--log {ns.log}: cannot write a file there")
    return ns, command


def index_options(args: argparse.Namespace) -> IndexOptions:
    """The :class:`IndexOptions` of the parsed options."""
    return IndexOptions(args.index_url, tuple(args.find_links), args.index_timeout)


def until_terminated(body: Callable[[], int]) -> int:
    """Run ``body`` with SIGTERM / SIGHUP ending it as Ctrl-C does (its log written on the way out);
    a run ended so says so in one line and exits 128 + the signal number, as a shell reports it."""
    try:
        with signals_end_the_run():
            return body()
    except Terminated as exc:
        print(f"vramguard: terminated by {exc.signame}", file=sys.stderr)
        return 128 + exc.signum
