"""The HTML page of one run (``vramguard audit --html``, ``vramguard estimate --html``) and of two
(``vramguard compare A B --html``): the memory through the step by category, the phases marked, the peak
marked with what is alive there, the saved bytes per decoder layer, and the verdict.

Drawn as :mod:`vramguard.view.html` draws ``vramguard report``: matplotlib figures inlined as SVG (text as
paths: no fonts, scripts or links to fetch), inline CSS, so the file opens with no network. The data is the
report's own: its ``timeline`` (:class:`~vramguard.measure.events.Timeline`), ``layers`` and ``verdict``.
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

from vramguard.atomic import write_bytes_atomic, write_text_atomic
from vramguard.errors import UsageError
from vramguard.measure.events import CATEGORIES, Timeline
from vramguard.step.report import AuditReport
from vramguard.units import format_bytes
from vramguard.view.html import CSS, _figure_svg, _pyplot
from vramguard.view.report import batch_text, short_layer_name

#: One colour per category (colour-blind-safe Tableau 10 order), the same in every page.
CATEGORY_COLOURS = dict(
    zip(
        CATEGORIES,
        ("#bab0ab", "#76b7b2", "#4e79a7", "#e15759", "#f28e2c", "#af7aa1", "#9c755f", "#edc949", "#59a14f"),
        strict=True,
    )
)
PHASE_SHADES = {"forward": "#4e79a7", "backward": "#e15759", "optimizer": "#59a14f"}
GiB = float(1 << 30)
PAGE_CSS = CSS + ".problem{color:#b00;font-weight:bold}.note{color:#555}"


def _unit(peak: float) -> tuple[float, str]:
    return (GiB, "GiB") if peak >= GiB / 4 else (float(1 << 20), "MiB")


def timeline_svg(t: Timeline, salt: str, title: str = "") -> str:
    """The timeline as stacked areas by category over the events, phase calls shaded and named, the peak ringed
    (svg id ``peak-<salt>``) and annotated with its bytes and the largest categories alive there."""
    plt = _pyplot()
    fig = _timeline_figure(plt, t, salt, title)
    try:
        return _figure_svg(fig, salt)
    finally:
        plt.close(fig)


def timeline_image(report: AuditReport, path: Path) -> None:
    """The timeline figure of the page alone, as PNG (``.png``) or SVG (any other suffix), for a README or a
    pull request: ``--timeline-image``."""
    if report.timeline is None:
        raise UsageError("the report has no timeline")
    plt = _pyplot()
    fig = _timeline_figure(plt, report.timeline, "image", _heading(report))
    try:
        if path.suffix.lower() == ".png":
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
            write_bytes_atomic(path, buf.getvalue())
        else:
            write_text_atomic(path, _figure_svg(fig, "image"))
    finally:
        plt.close(fig)


def _timeline_figure(plt: Any, t: Timeline, salt: str, title: str) -> Any:
    scale, unit = _unit(t.peak_bytes)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    try:
        xs = [max(i, 0) for i in t.index]
        ax.stackplot(
            xs,
            *[[v / scale for v in t.bytes[c]] for c in t.categories],
            labels=t.categories,
            colors=[CATEGORY_COLOURS.get(c, "#999") for c in t.categories],
            step="post",
        )
        top = t.peak_bytes / scale * 1.22
        for p in t.phases:
            ax.axvspan(
                p.start, max(p.end, p.start + 1), color=PHASE_SHADES.get(p.name, "#999"), alpha=0.07, lw=0
            )
            ax.axvline(p.start, color="#888", lw=0.5, ls=":")
            if p.end - p.start > t.events / 60:
                ax.text(
                    (p.start + p.end) / 2,
                    top * 0.97,
                    f"{p.name[:3]} {p.call}",
                    ha="center",
                    va="top",
                    fontsize=7,
                )
        peak_x = max(t.peak_index, 0)
        (mark,) = ax.plot([peak_x], [t.peak_bytes / scale], marker="o", ms=10, mfc="none", mec="#c00", mew=2)
        mark.set_gid(f"peak-{salt}")
        alive = sorted(((b, c) for c, b in t.at_peak.items() if b), reverse=True)[:3]
        ax.annotate(
            f"peak {format_bytes(t.peak_bytes)} with the model's storages "
            f"(the steps' own: {format_bytes(t.traced_peak_bytes)}): "
            + ", ".join(f"{c} {format_bytes(b)}" for b, c in alive),
            (peak_x, t.peak_bytes / scale),
            textcoords="offset points",
            xytext=(0, 10),
            ha="center"
            if 0.2 < peak_x / max(t.events, 1) < 0.8
            else ("left" if peak_x < t.events / 2 else "right"),
            color="#c00",
            fontsize=8,
        )
        ax.set_ylim(0, top)
        ax.set_xlim(0, max(t.events, 1))
        ax.set_xlabel("allocation events through the steps")
        ax.set_ylabel(unit)
        if title:
            ax.set_title(title, fontsize=10)
        ax.legend(
            fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="category", title_fontsize=8
        )
        ax.grid(alpha=0.3)
    except BaseException:
        plt.close(fig)
        raise
    return fig


def layers_svg(report: AuditReport, salt: str) -> str:
    """Saved bytes per decoder layer, stacked: saved activations under weight copies."""
    plt = _pyplot()
    rows = report.layers
    fig, ax = plt.subplots(figsize=(11, 3))
    try:
        xs = list(range(len(rows)))
        peak = max((r.saved_bytes for r in rows), default=0)
        scale, unit = _unit(peak)
        act = [r.activation_bytes / scale for r in rows]
        ax.bar(xs, act, color=CATEGORY_COLOURS["saved activations"], label="saved activations")
        ax.bar(
            xs,
            [r.weight_copy_bytes / scale for r in rows],
            bottom=act,
            color=CATEGORY_COLOURS["weight copies"],
            label="weight copies",
        )
        step = max(1, len(rows) // 32)
        ax.set_xticks(
            xs[::step], [short_layer_name(r.name) for r in rows][::step], rotation=45, ha="right", fontsize=7
        )
        ax.set_ylabel(f"saved {unit}")
        ax.set_title("kept for backward, per decoder layer (the ledger's first step)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        return _figure_svg(fig, salt)
    finally:
        plt.close(fig)


def _verdict_html(report: AuditReport) -> str:
    e = html.escape
    v = report.verdict
    out = [f"<p class='verdict {'ok' if v.ok else 'problem'}'>{e(v.line)}</p>"]
    if v.problems or v.notes:
        out.append("<ul>")
        out += [f"<li class='problem'>{e(m)}</li>" for m in v.problems]
        out += [f"<li class='note'>{e(m)}</li>" for m in v.notes]
        out.append("</ul>")
    return "".join(out)


def _heading(report: AuditReport) -> str:
    c = report.config
    kind = "estimate" if report.estimate is not None else "audit"
    return (
        f"vramguard {kind} {c.get('model')} on {report.device}: {batch_text(c)}, "
        f"LoRA r={c.get('lora_rank')}, compute {c.get('compute_dtype')}, "
        f"checkpointing {'on' if c.get('gradient_checkpointing') else 'off'}"
    )


def _peak_table(t: Timeline) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(c)}</td><td class='num'>{e(format_bytes(b))}</td></tr>"
        for c, b in t.at_peak.items()
        if b
    )
    top = "".join(
        f"<tr><td class='num'>{e(format_bytes(a['bytes']))}</td><td>{e(a['category'])}</td>"
        f"<td>{e(a['where'])}</td></tr>"
        for a in t.top_at_peak
    )
    return (
        f"<table class='at-peak'><tr><th>alive at the peak</th><th>bytes</th></tr>{rows}"
        f"<tr><th>total</th><th class='num'>{e(format_bytes(t.peak_bytes))}</th></tr></table>"
        f"<table class='largest'><tr><th>largest</th><th>category</th><th>made in</th></tr>{top}</table>"
    )


def render_run_html(report: AuditReport) -> str:
    """One run as one self-contained page (its report must have a ``timeline``)."""
    t = report.timeline
    if t is None:
        raise UsageError("the report has no timeline (run with --html or --snapshot)")
    e = html.escape
    title = _heading(report)
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{e(title)}</title><style>{PAGE_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        "<h2>Verdict</h2>" + _verdict_html(report),
    ]
    if report.estimate is not None:
        est = report.estimate
        out.append(
            f"<p>device estimate {e(format_bytes(est.total_bytes))} = allocator peak "
            f"{e(format_bytes(est.allocator_peak_bytes))} + {e(format_bytes(est.overhead_bytes))} the meta run leaves "
            "out (CUDA context, cuBLAS workspaces, fragmentation): the timeline shows the allocator peak</p>"
            if est.target == "cuda"
            else f"<p>host estimate {e(format_bytes(est.total_bytes))} (--device cpu): the step's tensors at their "
            f"peak, {e(format_bytes(est.allocator_peak_bytes))}, which the timeline shows"
            + (f", + {e(format_bytes(est.overhead_bytes))} of activations offloaded to the host" if est.overhead_bytes else "")
            + "; no GPU overhead is added</p>"
        )
    out += [
        "<h2>Memory through the steps</h2>",
        (
            f"<p>{t.events:,} allocation events; the model's own storages (weights, trainable parameters) stand "
            "under what the steps allocate, so the peak here is theirs and the steps' together, "
            f"{e(format_bytes(t.peak_bytes))}; the steps' own peak, without them, is "
            f"{e(format_bytes(t.traced_peak_bytes))}. Phases: forward (blue), backward (red), optimizer (green).</p>"
        ),
        f"<figure class='plot timeline'>{timeline_svg(t, 'run')}</figure>",
        "<h2 id='peak'>At the peak</h2>" + _peak_table(t),
    ]
    if report.layers:
        out.append(f"<h2>Per layer</h2><figure class='plot layers'>{layers_svg(report, 'layers')}</figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _aligned(t: Timeline) -> list[float]:
    """Each sample's position in phase calls: phase call k (0-based, in order) spans [k, k + 1), so two runs'
    forwards, backwards and optimizer steps line up on one axis whatever their event counts."""
    spans = sorted(t.phases, key=lambda p: p.start)
    out = []
    for i in t.index:
        x = 0.0
        for k, p in enumerate(spans):
            if i >= p.start:
                x = k + min(1.0, (i - p.start) / max(p.end - p.start, 1))
        out.append(x)
    return out


def compare_svg(a: Timeline, b: Timeline, labels: tuple[str, str]) -> str:
    """Both runs' total bytes on one axis (phase calls aligned), each peak ringed (ids ``peak-a``, ``peak-b``)."""
    plt = _pyplot()
    scale, unit = _unit(max(a.peak_bytes, b.peak_bytes))
    fig, ax = plt.subplots(figsize=(11, 4))
    try:
        for t, label, colour, key in ((a, labels[0], "#4e79a7", "a"), (b, labels[1], "#e15759", "b")):
            xs = _aligned(t)
            totals = t.totals()
            ax.step(xs, [v / scale for v in totals], where="post", color=colour, label=label, lw=1.2)
            k = max(range(len(totals)), key=totals.__getitem__)
            (mark,) = ax.plot([xs[k]], [totals[k] / scale], marker="o", ms=10, mfc="none", mec=colour, mew=2)
            mark.set_gid(f"peak-{key}")
            ax.annotate(
                f"peak {format_bytes(t.peak_bytes)}",
                (xs[k], totals[k] / scale),
                textcoords="offset points",
                xytext=(0, 8 if key == "a" else -14),
                ha="center",
                color=colour,
                fontsize=8,
            )
        spans = sorted(a.phases if len(a.phases) >= len(b.phases) else b.phases, key=lambda p: p.start)
        for k, p in enumerate(spans):
            ax.axvspan(k, k + 1, color=PHASE_SHADES.get(p.name, "#999"), alpha=0.07, lw=0)
        ax.set_xticks(
            [k + 0.5 for k in range(len(spans))], [f"{p.name[:3]} {p.call}" for p in spans], fontsize=7
        )
        ax.set_ylabel(unit)
        ax.set_ylim(0, max(a.peak_bytes, b.peak_bytes) / scale * 1.15)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
        return _figure_svg(fig, "cmp")
    finally:
        plt.close(fig)


def layer_diff_svg(a: AuditReport, b: AuditReport, labels: tuple[str, str]) -> str:
    """Per decoder layer, B's saved bytes minus A's, by kind (more in red, less in green)."""
    plt = _pyplot()
    rows_a = {short_layer_name(r.name): r for r in a.layers}
    rows_b = {short_layer_name(r.name): r for r in b.layers}
    names = sorted(set(rows_a) | set(rows_b), key=lambda n: (len(n), n))
    fig, ax = plt.subplots(figsize=(11, 3))
    try:

        def diff(name: str, kind: str) -> float:
            ra, rb = rows_a.get(name), rows_b.get(name)
            return (getattr(rb, kind, 0) if rb else 0) - (getattr(ra, kind, 0) if ra else 0)

        deltas = {k: [diff(n, k) for n in names] for k in ("activation_bytes", "weight_copy_bytes")}
        scale, unit = _unit(max((abs(v) for vs in deltas.values() for v in vs), default=0))
        xs = list(range(len(names)))
        width = 0.4
        for shift, (kind, label) in (
            (-width / 2, ("activation_bytes", "saved activations")),
            (width / 2, ("weight_copy_bytes", "weight copies")),
        ):
            values = [v / scale for v in deltas[kind]]
            ax.bar(
                [x + shift for x in xs],
                values,
                width,
                label=label,
                color=["#c00" if v > 0 else "#070" for v in values],
            )
        ax.axhline(0, color="#222", lw=0.8)
        step = max(1, len(names) // 32)
        ax.set_xticks(xs[::step], names[::step], rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(f"{unit}, {labels[1]} - {labels[0]}")
        ax.set_title(
            "saved for backward per layer: change (left bar activations, right bar weight copies)",
            fontsize=10,
        )
        ax.grid(alpha=0.3, axis="y")
        return _figure_svg(fig, "ldiff")
    finally:
        plt.close(fig)


def render_compare_html(a: AuditReport, b: AuditReport, labels: tuple[str, str]) -> str:
    """Two runs on one page: both timelines on one axis, both peaks marked, the per-layer difference, and a
    table of the headline numbers side by side."""
    if a.timeline is None or b.timeline is None:
        missing = labels[0] if a.timeline is None else labels[1]
        raise UsageError(
            f"{missing} has no timeline: write it with vramguard audit/estimate --json and --html"
        )
    e = html.escape
    fb = format_bytes

    def row(name: str, va: int, vb: int) -> str:
        d = vb - va
        cls = "problem" if d > 0 else "ok"
        return (
            f"<tr><td>{e(name)}</td><td class='num'>{e(fb(va))}</td><td class='num'>{e(fb(vb))}</td>"
            f"<td class='num {cls}'>{e(fb(d, signed=True))}</td></tr>"
        )

    rows = [
        row("peak (with the model's storages)", a.timeline.peak_bytes, b.timeline.peak_bytes),
        row("peak of the steps (the tracker's)", a.timeline.traced_peak_bytes, b.timeline.traced_peak_bytes),
        row("saved for backward", a.totals.saved_bytes, b.totals.saved_bytes),
        row("weight copies", a.totals.weight_copy_bytes, b.totals.weight_copy_bytes),
    ]
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>vramguard compare {e(labels[0])} vs {e(labels[1])}</title><style>{PAGE_CSS}</style></head><body>",
        (
            f"<h1>vramguard compare</h1><p>A: <code>{e(labels[0])}</code> ({e(_heading(a))})<br>"
            f"B: <code>{e(labels[1])}</code> ({e(_heading(b))})</p>"
        ),
        "<table><tr><th></th><th>A</th><th>B</th><th>B - A</th></tr>" + "".join(rows) + "</table>",
        "<h2>Memory through the steps</h2>",
        f"<figure class='plot timeline'>{compare_svg(a.timeline, b.timeline, labels)}</figure>",
        "<h2>Per layer</h2>",
        f"<figure class='plot layers'>{layer_diff_svg(a, b, labels)}</figure>",
        "<h2>Verdicts</h2><h3>A</h3>" + _verdict_html(a) + "<h3>B</h3>" + _verdict_html(b),
        "</body></html>",
    ]
    return "\n".join(out) + "\n"
