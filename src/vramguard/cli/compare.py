"""``vramguard compare`` on the command line: its options; the views of the comparison are
:mod:`vramguard.view.compare`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vramguard.cli.helptext import summary
from vramguard.atomic import write_text_atomic
from vramguard.cli.options import check_json_path
from vramguard.errors import UsageError
from vramguard.history import compare as _compare
from vramguard.history.compare import Gate, add_gate_options
from vramguard.history.store import load_spec
from vramguard.step.report import AuditReport
from vramguard.units import format_bytes
from vramguard.view.compare import markdown, render
from vramguard.view.console import wide_stdout_console


# CLI ----------------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """Add the ``compare`` subcommand: two runs (file, run directory or store@ref) and the gate's options."""
    p = subparsers.add_parser(
        "compare",
        help="memory deltas between two benchmark runs; exit 1 on a regression or missing data",
        description=summary(_compare.__doc__),
    )
    p.add_argument(
        "baseline",
        help="benchmark JSON file, a run directory, or a results store [@latest|@previous|@RUN_ID]",
    )
    p.add_argument("current", help="same forms as BASELINE")
    add_gate_options(p.add_argument)
    p.add_argument(
        "--fail-on-new",
        action="store_true",
        help="also fail on a benchmark or metric that only the current run has",
    )
    p.add_argument(
        "--fail-on-missing",
        action="store_true",
        help="kept for old scripts: same as --fail-on-new (missing data fails by default)",
    )
    p.add_argument(
        "--markdown", type=Path, metavar="FILE", help="append a Markdown report (e.g. $GITHUB_STEP_SUMMARY)"
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="write the comparison as JSON")
    p.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="BASELINE and CURRENT are two vramguard audit/estimate --json reports written with --html or "
        "--snapshot: write one page with both memory timelines on one axis and the per-layer difference",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show every metric, not only headline ones")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    """Compare the two runs, render the table (and ``--json`` / ``--markdown`` if asked); exit 1 on a
    regression or missing data."""
    if args.allow_missing and args.fail_on_missing:
        raise UsageError("--allow-missing and --fail-on-missing contradict each other")
    if args.html is not None:
        return _html(args)
    gate = Gate.from_options(
        args.threshold, args.fail_above, args.allow_missing, args.fail_on_new or args.fail_on_missing
    )
    base_doc, base_label = load_spec(args.baseline)
    cur_doc, cur_label = load_spec(args.current)
    comparison = gate.compare(base_doc, cur_doc, base_label, cur_label)
    render(comparison, wide_stdout_console(), args.verbose)
    try:
        if args.markdown:
            with open(args.markdown, "a") as fh:
                fh.write(markdown(comparison, args.verbose))
        if args.json:
            write_text_atomic(args.json, json.dumps(comparison.to_dict(), indent=1, default=str))
    except OSError as exc:
        raise UsageError(f"cannot write report: {exc}") from None
    return 1 if comparison.failed else 0


def _report(spec: str) -> AuditReport:
    """The audit/estimate report in the JSON file ``spec``; anything else is a :class:`UsageError`."""
    try:
        doc = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a JSON document"
        raise UsageError(f"cannot read {spec}: {why}") from None
    try:
        return AuditReport.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UsageError(
            f"{spec} is no vramguard audit/estimate --json report: --html compares two of those"
        ) from None


def _html(args: argparse.Namespace) -> int:
    """``--html``: the page of two runs (:func:`vramguard.view.timeline.render_compare_html`), written atomically."""
    from vramguard.view.timeline import render_compare_html

    check_json_path(args.html, "--html")
    a, b = _report(args.baseline), _report(args.current)
    page = render_compare_html(a, b, (args.baseline, args.current))
    try:
        write_text_atomic(args.html, page)
    except OSError as exc:
        raise UsageError(f"cannot write --html {args.html}: {exc.strerror or exc}") from None
    assert a.timeline is not None and b.timeline is not None
    print(
        f"compare page written to {args.html}: peak {format_bytes(a.timeline.peak_bytes)} -> "
        f"{format_bytes(b.timeline.peak_bytes)} ({format_bytes(b.timeline.peak_bytes - a.timeline.peak_bytes, signed=True)})"
    )
    return 0
