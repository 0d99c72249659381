"""``vramguard compare A B``: memory deltas between two benchmark runs, gated by per-metric thresholds.

pytest-benchmark compares timings only; the memory numbers live in ``extra_info["vramguard"]``.
Benchmarks are matched by name (without the parameter suffix) plus their parameters. Every metric
has a direction (all of vramguard's are "lower is better") and a threshold; a change beyond the
threshold in the bad direction is a regression. Exit codes: 0 no regression, 1 regression,
2 bad input.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vramguard.atomic import write_text_atomic
from vramguard.errors import UsageError
from vramguard.store import load_spec
from vramguard.units import format_bytes, parse_percent

# The headline metrics a benchmark records; for every one, a larger value is worse.
MEMORY_METRICS: tuple[str, ...] = (
    "peak_allocated",
    "peak_reserved",
    "retained_after_forward",
    "saved_bytes",
    "saved_per_layer_max",
)
TIME_METRICS: tuple[str, ...] = ("step_time",)
DEFAULT_MEMORY_THRESHOLD = 0.03
# Metrics not gated unless asked (timings on shared runners are noisy).
UNGATED_BY_DEFAULT: tuple[str, ...] = ("step_time", "*.step_time")
HIGHER_IS_BETTER: tuple[str, ...] = ()  # none of vramguard's metrics; kept for user thresholds

BenchKey = tuple[str, str]


@dataclass
class Row:
    """One metric of one benchmark, both sides."""

    name: str
    params: str
    metric: str
    base: float | None
    current: float | None
    threshold: float | None
    status: str  # ok, REGRESSION, improved, only-baseline, only-current, n/a

    @property
    def delta(self) -> float | None:
        if self.base is None or self.current is None:
            return None
        return self.current - self.base

    @property
    def relative(self) -> float | None:
        if self.delta is None or self.base is None:
            return None
        if self.base == 0:
            return 0.0 if self.delta == 0 else math.copysign(math.inf, self.delta)
        return self.delta / abs(self.base)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), delta=self.delta, relative=self.relative)


@dataclass
class Comparison:
    baseline_label: str
    current_label: str
    rows: list[Row]
    only_baseline: list[BenchKey]
    only_current: list[BenchKey]
    version_changes: dict[str, tuple[Any, Any]]

    @property
    def regressions(self) -> list[Row]:
        return [r for r in self.rows if r.status == "REGRESSION"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline_label,
            "current": self.current_label,
            "regressions": len(self.regressions),
            "rows": [r.to_dict() for r in self.rows],
            "only_baseline": [list(k) for k in self.only_baseline],
            "only_current": [list(k) for k in self.only_current],
            "version_changes": {k: list(v) for k, v in self.version_changes.items()},
        }


# reading ----------------------------------------------------------------------------------
def _object(value: Any, where: str) -> dict[str, Any]:
    """``value`` as a JSON object (absent -> empty); UsageError (one line) for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where} is not an object but {type(value).__name__}")
    return value


def _number(value: Any, where: str) -> float | None:
    """A metric value as a finite float; None for non-numbers (not a metric); UsageError for NaN/inf."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise UsageError(f"{where} is not a finite number: {value!r}"[:300])
    return out


def bench_key(bench: dict[str, Any]) -> BenchKey:
    """(name without ``[...]``, canonical JSON of the parameters)."""
    name = str(bench.get("name") or bench.get("fullname") or "?").split("[", 1)[0]
    params = bench.get("params")
    if params is None:
        params = _object(_object(bench.get("extra_info"), "extra_info").get("vramguard"), "vramguard").get(
            "params"
        )
    return name, json.dumps(params or {}, sort_keys=True, default=str)


def metrics_of(bench: dict[str, Any], label: str = "benchmark") -> dict[str, float]:
    """Flat metrics: the top-level ones plus ``<phase>.peak_allocated`` / ``<phase>.peak_reserved``."""
    where = f"{label}: {str(bench.get('name') or bench.get('fullname') or '?')[:100]}"
    extra = _object(bench.get("extra_info"), f"{where}: extra_info")
    payload = _object(extra.get("vramguard"), f"{where}: extra_info.vramguard")
    out: dict[str, float] = {}
    for name, value in _object(payload.get("metrics"), f"{where}: metrics").items():
        number = _number(value, f"{where}: metric {name}")
        if number is not None:
            out[name] = number
    for phase, stats in _object(payload.get("phases"), f"{where}: phases").items():
        for name, value in _object(stats, f"{where}: phase {phase}").items():
            number = _number(value, f"{where}: {phase}.{name}")
            if number is not None:
                out[f"{phase}.{name}"] = number
    stats = _object(bench.get("stats"), f"{where}: stats")
    if "step_time" not in out:
        mean = _number(stats.get("mean"), f"{where}: stats.mean")
        if mean is not None:
            out["step_time"] = mean
    return out


def entries(doc: dict[str, Any], label: str) -> dict[BenchKey, dict[str, float]]:
    out: dict[BenchKey, dict[str, float]] = {}
    for bench in doc.get("benchmarks", []):
        if not isinstance(bench, dict):
            raise UsageError(f"{label}: a benchmark entry is not an object")
        metrics = metrics_of(bench, label)  # first: its errors name the run and the benchmark
        out[bench_key(bench)] = metrics
    return out


def versions(doc: dict[str, Any], label: str = "run") -> dict[str, Any]:
    machine = _object(doc.get("machine_info"), f"{label}: machine_info")
    info = _object(machine.get("vramguard"), f"{label}: machine_info.vramguard")
    out: dict[str, Any] = dict(_object(info.get("packages"), f"{label}: machine_info.vramguard.packages"))
    for extra in ("cuda", "gpu_name", "device"):
        if info.get(extra) is not None:
            out[extra] = info[extra]
    return out


# thresholds -------------------------------------------------------------------------------
def parse_thresholds(items: list[str]) -> dict[str, float | None]:
    """``metric=3%`` (glob patterns allowed, e.g. ``*.peak_reserved=5%``); ``metric=off`` disables."""
    out: dict[str, float | None] = {}
    for item in items:
        metric, sep, value = item.partition("=")
        if not sep or not metric.strip():
            raise UsageError(f"threshold {item!r} must look like METRIC=3% (or METRIC=off)")
        out[metric.strip()] = None if value.strip().lower() in ("off", "none") else parse_percent(value)
    return out


def threshold_for(metric: str, explicit: dict[str, float | None], default: float | None) -> float | None:
    """The last matching explicit pattern wins; else the default for memory metrics."""
    found: tuple[bool, float | None] = (False, None)
    for pattern, value in explicit.items():
        if fnmatch.fnmatchcase(metric, pattern):
            found = (True, value)
    if found[0]:
        return found[1]
    if any(fnmatch.fnmatchcase(metric, p) for p in UNGATED_BY_DEFAULT):
        return None
    return default


def judge(metric: str, base: float, current: float, threshold: float | None) -> str:
    sign = -1.0 if any(fnmatch.fnmatchcase(metric, p) for p in HIGHER_IS_BETTER) else 1.0
    worse = sign * (current - base)
    limit = (threshold or 0.0) * abs(base)
    if threshold is not None and worse > limit:
        return "REGRESSION"
    if worse < 0:
        return "improved"
    return "ok"


def compare_docs(
    baseline: dict[str, Any],
    current: dict[str, Any],
    thresholds: dict[str, float | None] | None = None,
    default: float | None = DEFAULT_MEMORY_THRESHOLD,
    baseline_label: str = "baseline",
    current_label: str = "current",
) -> Comparison:
    """Match benchmarks by name + params and judge every metric present on both sides."""
    thresholds = thresholds or {}
    a, b = entries(baseline, baseline_label), entries(current, current_label)
    rows: list[Row] = []
    for key in sorted(set(a) & set(b)):
        for metric in sorted(set(a[key]) | set(b[key])):
            base, cur = a[key].get(metric), b[key].get(metric)
            thr = threshold_for(metric, thresholds, default)
            status = "n/a" if base is None or cur is None else judge(metric, base, cur, thr)
            rows.append(Row(key[0], key[1], metric, base, cur, thr, status))
    va, vb = versions(baseline, baseline_label), versions(current, current_label)
    changes = {k: (va.get(k), vb.get(k)) for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}
    return Comparison(
        baseline_label,
        current_label,
        rows,
        only_baseline=sorted(set(a) - set(b)),
        only_current=sorted(set(b) - set(a)),
        version_changes=changes,
    )


# reporting --------------------------------------------------------------------------------
def _fmt(metric: str, value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if metric.endswith("step_time"):
        return f"{value:+.3f} s" if signed else f"{value:.3f} s"
    return format_bytes(value, signed=signed)


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return f"{value * 100:+.2f}%"


def _params_label(params: str) -> str:
    data = json.loads(params)
    return ",".join(f"{k}={v}" for k, v in data.items()) if isinstance(data, dict) else params


def _interesting(rows: list[Row], verbose: bool) -> list[Row]:
    """Headline metrics plus anything not ok; every metric with ``verbose``."""
    head = set(MEMORY_METRICS) | {"step_time"}
    return [r for r in rows if verbose or r.metric in head or r.status not in ("ok", "n/a")]


def render(comparison: Comparison, console: Console, verbose: bool = False) -> None:
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
        style = {"REGRESSION": "bold red", "improved": "green"}.get(r.status, "")
        table.add_row(
            r.name,
            _params_label(r.params),
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
        console.print(f"only in baseline: {key[0]} {_params_label(key[1])}")
    for key in comparison.only_current:
        console.print(f"only in current:  {key[0]} {_params_label(key[1])}")
    n = len(comparison.regressions)
    console.print(f"[bold red]{n} regression(s)[/]" if n else "[green]no regression[/]")


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
        status = f"**{r.status}**" if r.status == "REGRESSION" else r.status
        thr = "-" if r.threshold is None else f"{r.threshold * 100:g}%"
        lines.append(
            f"| {r.name} | {_params_label(r.params)} | {r.metric} | {_fmt(r.metric, r.base)} | "
            f"{_fmt(r.metric, r.current)} | {_fmt(r.metric, r.delta, True)} | {_pct(r.relative)} | {thr} | {status} |"
        )
    lines.append("")
    lines += [f"- only in baseline: `{k[0]}` {_params_label(k[1])}" for k in comparison.only_baseline]
    lines += [f"- only in current: `{k[0]}` {_params_label(k[1])}" for k in comparison.only_current]
    n = len(comparison.regressions)
    lines.append(f"**{n} regression(s)**" if n else "No regression.")
    return "\n".join(lines) + "\n"


# CLI ----------------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compare",
        help="memory deltas between two benchmark runs; exit 1 on a regression",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "baseline",
        help="benchmark JSON file, a run directory, or a results store [@latest|@previous|@RUN_ID]",
    )
    p.add_argument("current", help="same forms as BASELINE")
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="METRIC=PCT",
        help="per-metric threshold, e.g. peak_allocated=3%% or 'forward.*=5%%' or step_time=20%%; "
        "METRIC=off reports without gating",
    )
    p.add_argument(
        "--fail-above",
        default=None,
        metavar="PCT",
        help=f"default threshold for memory metrics (default {DEFAULT_MEMORY_THRESHOLD:.0%})",
    )
    p.add_argument(
        "--fail-on-missing", action="store_true", help="also fail when a benchmark is on one side only"
    )
    p.add_argument(
        "--markdown", type=Path, metavar="FILE", help="append a Markdown report (e.g. $GITHUB_STEP_SUMMARY)"
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="write the comparison as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="show every metric, not only headline ones")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    thresholds = parse_thresholds(args.threshold)
    default = DEFAULT_MEMORY_THRESHOLD if args.fail_above is None else parse_percent(args.fail_above)
    base_doc, base_label = load_spec(args.baseline)
    cur_doc, cur_label = load_spec(args.current)
    comparison = compare_docs(base_doc, cur_doc, thresholds, default, base_label, cur_label)
    if not comparison.rows and not comparison.only_baseline and not comparison.only_current:
        raise UsageError("both runs are empty: nothing to compare")
    render(comparison, Console(file=sys.stdout, width=200 if not sys.stdout.isatty() else None), args.verbose)
    try:
        if args.markdown:
            with open(args.markdown, "a") as fh:
                fh.write(markdown(comparison, args.verbose))
        if args.json:
            write_text_atomic(args.json, json.dumps(comparison.to_dict(), indent=1, default=str))
    except OSError as exc:
        raise UsageError(f"cannot write report: {exc}") from None
    failed = bool(comparison.regressions) or (
        args.fail_on_missing and bool(comparison.only_baseline or comparison.only_current)
    )
    return 1 if failed else 0
