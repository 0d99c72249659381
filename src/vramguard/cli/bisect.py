"""``vramguard bisect`` on the command line: its options, validation before the first install, and
the rich console the bisection reports to (:mod:`vramguard.bisect.run` prints nothing itself)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from packaging.version import Version
from rich.console import Console

from vramguard.bisect.overlay import OverlayCache, default_cache_dir
from vramguard.bisect.pkgindex import IndexOptions, available_versions, select_range, sort_versions
from vramguard.bisect.run import (
    EXIT_AMBIGUOUS,
    BisectRun,
    LiveRuns,
    Terminated,
    default_log_path,
    signals_end_the_run,
)
from vramguard.bisect.search import probe_bound
from vramguard.errors import UsageError
from vramguard.units import format_bytes, parse_size

# -- CLI ----------------------------------------------------------------------------------------------
#: PEP 508 project names (no path separators: the name becomes part of file names)
_PROJECT_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"a timeout must be positive and finite: {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """Raises UsageError (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--good", metavar="V", help="a version where the probe passes (required)")
    p.add_argument("--bad", metavar="V", help="a version where the probe fails (required)")
    p.add_argument("--find-fix", action="store_true", help="--bad is older than --good; find the first good")
    p.add_argument(
        "--versions", metavar="LIST", help="comma-separated candidates instead of asking the index"
    )
    p.add_argument("--pre", action="store_true", help="include pre-releases and dev releases")
    p.add_argument("--index-url", metavar="URL", help="package index (default: pip's configuration)")
    p.add_argument(
        "--find-links",
        action="append",
        default=[],
        metavar="DIR",
        help="local wheel directory or page; alone, it means offline (--no-index)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="seconds a probe may run; a timeout counts as bad (default: none)",
    )
    p.add_argument(
        "--index-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="network timeout for the package index (default 30)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="overlay cache (default $VRAMGUARD_CACHE or ~/.cache/vramguard/overlays)",
    )
    p.add_argument("--cache-max", default="10 GiB", metavar="SIZE", help="cache bound, LRU eviction (10 GiB)")
    p.add_argument(
        "--log",
        type=Path,
        default=None,
        metavar="PATH",
        help="JSON log of every probe (default: a new file under the cache dir)",
    )
    p.add_argument(
        "--no-import-check",
        dest="import_check",
        action="store_false",
        help="do not verify that the overlay version is the one imported",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bisect``. argparse cannot mix a positional PACKAGE, options and ``-- COMMAND`` in a
    subparser, so everything from PACKAGE on is taken raw and parsed again in :func:`_reparse`."""
    p = subparsers.add_parser(
        "bisect",
        usage="vramguard bisect PACKAGE --good V1 --bad V2 [options] -- COMMAND...",
        help="find the release of a package where a probe's result changed",
        description="Find the first bad (or, with --find-fix, first fixed) release of PACKAGE. "
        "COMMAND exits 0 for good, 125 to skip a version, anything else (or a timeout) for bad.",
    )
    _add_options(p)
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="PACKAGE [options] -- COMMAND")
    p.set_defaults(func=handle)


def _reparse(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Split ``rest`` at the first ``--``; parse what precedes it on top of what was parsed already."""
    rest = list(args.rest)
    before, command = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    inner = _Parser(prog="vramguard bisect", add_help=False)
    _add_options(inner)
    inner.add_argument("package", metavar="PACKAGE")
    ns = inner.parse_args(before, namespace=argparse.Namespace(**vars(args)))
    for flag in ("good", "bad"):
        if getattr(ns, flag) is None:
            raise UsageError(f"the following arguments are required: --{flag}")
    return ns, command


def _candidates(args: argparse.Namespace, index: IndexOptions) -> list[Version]:
    if args.versions is not None:
        listed = [t.strip() for t in args.versions.split(",") if t.strip()]
        for text in listed:
            if not sort_versions([text], pre=True):
                raise UsageError(f"--versions: {text!r} is not a version")
        versions = sort_versions(listed, pre=args.pre)
        return select_range(versions, args.good, args.bad, args.find_fix, "--versions")
    for link in args.find_links:
        if "://" not in link and not Path(link).exists():
            raise UsageError(f"--find-links {link}: no such directory")
    versions = available_versions(args.package, index, pre=args.pre)
    source = args.index_url or (", ".join(args.find_links) if args.find_links else "the package index")
    return select_range(versions, args.good, args.bad, args.find_fix, source)


def handle(args: argparse.Namespace) -> int:
    """Validate everything that can be validated before the first install, then bisect."""
    args, command = _reparse(args)
    if not command:
        raise UsageError("missing COMMAND: give the probe after --, e.g. -- python -m pytest tests_grad/x.py")
    if not _PROJECT_NAME.match(args.package):
        raise UsageError(f"not a package name: {args.package!r}")
    if args.log is not None:  # fail before the first install, not after the first probe
        parent = next((p for p in args.log.absolute().parents if p.exists()), None)
        if args.log.is_dir() or parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise UsageError(f"--log {args.log}: cannot write a file there")
    max_bytes = parse_size(args.cache_max)
    try:
        with signals_end_the_run():
            return _bisect(args, command, max_bytes)
    except Terminated as exc:
        print(f"vramguard: terminated by {exc.signame}", file=sys.stderr)
        return 128 + exc.signum


def _bisect(args: argparse.Namespace, command: list[str], max_bytes: int) -> int:
    index = IndexOptions(args.index_url, tuple(args.find_links), args.index_timeout)
    cache = OverlayCache(args.cache_dir or default_cache_dir(), max_bytes)
    _prepare_cache(cache, "--cache-dir" if args.cache_dir else "overlay cache")
    candidates = _candidates(args, index)
    runs = LiveRuns(cache.root / ".runs")
    console = Console(stderr=True)
    for stale in runs.mark_stale():
        console.print(f"marked the log of a killed run: {stale}", highlight=False, soft_wrap=True)
    try:
        log = args.log or default_log_path(cache.root, args.package)
    except OSError as exc:
        raise UsageError(f"cannot create a log in {cache.root / '.logs'}: {exc.strerror}") from None
    run = BisectRun(
        args.package,
        candidates,
        command,
        cache,
        index,
        args.find_fix,
        args.timeout,
        args.import_check,
        log,
        console=console,
    )
    run.console.print(
        f"bisecting {args.package}: {len(candidates)} candidates {candidates[0]} .. {candidates[-1]}, "
        f"at most {probe_bound(len(candidates))} probes (cache {cache.root}, {format_bytes(max_bytes)})",
        highlight=False,
        soft_wrap=True,
    )
    with runs.register(run.run_id, log, args.package, command):
        run.run()
    print(run.summary())
    return 0 if run.status == "found" else EXIT_AMBIGUOUS


def _prepare_cache(cache: OverlayCache, flag: str) -> None:
    """The cache must be a folder this process can write to; leftovers of killed installs are removed."""
    root = cache.root
    if root.exists() and not root.is_dir():
        raise UsageError(f"{flag} {root}: not a directory")
    try:
        cache.prepare()
        for folder in (".logs", ".runs"):
            (root / folder).mkdir(exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {root}: cannot write there ({exc.strerror or exc})") from None
