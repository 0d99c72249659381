"""The compare table of a :class:`~vramguard.history.compare.Comparison`, as rich (the terminal: ``vramguard
compare`` and the pytest benchmark plugin's session summary) and as Markdown (``$GITHUB_STEP_SUMMARY``);
the comparison itself renders nothing."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramguard.history import compare as _compare
from vramguard.history.compare import MEMORY_METRICS, Comparison, Row, params_label
from vramguard.units import format_bytes


# -- the table --------------------------------------------------------------------------------
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
    console.print(Text.assemble(("baseline", "bold"), f": {comparison.baseline_label}"))
    console.print(Text.assemble(("current", "bold"), f":  {comparison.current_label}"))
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
            Text(r.status, style=style),
        )
    console.print(table)
    for key in comparison.only_baseline:
        console.print(f"only in baseline: {key[0]} {params_label(key[1])} (missing from the current run)")
    for key in comparison.only_current:
        console.print(f"only in current:  {key[0]} {params_label(key[1])}")
    console.print(comparison.verdict(), style="bold red" if comparison.failed else "green")


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
