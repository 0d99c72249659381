"""The data behind ``vramguard report`` (series, regressions and who introduced them, per-layer bars)
and the HTML / markdown rendering, from stores built here record by record."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vramguard.cli import main
from vramguard.errors import UsageError
from vramguard.history.store import ResultStore
from vramguard.history.trend import build
from vramguard.view.html import render_html, render_markdown

MiB = 2**20


def doc(bnb: str, peak: float | None, saved: int = 10 * MiB, layers: dict | None = None, **more: Any) -> dict:
    payload: dict[str, Any] = {
        "metrics": {"peak_allocated": peak, "saved_bytes": saved, "peak_reserved": None, **more},
    }
    if layers is not None:
        payload["saved_per_layer"] = {
            "by_layer": {k: sum(v.values()) for k, v in layers.items()},
            "by_layer_kind": layers,
        }
    return {
        "machine_info": {
            "vramguard": {"packages": {"torch": "2.13.0", "bitsandbytes": bnb}, "device": "cpu"}
        },
        "benchmarks": [{"name": "test_step[a]", "params": {"seq": 64}, "extra_info": {"vramguard": payload}}],
    }


def store_of(tmp_path: Path, *docs: dict) -> ResultStore:
    store = ResultStore(tmp_path / "store")
    for d in docs:
        store.add(d)
    return store


def series(trend, metric: str):
    (s,) = [s for s in trend.series if s.metric == metric]
    return s


def test_values_per_run_labels_and_the_release_that_introduced_a_regression(tmp_path: Path) -> None:
    store = store_of(
        tmp_path,
        doc("0.49.1", 100 * MiB),
        doc("0.49.2", 101 * MiB),  # +1 %: under the 3 % threshold
        doc("0.50.0", 150 * MiB),  # the step
        doc("0.50.1", 150 * MiB),
        doc("0.50.2", 120 * MiB),  # an improvement is no regression
    )
    trend = build(store)
    assert [r.label for r in trend.runs] == [
        f"bitsandbytes {v}" for v in ("0.49.1", "0.49.2", "0.50.0", "0.50.1", "0.50.2")
    ]
    peak = series(trend, "peak_allocated")
    assert peak.values == [100 * MiB, 101 * MiB, 150 * MiB, 150 * MiB, 120 * MiB]
    (reg,) = trend.regressions
    assert (reg.metric, reg.run, reg.previous, reg.base, reg.current) == (
        "peak_allocated",
        2,
        1,
        101 * MiB,
        150 * MiB,
    )
    assert reg.introduced_by == "bitsandbytes 0.49.2 -> 0.50.0"
    assert [s.metric for s in trend.series] == [
        "peak_allocated",
        "saved_bytes",
    ]  # peak_reserved: null everywhere


def test_threshold_and_gaps(tmp_path: Path) -> None:
    store = store_of(tmp_path, doc("1.0", 100.0), doc("1.1", None), doc("1.2", 110.0))
    trend = build(store, threshold=0.05)
    peak = series(trend, "peak_allocated")
    assert peak.values == [100.0, None, 110.0]
    (reg,) = peak.regressions  # judged against the last run that has the metric, named with both versions
    assert (reg.previous, reg.run, reg.introduced_by) == (0, 2, "bitsandbytes 1.0 -> 1.2")
    assert build(store, threshold=0.2).regressions == []
    assert build(store, threshold=None).regressions == []


def test_repeated_runs_of_one_environment_are_labelled_by_sequence(tmp_path: Path) -> None:
    trend = build(store_of(tmp_path, doc("1.0", 100.0), doc("1.0", 200.0)))
    assert [r.label for r in trend.runs] == ["#1", "#2"]
    assert trend.regressions[0].introduced_by == "no version changed"


def test_layer_bars_of_the_newest_run_and_the_diff_against_the_previous(tmp_path: Path) -> None:
    old = {"model.layers.0": {"activation": 100}, "model.layers.1": {"activation": 100}}
    new = {
        "model.layers.0": {"activation": 100, "weight-copy": 50},
        "model.layers.1": {"activation": 90},
        "model.layers.10": {"activation": 5},
    }
    store = store_of(tmp_path, doc("1.0", 1.0, layers=old), doc("1.1", 1.0, layers=new), doc("1.2", 1.0))
    (bars,) = build(store).layers
    assert (bars.run, bars.previous) == (1, 0)  # the newest run that has per-layer data
    assert bars.layers == ["model.layers.0", "model.layers.1", "model.layers.10"]  # numeric order
    assert bars.kinds == {"activation": [100, 90, 5], "weight-copy": [50, 0, 0]}
    assert bars.diff == [50, -10, None]


def test_runs_without_memory_fields_are_listed_and_an_empty_store_is_an_error(tmp_path: Path) -> None:
    store = store_of(tmp_path, doc("1.0", 1.0), {"machine_info": {}, "benchmarks": []})
    trend = build(store)
    assert (
        len(trend.runs) == 1 and len(trend.skipped_runs) == 1 and "no benchmarks" in trend.skipped_runs[0][1]
    )
    with pytest.raises(UsageError, match="holds no runs"):
        build(ResultStore(tmp_path / "empty"))


def test_records_of_another_shape_are_skipped_with_the_reason_and_the_rest_is_drawn(tmp_path: Path) -> None:
    """Found by fuzzing ``report``: each of these was an internal error (AttributeError, TypeError,
    ValueError) for the whole report. A record whose machine_info or sweep marker is no mapping is now a
    skipped run with its reason; a per-layer byte count that is no number draws no bars for that run."""
    good = doc("1.0", 1.0, layers={"model.layers.0": {"activation": 100}})
    odd_bytes = doc("1.2", 1.0, layers={"model.layers.0": {"activation": 1}})
    odd_bytes["benchmarks"][0]["extra_info"]["vramguard"]["saved_per_layer"]["by_layer_kind"] = {
        "model.layers.0": {"activation": "abc"}
    }
    store = store_of(tmp_path, good)
    odd_info = store.add(doc("1.1", 1.0))  # then edited by hand (ResultStore.add refuses such a record)
    odd_info.write_text(json.dumps({**json.loads(odd_info.read_text()), "machine_info": "abc"}))
    store.add(odd_bytes)
    swept = doc("1.3", 1.0)
    store.add(swept, "run-with-an-odd-marker")
    empty = {"machine_info": swept["machine_info"], "benchmarks": []}
    marker = store.add(empty, "run-with-an-odd-marker", "sweep")
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "vramguard_sweep": "ok"}))
    trend = build(store)
    assert [r.versions["bitsandbytes"] for r in trend.runs] == ["1.0", "1.2"]
    reasons = dict(trend.skipped_runs)
    assert len(reasons) == 2
    assert "its sweep record holds str" in reasons["run-with-an-odd-marker"]
    assert any("'str' object has no attribute 'get'" in why for why in reasons.values())
    (bars,) = build(store).layers
    assert bars.run == 0 and bars.kinds == {"activation": [100]}  # run 1.2's count is no number: no bars
    render_html(trend, "s")
    only_odd = store_of(tmp_path / "only-odd")
    (tmp_path / "only-odd").mkdir(exist_ok=True)
    odd = only_odd.add(doc("1.1", 1.0))
    odd.write_text(json.dumps({**json.loads(odd.read_text()), "machine_info": ["abc"]}))
    with pytest.raises(UsageError, match=r"memory fields \(run .*: not a vramguard record"):
        build(only_odd)


def test_html_is_self_contained_and_marks_the_regression(tmp_path: Path) -> None:
    layers = {"model.layers.0": {"activation": 100, "weight-copy": 50}}
    store = store_of(
        tmp_path, doc("0.49.2", 100 * MiB, layers=layers), doc("0.50.0", 150 * MiB, layers=layers)
    )
    trend = build(store)
    page = render_html(trend, "store")
    assert page.count("<svg") == 3  # peak_allocated, saved_bytes, the layer figure
    assert len(re.findall(r'id="regression-f\d+-0"', page)) == 1
    assert "introduced by bitsandbytes 0.49.2 -&gt; 0.50.0" in page
    # nothing to fetch: no scripts, stylesheets, images or fonts from elsewhere
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert not re.search(r"(src|href)=", page.replace('xlink:href="#', ""))
    md = render_markdown(trend, "store")
    assert "at `bitsandbytes 0.50.0`, introduced by bitsandbytes 0.49.2 -> 0.50.0" in md
    assert "**150.00 MiB (regression)**" in md and "| model.layers.0 | 100 B | 50 B | 0 B |" in md


def test_report_cli_writes_both_files_and_rejects_bad_input(tmp_path: Path, capsys) -> None:
    store = store_of(tmp_path, doc("1.0", 100.0), doc("1.1", 200.0))
    out, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(store.root), "-o", str(out), "--markdown", str(md)]) == 0
    assert "1 regression(s)" in capsys.readouterr().out
    assert out.read_text().startswith("<!DOCTYPE html>") and md.read_text().startswith("## vramguard report")
    for argv, needle in (
        (["report", str(tmp_path / "nope")], "no such directory"),
        (["report", str(tmp_path)], "not a results store"),
        (["report", str(store.root), "--fail-above", "x"], ""),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_a_sweep_marker_is_shown_with_its_run(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "store")
    first = doc("1.0", 100.0)
    path = store.add(first, "run-a")
    marker = {
        "machine_info": first["machine_info"],
        "benchmarks": [],
        "vramguard_sweep": {"package": "bitsandbytes", "version": "1.0", "outcome": "failed", "exit_code": 1},
    }
    store.add(marker, "run-a", "sweep")
    trend = build(store)
    assert path.is_file() and len(trend.runs) == 1 and trend.runs[0].sweep["outcome"] == "failed"
    assert "failed (exit 1)" in render_markdown(trend, "s")
