"""The data behind ``vramguard report``: every headline metric of every benchmark across the runs of a
results store, the regressions between consecutive runs, and the newest run's per-layer saved bytes.

A regression is judged as ``vramguard compare`` judges one (:func:`vramguard.history.compare.judge`, the same
default threshold), between a run and the previous run that has the same benchmark and metric; it
is named with the versions that changed between those two runs (the release that introduced it).
Runs that hold no vramguard memory fields (a sweep release whose command failed before measuring
anything) are listed in ``skipped_runs`` with the reason, never silently dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from vramguard.errors import UsageError
from vramguard.history.compare import (
    DEFAULT_MEMORY_THRESHOLD,
    MEMORY_METRICS,
    entries,
    judge,
    threshold_for,
    versions,
)
from vramguard.history.store import ResultStore

BenchKey = tuple[str, str]


@dataclass
class RunInfo:
    """One run of the store, as the report shows it."""

    seq: int | None
    run_id: str
    key: str
    label: str
    versions: dict[str, Any]  # packages plus cuda / gpu_name / device
    environment: dict[str, Any]  # the machine_info.vramguard block (python, driver, commit, ...)
    datetime: str | None = None
    sweep: dict[str, Any] | None = None  # the sweep marker (package, version, outcome), when swept


@dataclass
class Regression:
    """A metric that got worse beyond the threshold from one run to the next, with the version change that
    came with it."""

    bench: str
    params: str
    metric: str
    run: int  # index into Trend.runs
    previous: int
    base: float
    current: float
    threshold: float
    introduced_by: str  # "bitsandbytes 0.49.2 -> 0.50.0", or "no version changed"

    @property
    def relative(self) -> float:
        """The change relative to the run before (infinite from 0)."""
        return (self.current - self.base) / self.base if self.base else float("inf")


@dataclass
class Series:
    """One metric of one benchmark: a value per run (None where the run lacks it)."""

    bench: str
    params: str
    metric: str
    values: list[float | None]
    regressions: list[Regression] = field(default_factory=list)


@dataclass
class LayerBars:
    """Per decoder layer of one benchmark in the newest run that has it: saved bytes by kind, and the
    change of each layer's total against the previous run with that benchmark (None: no previous)."""

    bench: str
    params: str
    run: int
    previous: int | None
    layers: list[str]
    kinds: dict[str, list[int]]  # "activation" / "weight-copy" (or "saved" when kinds were not recorded)
    diff: list[int | None]


@dataclass
class Trend:
    """What the report plots: the runs in order, one series per benchmark metric, the per-layer bars, and the
    runs that could not be read."""

    runs: list[RunInfo]
    series: list[Series]
    layers: list[LayerBars]
    skipped_runs: list[tuple[str, str]]  # (run id, why)
    threshold: float | None

    @property
    def regressions(self) -> list[Regression]:
        """Every regression of every series."""
        return [r for s in self.series for r in s.regressions]

    def benchmarks(self) -> list[BenchKey]:
        """The (benchmark, params) pairs of the series, in the order first seen."""
        seen: list[BenchKey] = []
        for s in self.series:
            if (s.bench, s.params) not in seen:
                seen.append((s.bench, s.params))
        return seen


def params_label(params: str) -> str:
    """The params JSON of a record as ``k=v,k=v`` for titles (empty for none)."""
    data = json.loads(params)
    return ",".join(f"{k}={v}" for k, v in data.items()) if isinstance(data, dict) and data else ""


def _layer_order(name: str) -> tuple[str, int]:
    m = re.search(r"(\d+)$", name)
    return (name[: m.start()] if m else name, int(m.group(1)) if m else -1)


def _labels(infos: list[RunInfo]) -> None:
    """Label each run by the versions that vary across the store (e.g. ``bitsandbytes 0.50.0``);
    ``#seq`` when nothing varies or to tell repeated labels apart."""
    varying = sorted(
        {k for info in infos for k in info.versions if len({str(i.versions.get(k)) for i in infos}) > 1}
    )
    for n, info in enumerate(infos):
        parts = [f"{k} {info.versions.get(k)}" for k in varying]
        info.label = ", ".join(parts) if parts else f"#{info.seq if info.seq is not None else n + 1}"
    counts: dict[str, int] = {}
    for info in infos:
        counts[info.label] = counts.get(info.label, 0) + 1
    for n, info in enumerate(infos):
        if counts[info.label] > 1:
            info.label += f" (#{info.seq if info.seq is not None else n + 1})"


def _changes(a: RunInfo, b: RunInfo) -> str:
    keys = sorted(set(a.versions) | set(b.versions))
    parts = [
        f"{k} {a.versions.get(k)} -> {b.versions.get(k)}"
        for k in keys
        if a.versions.get(k) != b.versions.get(k)
    ]
    return ", ".join(parts) or "no version changed"


def build(store: ResultStore, threshold: float | None = DEFAULT_MEMORY_THRESHOLD) -> Trend:
    """Everything the report draws, from ``store``; UsageError when it holds no measured run."""
    runs = store.runs()
    if not runs:
        raise UsageError(f"results store {store.root} holds no runs")
    infos: list[RunInfo] = []
    data: list[dict[BenchKey, dict[str, float | None]]] = []
    payloads: list[dict[BenchKey, dict[str, Any]]] = []
    skipped: list[tuple[str, str]] = []
    for run in runs:
        doc = store.load(run)
        try:
            sweep = next(
                (
                    json.loads(f.read_text()).get("vramguard_sweep")
                    for f in run.files
                    if f.name.startswith("sweep-")
                ),
                None,
            )
            if sweep is not None and not isinstance(sweep, dict):
                raise TypeError(f"its sweep record holds {type(sweep).__name__}, not a mapping")
            measured = entries(doc, run.run_id)
            info = (doc.get("machine_info") or {}).get("vramguard") or {}
            if not isinstance(info, dict):
                raise TypeError(f"machine_info.vramguard is {type(info).__name__}, not a mapping")
            run_versions = versions(doc, run.run_id)
            run_payloads = _payloads(doc)
        except UsageError as exc:
            skipped.append((run.run_id, str(exc)))
            continue
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # a record of another shape
            skipped.append((run.run_id, f"not a vramguard record ({type(exc).__name__}: {exc})"))
            continue
        when = doc.get("datetime")
        infos.append(RunInfo(run.seq, run.run_id, run.key, "", run_versions, info, when, sweep))
        data.append(measured)
        payloads.append(run_payloads)
    if not infos:
        others = ", and others" if len(skipped) > 1 else ""
        why = f" (run {skipped[0][0]}: {skipped[0][1]}{others})" if skipped else ""
        raise UsageError(f"results store {store.root} holds no run with vramguard memory fields{why}")
    _labels(infos)
    series = _series(infos, data, threshold)
    return Trend(infos, series, _layers(payloads), skipped, threshold)


def _payloads(doc: dict[str, Any]) -> dict[BenchKey, dict[str, Any]]:
    from vramguard.history.compare import bench_key

    out = {}
    for bench in doc.get("benchmarks") or []:
        payload = (bench.get("extra_info") or {}).get("vramguard") if isinstance(bench, dict) else None
        if isinstance(payload, dict):
            out[bench_key(bench)] = payload
    return out


def _series(
    infos: list[RunInfo], data: list[dict[BenchKey, dict[str, float | None]]], threshold: float | None
) -> list[Series]:
    keys = sorted({k for d in data for k in d})
    out: list[Series] = []
    for key in keys:
        for metric in MEMORY_METRICS:
            values = [d.get(key, {}).get(metric) for d in data]
            if all(v is None for v in values):
                continue  # never recorded (peak_reserved on CPU)
            s = Series(key[0], key[1], metric, values)
            limit = threshold_for(metric, {}, threshold)
            last: int | None = None
            for i, value in enumerate(values):
                if value is None:
                    continue
                if last is not None and limit is not None:
                    base = values[last]
                    assert base is not None
                    if judge(metric, base, value, limit) == "REGRESSION":
                        s.regressions.append(
                            Regression(
                                key[0],
                                key[1],
                                metric,
                                i,
                                last,
                                base,
                                value,
                                limit,
                                _changes(infos[last], infos[i]),
                            )
                        )
                last = i
            out.append(s)
    return out


def _by_kind(payload: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, int]]] | None:
    per = payload.get("saved_per_layer")
    if not isinstance(per, dict) or not isinstance(per.get("by_layer"), dict) or not per["by_layer"]:
        return None
    kinds = per.get("by_layer_kind")
    try:
        if isinstance(kinds, dict) and kinds:
            table = {
                layer: {k: int(v) for k, v in (kinds.get(layer) or {}).items()} for layer in per["by_layer"]
            }
        else:
            table = {layer: {"saved": int(v)} for layer, v in per["by_layer"].items()}
    except (ValueError, TypeError, AttributeError, OverflowError):  # a count that is no number (or inf)
        return None
    return sorted(table, key=_layer_order), table


def _layers(payloads: list[dict[BenchKey, dict[str, Any]]]) -> list[LayerBars]:
    out = []
    for key in sorted({k for p in payloads for k in p}):
        have = [i for i, p in enumerate(payloads) if key in p and _by_kind(p[key]) is not None]
        if not have:
            continue
        newest = have[-1]
        previous = have[-2] if len(have) > 1 else None
        layers, table = _by_kind(payloads[newest][key])  # type: ignore[misc]
        names = sorted({k for row in table.values() for k in row}, key=lambda k: (k != "activation", k))
        kinds = {k: [table[layer].get(k, 0) for layer in layers] for k in names}
        diff: list[int | None] = [None] * len(layers)
        if previous is not None:
            _, before = _by_kind(payloads[previous][key])  # type: ignore[misc]
            diff = [
                sum(table[layer].values()) - sum(before[layer].values()) if layer in before else None
                for layer in layers
            ]
        out.append(LayerBars(key[0], key[1], newest, previous, layers, kinds, diff))
    return out
