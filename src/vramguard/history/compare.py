"""``vramguard compare A B``: memory deltas between two benchmark runs, gated by per-metric thresholds.

pytest-benchmark compares timings only; the memory numbers live in ``extra_info["vramguard"]``.
Benchmarks are matched by name (without the parameter suffix) plus their parameters. Every metric
has a direction (all of vramguard's are "lower is better") and a threshold; a change beyond the
threshold in the bad direction is a regression. Missing data is never a pass: a benchmark or a
metric the baseline has and the current run lacks (absent or ``null``) fails like a regression
unless missing data is explicitly allowed. Exit codes: 0 no regression, 1 regression or missing
data, 2 bad input (unreadable, malformed, no vramguard memory fields, a benchmark listed twice, a
negative or non-numeric metric, a threshold that matches no metric).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from vramguard.errors import UsageError
from vramguard.units import parse_percent

# The headline metrics a benchmark records; for every one, a larger value is worse.
MEMORY_METRICS: tuple[str, ...] = (
    "peak_allocated",
    "peak_reserved",
    "retained_after_forward",
    "saved_bytes",
    "saved_per_layer_max",
)
# `vramguard estimate`'s own benchmark (benchmarks/test_estimate_speed.py): the command's host RSS and its
# answer (bytes, gated like memory), its wall and CPU seconds (timings: in TIME_METRICS)
ESTIMATE_METRICS: tuple[str, ...] = ("estimate_peak_rss", "estimate_total_bytes", "estimate_allocator_peak")
TIME_METRICS: tuple[str, ...] = ("step_time", "estimate_wall_time", "estimate_cpu_time")
DEFAULT_MEMORY_THRESHOLD = 0.03
# Metrics not gated unless asked (timings on shared runners are noisy).
# timings: reported, gated only on request (--threshold NAME=PCT); *_ratio: instrumented/plain wall ratios
UNGATED_BY_DEFAULT: tuple[str, ...] = (
    "step_time",
    "*.step_time",
    "estimate_wall_time",
    "estimate_cpu_time",
    "*_ratio",
)
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
    # ok, improved, REGRESSION, MISSING (baseline has it, current lacks it or has null; "missing"
    # for a metric not gated, e.g. step_time), new (only the current run has it), n/a (null on both)
    status: str

    @property
    def delta(self) -> float | None:
        """Current minus baseline, None when either side is missing."""
        if self.base is None or self.current is None:
            return None
        return self.current - self.base

    @property
    def relative(self) -> float | None:
        """The change relative to the baseline (infinite when the baseline is 0 and the value grew), None when
        a side is missing."""
        if self.delta is None or self.base is None:
            return None
        if self.base == 0:
            return 0.0 if self.delta == 0 else math.copysign(math.inf, self.delta)
        return self.delta / abs(self.base)

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON, with its delta and relative change."""
        return dict(asdict(self), delta=self.delta, relative=self.relative)


@dataclass
class Comparison:
    """Two runs matched benchmark by benchmark and metric by metric, with what only one side has and the
    library versions that changed."""

    baseline_label: str
    current_label: str
    rows: list[Row]
    only_baseline: list[BenchKey]
    only_current: list[BenchKey]
    version_changes: dict[str, tuple[Any, Any]]
    allow_missing: bool = False  # a benchmark or metric missing from the current run passes
    fail_on_new: bool = False  # a benchmark or metric only the current run has fails

    @property
    def regressions(self) -> list[Row]:
        """The rows that got worse beyond their threshold."""
        return [r for r in self.rows if r.status == "REGRESSION"]

    @property
    def missing(self) -> int:
        """Benchmarks and metrics the baseline has and the current run lacks."""
        return len(self.only_baseline) + sum(r.status == "MISSING" for r in self.rows)

    @property
    def new(self) -> int:
        """Benchmarks and metrics only the current run has."""
        return len(self.only_current) + sum(r.status == "new" for r in self.rows)

    @property
    def failed(self) -> bool:
        """Whether the gate fails: a regression, missing data unless allowed, or new data when that is asked
        to fail."""
        return bool(
            self.regressions or (self.missing and not self.allow_missing) or (self.new and self.fail_on_new)
        )

    def verdict(self) -> str:
        """One line: ``no regression`` only when nothing failed."""
        parts = [f"{len(self.regressions)} regression(s)"] if self.regressions else []
        if self.missing:
            allowed = " (allowed)" if self.allow_missing else ""
            parts.append(f"{self.missing} missing from the current run{allowed}")
        if self.new and self.fail_on_new:
            parts.append(f"{self.new} only in the current run")
        if self.failed:
            return ", ".join(parts)
        return "no regression" + (f"; {', '.join(parts)}" if parts else "")

    def to_dict(self) -> dict[str, Any]:
        """The comparison as the JSON ``compare --json`` writes: verdict, counts, rows and what is missing or
        new."""
        return {
            "baseline": self.baseline_label,
            "current": self.current_label,
            "failed": self.failed,
            "verdict": self.verdict(),
            "regressions": len(self.regressions),
            "missing": self.missing,
            "allow_missing": self.allow_missing,
            "rows": [r.to_dict() for r in self.rows],
            "only_baseline": [list(k) for k in self.only_baseline],
            "only_current": [list(k) for k in self.only_current],
            "version_changes": {k: list(v) for k, v in self.version_changes.items()},
        }


# reading ----------------------------------------------------------------------------------
def params_label(params: str) -> str:
    """A benchmark's parameters (their JSON) as ``k=v,k=v`` for a table or a message."""
    data = json.loads(params)
    return ",".join(f"{k}={v}" for k, v in data.items()) if isinstance(data, dict) else params


def _object(value: Any, where: str) -> dict[str, Any]:
    """``value`` as a JSON object (absent -> empty); UsageError (one line) for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where} is not an object but {type(value).__name__}")
    return value


def _number(value: Any, where: str) -> float | None:
    """A metric value: a finite, non-negative float, or None for ``null``; UsageError for anything else.

    Every metric vramguard records is a byte count or seconds: a string, a boolean, NaN, infinity
    or a negative number is a broken document, never a measurement (a negative peak would read as
    an improvement).
    """
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UsageError(f"{where} is not a number: {value!r}"[:300])
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise UsageError(f"{where} is not a finite number: {value!r}"[:300])
    if out < 0:
        raise UsageError(f"{where} is negative: {value!r} (bytes and seconds never are)"[:300])
    return out


def _payload(bench: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A benchmark's ``extra_info.vramguard`` block, or None for a benchmark vramguard did not record."""
    payload = _object(bench.get("extra_info"), f"{where}: extra_info").get("vramguard")
    return None if payload is None else _object(payload, f"{where}: extra_info.vramguard")


def bench_key(bench: dict[str, Any]) -> BenchKey:
    """(name without ``[...]``, canonical JSON of the parameters)."""
    name = str(bench.get("name") or bench.get("fullname") or "?").split("[", 1)[0]
    params = bench.get("params")
    if params is None:
        params = (_payload(bench, name) or {}).get("params")
    return name, json.dumps(params or {}, sort_keys=True, default=str)


def metrics_of(bench: dict[str, Any], label: str = "benchmark") -> dict[str, float | None]:
    """Flat metrics: the top-level ones plus ``<phase>.peak_allocated`` / ``<phase>.peak_reserved``.

    A metric recorded as ``null`` (e.g. ``peak_reserved`` on CPU) is kept as None, so that a current
    run with ``null`` where the baseline has a number reads as missing, not as absent-on-both.
    """
    where = f"{label}: {str(bench.get('name') or bench.get('fullname') or '?')[:100]}"
    payload = _payload(bench, where) or {}
    out: dict[str, float | None] = {}
    for name, value in _object(payload.get("metrics"), f"{where}: metrics").items():
        out[name] = _number(value, f"{where}: metric {name}")
    for phase, stats in _object(payload.get("phases"), f"{where}: phases").items():
        for name, value in _object(stats, f"{where}: phase {phase}").items():
            out[f"{phase}.{name}"] = _number(value, f"{where}: {phase}.{name}")
    stats = _object(bench.get("stats"), f"{where}: stats")
    if out.get("step_time") is None and stats.get("mean") is not None:
        out["step_time"] = _number(stats.get("mean"), f"{where}: stats.mean")
    return out


def entries(doc: dict[str, Any], label: str) -> dict[BenchKey, dict[str, float | None]]:
    """The memory benchmarks of a run (those with ``extra_info.vramguard``), by key.

    UsageError when the run has none (a plain pytest-benchmark file, ``benchmarks: []``), or when a
    benchmark appears twice (which copy is the measurement?).
    """
    benchmarks = doc.get("benchmarks")
    if not isinstance(benchmarks, list):
        raise UsageError(f"{label}: no 'benchmarks' list")
    out: dict[BenchKey, dict[str, float | None]] = {}
    for bench in benchmarks:
        if not isinstance(bench, dict):
            raise UsageError(f"{label}: a benchmark entry is not an object")
        where = f"{label}: {str(bench.get('name') or bench.get('fullname') or '?')[:100]}"
        if _payload(bench, where) is None:
            continue  # a timing-only benchmark: not vramguard's to gate
        metrics = metrics_of(bench, label)  # first: its errors name the run and the benchmark
        key = bench_key(bench)
        if key in out:
            raise UsageError(
                f"{label}: benchmark {key[0]} {params_label(key[1])} appears more than once "
                "(a run holds each benchmark once)"[:400]
            )
        out[key] = metrics
    if not any(set(m) - set(TIME_METRICS) for m in out.values()):
        if not benchmarks:
            raise UsageError(f"{label} holds no benchmarks; nothing to compare")
        raise UsageError(
            f"{label} has no vramguard memory fields (extra_info.vramguard.metrics) in its "
            f"{len(benchmarks)} benchmark(s): not written by vramguard's benchmarks; nothing to compare"
        )
    return out


def versions(doc: dict[str, Any], label: str = "run") -> dict[str, Any]:
    """The library versions and device of a run (its ``machine_info.vramguard`` block); a malformed one is a
    UsageError naming ``label``."""
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


def known_metrics(*docs: dict[str, Any]) -> set[str]:
    """Metric names a threshold may name: vramguard's own plus every metric the documents record."""
    names = set(MEMORY_METRICS) | set(TIME_METRICS)
    for doc in docs:
        for metrics in entries(doc, "run").values():
            names |= set(metrics)
    return names


def check_thresholds(thresholds: dict[str, float | None], known: set[str]) -> None:
    """UsageError for a threshold that matches no metric (a misspelt name would silently gate nothing)."""
    for pattern in thresholds:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
            raise UsageError(
                f"threshold {pattern!r} matches no metric; known: {', '.join(sorted(known))}"[:600]
            )


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
    """The status of one metric: ``REGRESSION`` when it got worse by more than ``threshold`` (a fraction of
    the baseline), ``improved``, or ``ok``."""
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
    allow_missing: bool = False,
    fail_on_new: bool = False,
) -> Comparison:
    """Match benchmarks by name + params and judge every metric either side records.

    A gated metric with a number in the baseline and none (absent or ``null``) in the current run
    is ``MISSING`` (``missing`` when not gated: reported only); one only the current run has is
    ``new``; ``null`` or absent on both is ``n/a``.
    """
    thresholds = thresholds or {}
    a, b = entries(baseline, baseline_label), entries(current, current_label)
    check_thresholds(thresholds, known_metrics(baseline, current))
    rows: list[Row] = []
    for key in sorted(set(a) & set(b)):
        for metric in sorted(set(a[key]) | set(b[key])):
            base, cur = a[key].get(metric), b[key].get(metric)
            thr = threshold_for(metric, thresholds, default)
            if base is not None and cur is not None:
                status = judge(metric, base, cur, thr)
            elif base is not None:  # fails only where gated: an ungated metric is reported, not judged
                status = "MISSING" if thr is not None else "missing"
            else:
                status = "new" if cur is not None else "n/a"
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
        allow_missing=allow_missing,
        fail_on_new=fail_on_new,
    )


# options ----------------------------------------------------------------------------------
def gate_options() -> list[tuple[str, dict[str, Any]]]:
    """The gate's options, defined once for ``vramguard compare`` (``--NAME``) and the pytest plugin
    (``--vram-NAME``): argparse's ``add_argument`` and pytest's ``addoption`` take the same keywords."""
    return [
        (
            "threshold",
            {
                "action": "append",
                "default": [],
                "metavar": "METRIC=PCT",
                "help": "per-metric threshold, e.g. peak_allocated=3%% or 'forward.*=5%%' or step_time=20%%; "
                "METRIC=off reports without gating; a METRIC that matches no metric is an error (repeatable)",
            },
        ),
        (
            "fail-above",
            {
                "default": None,
                "metavar": "PCT",
                "help": f"default threshold for memory metrics (default {DEFAULT_MEMORY_THRESHOLD * 100:g}%%)",
            },
        ),
        (
            "allow-missing",
            {
                "action": "store_true",
                "default": False,
                "help": "pass although a benchmark or metric of the baseline is missing from (or null in) "
                "the current run; without it, missing data fails like a regression",
            },
        ),
    ]


def add_gate_options(add_option: Callable[..., Any], prefix: str = "") -> None:
    """Register :func:`gate_options` with ``add_option`` (``parser.add_argument`` / ``group.addoption``)."""
    for name, kwargs in gate_options():
        add_option(f"--{prefix}{name}", **kwargs)


@dataclass(frozen=True)
class Gate:
    """What fails a comparison: thresholds, and whether missing / new data counts."""

    thresholds: dict[str, float | None]
    default: float | None = DEFAULT_MEMORY_THRESHOLD
    allow_missing: bool = False
    fail_on_new: bool = False

    @classmethod
    def from_options(
        cls, threshold: list[str], fail_above: str | None, allow_missing: bool, fail_on_new: bool = False
    ) -> Gate:
        """From the option values; UsageError (one line) for a malformed threshold or percentage."""
        default = DEFAULT_MEMORY_THRESHOLD if fail_above is None else parse_percent(fail_above)
        return cls(parse_thresholds(threshold), default, allow_missing, fail_on_new)

    def compare(
        self, baseline: dict[str, Any], current: dict[str, Any], baseline_label: str, current_label: str
    ) -> Comparison:
        """Compare two run documents with this gate's thresholds and missing-data rules."""
        return compare_docs(
            baseline,
            current,
            self.thresholds,
            self.default,
            baseline_label,
            current_label,
            self.allow_missing,
            self.fail_on_new,
        )
