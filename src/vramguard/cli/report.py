"""``vramguard report STORE``: one self-contained HTML file (and the same content as markdown) of a
results store (written by :mod:`vramguard.view.html`): every headline memory metric per benchmark across runs with regressions marked and
named, the newest run's per-layer saved bytes, and the environment of every run.

The plots are matplotlib figures inlined as SVG (text drawn as paths, no fonts, scripts or links to
fetch), the CSS is inline: the file opens with no network. The data comes from :mod:`vramguard.history.trend`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vramguard.cli.helptext import summary
from vramguard.atomic import write_text_atomic
from vramguard.errors import UsageError
from vramguard.history.compare import DEFAULT_MEMORY_THRESHOLD
from vramguard.history.store import INDEX, ResultStore
from vramguard.history.trend import build
from vramguard.units import parse_percent
from vramguard.view.html import bench_title, render_html, render_markdown


def run_pages(store: Path, trend: Any, output: Path) -> dict[str, str]:
    """Run id -> the link, relative to ``output``'s folder, to the first ``*.html`` page in that run's folder
    of the store (``STORE/<env key>/<run id>/``: a ``vramguard audit/estimate --html`` page kept with the
    run's records), for the runs that have one."""
    import os

    pages = {}
    for run in trend.runs:
        found = sorted((store / run.key / run.run_id).glob("*.html"))
        if found:
            pages[run.run_id] = Path(os.path.relpath(found[0], output.absolute().parent)).as_posix()
    return pages


# -- CLI ------------------------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand: the store, the HTML output, an optional markdown copy and the threshold.
    A run whose folder in the store holds an HTML page (``vramguard audit --html STORE/<env key>/<run id>/x.html``)
    is linked from the report."""
    p = subparsers.add_parser(
        "report",
        help="a self-contained HTML (and markdown) report of a results store across runs",
        description=summary(__doc__),
    )
    p.add_argument("store", type=Path, metavar="STORE", help="a results store (a directory with index.jsonl)")
    p.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="the HTML file to write")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write the report as markdown")
    p.add_argument(
        "--fail-above",
        default=None,
        metavar="PCT",
        help=f"regression threshold for memory metrics (default {DEFAULT_MEMORY_THRESHOLD * 100:g}%%)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the trend of the store, write the HTML (and markdown) report atomically; a missing or foreign
    folder is one line, exit 2."""
    if not args.store.is_dir():
        raise UsageError(f"no such directory: {args.store}")
    if not ResultStore.is_store(args.store):
        raise UsageError(f"{args.store} is not a results store (no {INDEX})")
    threshold = DEFAULT_MEMORY_THRESHOLD if args.fail_above is None else parse_percent(args.fail_above)
    trend = build(ResultStore(args.store), threshold)
    source = str(args.store)
    page = render_html(trend, source, run_pages(args.store, trend, args.output))
    try:
        write_text_atomic(args.output, page)
        if args.markdown:
            write_text_atomic(args.markdown, render_markdown(trend, source))
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc.strerror or exc}") from None
    regs = trend.regressions
    print(f"report: {args.output} ({len(trend.runs)} runs, {len(regs)} regression(s))")
    for r in regs:
        print(
            f"  regression: {bench_title(r.bench, r.params)} {r.metric} +{r.relative * 100:.1f}% "
            f"at {trend.runs[r.run].label} ({r.introduced_by})"
        )
    return 0
