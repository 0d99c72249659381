"""``vramguard sweep``: run one command once per release of a package, each run kept in the results store.

The sweep itself (overlays, outcomes, markers in the store, resuming, the JSON log) is
:mod:`vramguard.bisect.sweep`; this module is its command line: the options (those it shares with
``vramguard bisect`` come from :mod:`vramguard.cli.releases`), the checks made before the first install,
one progress line per release on stderr and the summary on stdout. Exit: 0 every release ok or skipped,
1 some release failed, 2 bad input, 128 + N when ended by signal N.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramguard.cli.helptext import summary
from vramguard.bisect.overlay import OverlayCache, default_cache_dir
from vramguard.bisect.sweep import STORE_ENV, Sweep, default_log_path, open_store, releases_to_sweep
from vramguard.cli.releases import (
    add_release_options,
    index_options,
    register_command,
    split_command,
    until_terminated,
)
from vramguard.errors import UsageError
from vramguard.units import parse_size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise UsageError(f"--every must be at least 1, not {value}")
    return value


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="start", metavar="V1", help="first release of the range")
    p.add_argument("--to", dest="end", metavar="V2", help="last release of the range")
    p.add_argument(
        "--every", type=_positive_int, default=1, metavar="N", help="every N-th release of the range"
    )
    p.add_argument("--store", type=Path, metavar="DIR", help=f"results store (default ${STORE_ENV})")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="measure releases stored already")
    add_release_options(
        p,
        versions_help="comma-separated releases, each listed by the index",
        timeout_help="seconds per release; a timeout fails the release (default: none)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sweep``; everything from PACKAGE on is taken raw and parsed again (:func:`split_command`)."""
    register_command(
        subparsers,
        "sweep",
        _add_options,
        run_sweep,
        usage="vramguard sweep PACKAGE (--versions A,B,C | --from V1 --to V2 [--every N]) "
        "--store DIR [options] -- COMMAND...",
        help="run a command once per release of a package, each run recorded in the results store",
        description=summary(__doc__),
    )


def run_sweep(args: argparse.Namespace) -> int:
    """Validate everything that can be validated before the first install, then sweep (:class:`Sweep`)."""
    args, command = split_command(args, "vramguard sweep", _add_options)
    if not command:
        raise UsageError(
            "missing COMMAND: give it after --, e.g. -- python -m pytest benchmarks -m benchmark"
        )
    store = open_store(args.store)
    index = index_options(args)
    index.check()
    releases = releases_to_sweep(
        args.package, index, args.versions, args.start, args.end, args.every, args.pre
    )
    cache = OverlayCache(args.cache_dir or default_cache_dir(), parse_size(args.cache_max))
    cache.open("--cache-dir" if args.cache_dir else "overlay cache")
    sweep = Sweep(
        args.package,
        releases,
        command,
        store,
        cache,
        index,
        args.timeout,
        args.import_check,
        args.resume,
        args.log or default_log_path(cache, args.package),
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    sweep.say(
        f"sweeping {args.package}: {len(releases)} release(s) {releases[0]} .. {releases[-1]} "
        f"into {store.root} (cache {cache.root})"
    )
    return until_terminated(lambda: _run(sweep))


def _run(sweep: Sweep) -> int:
    code = sweep.run()
    print(sweep.summary())
    return code
