"""``vramguard bisect`` on the command line: its options, validation before the first install, and
the rich console the bisection reports to (:mod:`vramguard.bisect.run` prints nothing itself)."""

from __future__ import annotations

import argparse
from pathlib import Path

from packaging.version import Version

from vramguard.bisect.commits import Commit, CommitBuilder, commit_range, default_build
from vramguard.bisect.overlay import OverlayCache, default_cache_dir
from vramguard.bisect.pkgindex import IndexOptions, available_versions, select_range, sort_versions
from vramguard.bisect.run import EXIT_AMBIGUOUS, INSTALL_TIMEOUT_S, BisectRun, LiveRuns, default_log_path
from vramguard.bisect.search import probe_bound
from vramguard.cli.releases import (
    add_release_options,
    index_options,
    register_command,
    split_command,
    until_terminated,
)
from vramguard.errors import UsageError
from vramguard.units import format_bytes, parse_size
from vramguard.view.console import stderr_console


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--good", metavar="V", help="a version (a ref with --git) where the probe passes (required)"
    )
    p.add_argument("--bad", metavar="V", help="a version (a ref with --git) where the probe fails (required)")
    p.add_argument("--find-fix", action="store_true", help="--bad is older than --good; find the first good")
    p.add_argument(
        "--git",
        type=Path,
        metavar="PATH",
        help="bisect the commits of this local clone between --good and --bad (each built into an overlay)",
    )
    p.add_argument(
        "--build",
        metavar="CMD",
        help="with --git: shell command run in each commit's tree before its pip install (default: "
        "bitsandbytes' CMake CPU backend for bitsandbytes, nothing for others)",
    )
    add_release_options(
        p,
        versions_help="comma-separated candidates instead of asking the index",
        timeout_help="seconds a probe may run; a timeout counts as bad (default: none)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bisect``; everything from PACKAGE on is taken raw and parsed again in :func:`_reparse`."""
    register_command(
        subparsers,
        "bisect",
        _add_options,
        handle,
        usage="vramguard bisect PACKAGE --good V1 --bad V2 [--git PATH [--build CMD]] [options] -- COMMAND...",
        help="find the release (or commit) of a package where a probe's result changed",
        description="Find the first bad (or, with --find-fix, first fixed) release of PACKAGE, or with --git "
        "its first bad commit in a local clone. COMMAND exits 0 for good, 125 to skip a version, anything "
        "else (or a timeout) for bad.",
    )


def _reparse(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """The options after PACKAGE and the probe command (:func:`split_command`); --good and --bad given."""
    ns, command = split_command(args, "vramguard bisect", _add_options)
    for flag in ("good", "bad"):
        if getattr(ns, flag) is None:
            raise UsageError(f"the following arguments are required: --{flag}")
    if ns.git is None and ns.build is not None:
        raise UsageError("--build builds commits: it needs --git PATH")
    if ns.git is not None:
        for flag, given in (("--versions", ns.versions is not None), ("--pre", ns.pre)):
            if given:
                raise UsageError(f"{flag} chooses releases: it cannot be used with --git")
    return ns, command


def _candidates(args: argparse.Namespace, index: IndexOptions) -> list[Version]:
    if args.versions is not None:
        listed = [t.strip() for t in args.versions.split(",") if t.strip()]
        for text in listed:
            if not sort_versions([text], pre=True):
                raise UsageError(f"--versions: {text!r} is not a version")
        versions = sort_versions(listed, pre=args.pre)
        return select_range(versions, args.good, args.bad, args.find_fix, "--versions")
    index.check()
    versions = available_versions(args.package, index, pre=args.pre)
    return select_range(versions, args.good, args.bad, args.find_fix, index.source())


def handle(args: argparse.Namespace) -> int:
    """Validate everything that can be validated before the first install, then bisect."""
    args, command = _reparse(args)
    if not command:
        raise UsageError("missing COMMAND: give the probe after --, e.g. -- python -m pytest tests_grad/x.py")
    max_bytes = parse_size(args.cache_max)
    return until_terminated(lambda: _bisect(args, command, max_bytes))


def _bisect(args: argparse.Namespace, command: list[str], max_bytes: int) -> int:
    index = index_options(args)
    cache = OverlayCache(args.cache_dir or default_cache_dir(), max_bytes)
    cache.open("--cache-dir" if args.cache_dir else "overlay cache")
    builder = None
    if args.git is not None:
        candidates: list[Version] | list[Commit] = commit_range(
            args.git.absolute(), args.good, args.bad, args.find_fix
        )
        build = args.build if args.build is not None else default_build(args.package)
        builder = CommitBuilder(
            args.package, args.git.absolute(), cache, build, index.pip_args(), INSTALL_TIMEOUT_S
        )
    else:
        candidates = _candidates(args, index)
    runs = LiveRuns(cache.root / ".runs")
    console = stderr_console()
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
        builder=builder,
    )
    what = f"commits of {args.git}" if builder is not None else "candidates"
    run.console.print(
        f"bisecting {args.package}: {len(candidates)} {what} {candidates[0]} .. {candidates[-1]}, "
        f"at most {probe_bound(len(candidates))} probes (cache {cache.root}, {format_bytes(max_bytes)})",
        highlight=False,
        soft_wrap=True,
    )
    with runs.register(run.run_id, log, args.package, command):
        run.run()
    print(run.summary())
    return 0 if run.status == "found" else EXIT_AMBIGUOUS
