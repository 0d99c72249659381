"""``vramguard compare`` on the command line: its options, and the rich and Markdown views of a
:class:`~vramguard.history.compare.Comparison` (the comparison itself renders nothing)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vramguard.atomic import write_text_atomic
from vramguard.errors import UsageError
from vramguard.history import compare as _compare
from vramguard.history.compare import MEMORY_METRICS, Comparison, Gate, Row, add_gate_options, params_label
from vramguard.history.store import load_spec
from vramguard.units import format_bytes


# reporting --------------------------------------------------------------------------------
def _fmt(metric: str, value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if metric.endswith("_time"):  # step_time, estimate_wall_time, ...: seconds
        return f"{value:+.3f} s" if signed else f"{value:.3f} s"
    return format_bytes(value, signed=signed)


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return f"{value * 100:+.2f}%"


def _interesting(rows: list[Row], verbose: bool) -> list[Row]:
    """Headline metrics plus anything not ok; every metric with ``verbose``."""
    head = set(MEMORY_METRICS) | set(_compare.TIME_METRICS) | set(_compare.ESTIMATE_METRICS)
    return [r for r in rows if verbose or r.metric in head or r.status not in ("ok", "n/a")]


def render(comparison: Comparison, console: Console, verbose: bool = False) -> None:
    """Print a comparison as a rich table (the version changes above it, the verdict below); ``verbose`` also
    lists the metrics that did not move."""
    console.print(f"[bold]baseline[/]: {comparison.baseline_label}")
    console.print(f"[bold]current[/]:  {comparison.current_label}")
    for name, (old, new) in comparison.version_changes.items():
        console.print(f"  {name}: {old} -> {new}")
    table = Table(title="vramguard compare", show_lines=False)
    for column in (
        "benchmark",
        "params",
        "metric",
        "baseline",
        "current",
        "delta",
        "%",
        "threshold",
        "status",
    ):
        table.add_column(
            column, justify="right" if column in ("baseline", "current", "delta", "%") else "left"
        )
    for r in _interesting(comparison.rows, verbose):
        style = {"REGRESSION": "bold red", "MISSING": "bold red", "improved": "green"}.get(r.status, "")
        table.add_row(
            r.name,
            params_label(r.params),
            r.metric,
            _fmt(r.metric, r.base),
            _fmt(r.metric, r.current),
            _fmt(r.metric, r.delta, signed=True),
            _pct(r.relative),
            "-" if r.threshold is None else f"{r.threshold * 100:g}%",
            f"[{style}]{r.status}[/]" if style else r.status,
        )
    console.print(table)
    for key in comparison.only_baseline:
        console.print(f"only in baseline: {key[0]} {params_label(key[1])} (missing from the current run)")
    for key in comparison.only_current:
        console.print(f"only in current:  {key[0]} {params_label(key[1])}")
    console.print(
        f"[bold red]{comparison.verdict()}[/]" if comparison.failed else f"[green]{comparison.verdict()}[/]"
    )


def markdown(comparison: Comparison, verbose: bool = False) -> str:
    """The same report as GitHub-flavoured Markdown (for ``$GITHUB_STEP_SUMMARY``)."""
    lines = [
        "## vramguard compare",
        "",
        f"- baseline: `{comparison.baseline_label}`",
        f"- current: `{comparison.current_label}`",
    ]
    lines += [f"- {name}: `{old}` → `{new}`" for name, (old, new) in comparison.version_changes.items()]
    lines += [
        "",
        "| benchmark | params | metric | baseline | current | delta | % | threshold | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in _interesting(comparison.rows, verbose):
        status = f"**{r.status}**" if r.status in ("REGRESSION", "MISSING") else r.status
        thr = "-" if r.threshold is None else f"{r.threshold * 100:g}%"
        lines.append(
            f"| {r.name} | {params_label(r.params)} | {r.metric} | {_fmt(r.metric, r.base)} | "
            f"{_fmt(r.metric, r.current)} | {_fmt(r.metric, r.delta, True)} | {_pct(r.relative)} | {thr} | {status} |"
        )
    lines.append("")
    lines += [
        f"- only in baseline: `{k[0]}` {params_label(k[1])} (missing from the current run)"
        for k in comparison.only_baseline
    ]
    lines += [f"- only in current: `{k[0]}` {params_label(k[1])}" for k in comparison.only_current]
    verdict = comparison.verdict()
    lines.append(f"**{verdict}**" if comparison.failed else verdict[0].upper() + verdict[1:] + ".")
    return "\n".join(lines) + "\n"


# CLI ----------------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """Add the ``compare`` subcommand: two runs (file, run directory or store@ref) and the gate's options."""
    p = subparsers.add_parser(
        "compare",
        help="memory deltas between two benchmark runs; exit 1 on a regression or missing data",
        description=_compare.__doc__.splitlines()[0],
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
    p.add_argument("-v", "--verbose", action="store_true", help="show every metric, not only headline ones")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    """Compare the two runs, render the table (and ``--json`` / ``--markdown`` if asked); exit 1 on a
    regression or missing data."""
    if args.allow_missing and args.fail_on_missing:
        raise UsageError("--allow-missing and --fail-on-missing contradict each other")
    gate = Gate.from_options(
        args.threshold, args.fail_above, args.allow_missing, args.fail_on_new or args.fail_on_missing
    )
    base_doc, base_label = load_spec(args.baseline)
    cur_doc, cur_label = load_spec(args.current)
    comparison = gate.compare(base_doc, cur_doc, base_label, cur_label)
    render(comparison, Console(file=sys.stdout, width=200 if not sys.stdout.isatty() else None), args.verbose)
    try:
        if args.markdown:
            with open(args.markdown, "a") as fh:
                fh.write(markdown(comparison, args.verbose))
        if args.json:
            write_text_atomic(args.json, json.dumps(comparison.to_dict(), indent=1, default=str))
    except OSError as exc:
        raise UsageError(f"cannot write report: {exc}") from None
    return 1 if comparison.failed else 0
