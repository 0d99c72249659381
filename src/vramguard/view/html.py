"""The HTML (and markdown) writer of a results store's trend: one self-contained page with every headline
memory metric per benchmark across runs, regressions marked and named, the newest run's per-layer saved
bytes, and the environment of every run.

The plots are matplotlib figures inlined as SVG (text drawn as paths, no fonts, scripts or links to
fetch), the CSS is inline: the file opens with no network. The data comes from :mod:`vramguard.history.trend`;
the command is :mod:`vramguard.cli.report`.
"""

from __future__ import annotations

import html
import io
import re
from typing import Any

from vramguard.errors import UsageError
from vramguard.history.trend import LayerBars, Series, Trend, params_label
from vramguard.units import format_bytes

COLOURS = {"activation": "#4c72b0", "weight-copy": "#dd8452", "saved": "#8c8c8c"}
CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;margin-top:2em}h3{margin-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.regression{color:#b00;font-weight:bold}.ok{color:#070}
figure{margin:.5em 0}figure svg{max-width:100%;height:auto}
"""


def _figure_svg(fig: Any, salt: str) -> str:
    """The figure as an inline ``<svg>`` element; ``salt`` keeps its element ids unique in the page."""
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.DOTALL)  # RDF namespaces: nothing to fetch
    return text[text.index("<svg") :]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("vramguard report needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def series_svg(trend: Trend, s: Series, salt: str) -> str:
    """One benchmark metric across the runs as an inline SVG line plot, each regression ringed and labelled."""
    plt = _pyplot()
    labels = [r.label for r in trend.runs]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    try:
        xs = [i for i, v in enumerate(s.values) if v is not None]
        ax.plot(xs, [s.values[i] / 2**20 for i in xs], marker="o", color="#4c72b0", label=s.metric)
        for n, r in enumerate(s.regressions):
            (mark,) = ax.plot(
                [r.run], [r.current / 2**20], marker="o", markersize=12, color="#c00", ls="none"
            )
            mark.set_gid(f"regression-{salt}-{n}")
            ax.annotate(
                f"+{r.relative * 100:.1f}% ({r.introduced_by})",
                (r.run, r.current / 2**20),
                textcoords="offset points",
                xytext=(0, -16),
                ha="center",
                color="#c00",
                fontsize=8,
            )
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MiB")
        ax.set_title(s.metric, fontsize=10)
        ax.grid(alpha=0.3)
        return _figure_svg(fig, salt)
    finally:
        plt.close(fig)


def layers_svg(bars: LayerBars, salt: str) -> str:
    """The latest run's saved bytes per layer as stacked bars by kind, beside their change from the run
    before, as inline SVG."""
    plt = _pyplot()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 3.2))
    try:
        xs = range(len(bars.layers))
        bottom = [0.0] * len(bars.layers)
        for kind, values in bars.kinds.items():
            mib = [v / 2**20 for v in values]
            ax.bar(xs, mib, bottom=bottom, label=kind, color=COLOURS.get(kind, "#55a868"))
            bottom = [b + m for b, m in zip(bottom, mib)]
        ax.set_xticks(list(xs), bars.layers, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("saved MiB")
        ax.set_title("saved for backward, newest run", fontsize=10)
        ax.legend(fontsize=8)
        diffs = [0.0 if d is None else d / 2**20 for d in bars.diff]
        dx.bar(list(xs), diffs, color=["#c00" if d > 0 else "#070" for d in diffs])
        dx.axhline(0, color="#222", lw=0.8)
        dx.set_xticks(list(xs), bars.layers, rotation=45, ha="right", fontsize=7)
        dx.set_ylabel("MiB")
        dx.set_title(
            "change vs the previous run" if bars.previous is not None else "no previous run to compare",
            fontsize=10,
        )
        return _figure_svg(fig, salt)
    finally:
        plt.close(fig)


def _value(metric: str, v: float | None) -> str:
    return "-" if v is None else format_bytes(v)


def bench_title(bench: str, params: str) -> str:
    """A benchmark's heading: its name and, when it has any, its parameters."""
    p = params_label(params)
    return f"{bench} [{p}]" if p else bench


def render_html(trend: Trend, source: str, pages: dict[str, str] | None = None) -> str:
    """The whole report as one self-contained HTML page: regressions first, then each benchmark's plots and
    the runs; ``pages`` (run id -> a link relative to the report) links each run's own page (a run's
    ``vramguard audit/estimate --html`` page kept in its folder of the store) from the environment table."""
    e = html.escape
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>vramguard report: {e(source)}</title><style>{CSS}</style></head><body>",
        (
            f"<h1>vramguard report</h1><p>results store <code>{e(source)}</code>: {len(trend.runs)} run(s), "
            f"threshold {'off' if trend.threshold is None else f'{trend.threshold * 100:g}%'}</p>"
        ),
        "<h2 id='regressions'>Regressions</h2>",
    ]
    regs = trend.regressions
    if regs:
        out.append("<ul>")
        for r in regs:
            out.append(
                f"<li class='regression'>{e(bench_title(r.bench, r.params))} {e(r.metric)}: "
                f"{e(format_bytes(r.base))} &rarr; {e(format_bytes(r.current))} (+{r.relative * 100:.1f}%) "
                f"at <span class='release'>{e(trend.runs[r.run].label)}</span>, introduced by "
                f"{e(r.introduced_by)}</li>"
            )
        out.append("</ul>")
    else:
        out.append("<p class='ok'>none beyond the threshold</p>")
    n = 0
    for bench, params in trend.benchmarks():
        out.append(f"<h2>{e(bench_title(bench, params))}</h2>")
        for s in trend.series:
            if (s.bench, s.params) != (bench, params):
                continue
            n += 1
            out.append(
                f"<figure class='plot' data-metric='{e(s.metric)}'>{series_svg(trend, s, f'f{n}')}</figure>"
            )
        for bars in trend.layers:
            if (bars.bench, bars.params) == (bench, params):
                n += 1
                out.append(
                    f"<h3>per-layer saved bytes, {e(trend.runs[bars.run].label)}</h3>"
                    f"<figure class='plot layers'>{layers_svg(bars, f'f{n}')}</figure>"
                )
    out.append("<h2>Values</h2>" + _html_table(*_values_table(trend)))
    out.append(
        "<h2>Environment</h2>" + _html_table(*_env_table(trend), links=_page_links(trend, pages or {}))
    )
    if trend.skipped_runs:
        out.append("<h2>Runs without memory fields</h2><ul>")
        out += [f"<li>{e(run)}: {e(why)}</li>" for run, why in trend.skipped_runs]
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _values_table(trend: Trend) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Rows: one per benchmark and metric; columns: the runs. Cells: (text, is a regression)."""
    header = ["benchmark", "metric"] + [r.label for r in trend.runs]
    rows = []
    for s in trend.series:
        regressed = {r.run for r in s.regressions}
        row = [(bench_title(s.bench, s.params), False), (s.metric, False)]
        row += [(_value(s.metric, v), i in regressed) for i, v in enumerate(s.values)]
        rows.append(row)
    return header, rows


def _env_table(trend: Trend) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    packages = sorted({k for r in trend.runs for k in (r.environment.get("packages") or {})})
    header = ["seq", "run", "date", "sweep outcome", "device", "gpu", "cuda", "driver", "python", *packages]
    rows = []
    for r in trend.runs:
        env = r.environment
        pk = env.get("packages") or {}
        sweep = r.sweep or {}
        outcome = f"{sweep.get('outcome')} (exit {sweep.get('exit_code')})" if sweep else None
        cells = [
            r.seq,
            r.run_id,
            r.datetime,
            outcome,
            env.get("device"),
            env.get("gpu_name"),
            env.get("cuda"),
        ]
        cells += [env.get("driver"), env.get("python"), *[pk.get(p) for p in packages]]
        rows.append([("-" if c is None else str(c), False) for c in cells])
    return header, rows


def _page_links(trend: Trend, pages: dict[str, str]) -> list[str | None]:
    """Per run (the environment table's rows), the link to its page, or None."""
    return [pages.get(r.run_id) for r in trend.runs]


def _html_table(
    header: list[str], rows: list[list[tuple[str, bool]]], links: list[str | None] | None = None
) -> str:
    """A table; with ``links`` (one per row), a last ``page`` column links each row's page where it has one."""
    e = html.escape
    extra = ["page"] if links is not None else []
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in [*header, *extra]) + "</tr>"]
    for i, row in enumerate(rows):
        cells = "".join(f"<td class='{'regression' if reg else 'num'}'>{e(text)}</td>" for text, reg in row)
        if links is not None:
            link = links[i]
            cells += f"<td><a class='run-page' href='{e(link)}'>page</a></td>" if link else "<td>-</td>"
        out.append("<tr>" + cells + "</tr>")
    return "".join(out) + "</table>"


def _md_table(header: list[str], rows: list[list[tuple[str, bool]]]) -> list[str]:
    def cell(text: str, reg: bool) -> str:
        text = text.replace("|", "\\|")
        return f"**{text} (regression)**" if reg else text

    lines = ["| " + " | ".join(h.replace("|", "\\|") for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(t, r) for t, r in row) + " |" for row in rows]
    return lines


def render_markdown(trend: Trend, source: str) -> str:
    """The report's regressions and runs as markdown (for a CI job summary or a pull-request comment)."""
    lines = [f"## vramguard report: `{source}`", "", f"{len(trend.runs)} run(s).", "", "### Regressions", ""]
    for r in trend.regressions:
        lines.append(
            f"- **{bench_title(r.bench, r.params)} {r.metric}**: {format_bytes(r.base)} → "
            f"{format_bytes(r.current)} (+{r.relative * 100:.1f}%) at `{trend.runs[r.run].label}`, "
            f"introduced by {r.introduced_by}"
        )
    if not trend.regressions:
        lines.append("None beyond the threshold.")
    lines += ["", "### Values per run", ""] + _md_table(*_values_table(trend))
    for bars in trend.layers:
        lines += [
            "",
            (
                f"### Per-layer saved bytes: {bench_title(bars.bench, bars.params)}, "
                f"{trend.runs[bars.run].label}"
            ),
            "",
        ]
        header = ["layer", *bars.kinds, "change vs previous run"]
        rows = []
        for i, layer in enumerate(bars.layers):
            d = bars.diff[i]
            rows.append(
                [(layer, False)]
                + [(format_bytes(v[i]), False) for v in bars.kinds.values()]
                + [("-" if d is None else format_bytes(d, signed=True), bool(d and d > 0))]
            )
        lines += _md_table(header, rows)
    lines += ["", "### Environment", ""] + _md_table(*_env_table(trend))
    if trend.skipped_runs:
        lines += ["", "### Runs without memory fields", ""]
        lines += [f"- `{run}`: {why}" for run, why in trend.skipped_runs]
    return "\n".join(lines) + "\n"
