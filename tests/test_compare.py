"""``vramguard compare``: regressions beyond a threshold fail, unchanged runs pass, bad input exits 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from vramguard.cli import main
from vramguard.errors import UsageError
from vramguard.history.compare import compare_docs, parse_thresholds
from vramguard.history.store import ResultStore

GIB = 2**30


def _bench(case: str, peak: float, time_s: float = 1.0) -> dict:
    params = {"model": "small-llama", "seq_len": 512, "case": case}
    return {
        "name": f"test_qlora_step_gpu[{case}]",
        "params": params,
        "stats": {"mean": time_s},
        "extra_info": {
            "vramguard": {
                "params": params,
                "metrics": {
                    "peak_allocated": peak,
                    "peak_reserved": peak * 1.1,
                    "retained_after_forward": peak / 2,
                    "saved_bytes": peak / 3,
                    "saved_per_layer_max": peak / 12,
                    "step_time": time_s,
                },
                "phases": {
                    "forward": {"peak_allocated": peak * 0.8, "peak_reserved": peak},
                    "backward": {"peak_allocated": peak, "peak_reserved": peak * 1.1},
                },
            }
        },
    }


def _doc(bnb: str = "0.49.2", **overrides: float) -> dict:
    peaks = {"a": 9.1 * GIB, "b": 4.0 * GIB}
    peaks.update(overrides)
    return {
        "machine_info": {
            "vramguard": {
                "device": "cuda",
                "gpu_name": "NVIDIA H100",
                "packages": {"torch": "2.13.0", "bitsandbytes": bnb},
            }
        },
        "benchmarks": [_bench(case, peak) for case, peak in peaks.items()],
    }


def _write(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def _inject(doc: dict, case: str, metric: str, factor: float) -> dict:
    doc = copy.deepcopy(doc)
    for bench in doc["benchmarks"]:
        if bench["params"]["case"] == case:
            bench["extra_info"]["vramguard"]["metrics"][metric] *= factor
    return doc


def test_unchanged_run_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _write(tmp_path / "a.json", _doc())
    cur = _write(tmp_path / "b.json", _doc())
    assert main(["compare", base, cur]) == 0
    out = capsys.readouterr().out
    assert "no regression" in out and "REGRESSION" not in out


def test_injected_five_percent_regression_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _write(tmp_path / "a.json", _doc())
    cur = _write(tmp_path / "b.json", _inject(_doc("0.50.0"), "b", "peak_allocated", 1.05))
    assert main(["compare", base, cur]) == 1
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "REGRESSION" in row)
    assert "peak_allocated" in line and "case=b" in line and "+5.00%" in line
    assert "bitsandbytes: 0.49.2 -> 0.50.0" in out
    assert "1 regression(s)" in out


def test_threshold_per_metric_and_direction(tmp_path: Path) -> None:
    base = _write(tmp_path / "a.json", _doc())
    up5 = _write(tmp_path / "up.json", _inject(_doc(), "a", "peak_allocated", 1.05))
    up2 = _write(tmp_path / "up2.json", _inject(_doc(), "a", "peak_allocated", 1.02))
    down = _write(tmp_path / "down.json", _inject(_doc(), "a", "peak_allocated", 0.90))
    assert main(["compare", base, up2]) == 0  # below the default 3 %
    assert main(["compare", base, up5, "--threshold", "peak_allocated=10%"]) == 0
    assert main(["compare", base, up5, "--fail-above", "10%"]) == 0
    assert main(["compare", base, up2, "--threshold", "peak_*=1%"]) == 1
    assert main(["compare", base, up5, "--threshold", "peak_allocated=off"]) == 0
    assert main(["compare", base, down]) == 0  # less memory is an improvement, never a failure


def test_step_time_reported_but_gated_only_on_request(tmp_path: Path) -> None:
    base = _write(tmp_path / "a.json", _doc())
    slow = _write(tmp_path / "slow.json", _inject(_doc(), "a", "step_time", 1.5))
    assert main(["compare", base, slow]) == 0
    assert main(["compare", base, slow, "--threshold", "step_time=20%"]) == 1


def test_overhead_ratios_reported_but_gated_only_on_request(tmp_path: Path) -> None:
    """``*_ratio`` (benchmarks/test_overhead.py: instrumented / plain wall time) are timings, noisy on
    shared runners: like step_time, not gated unless asked."""

    def with_ratio(value: float) -> dict:
        doc = _doc()
        for bench in doc["benchmarks"]:
            bench["extra_info"]["vramguard"]["metrics"]["tracker_ratio"] = value
        return doc

    base = _write(tmp_path / "a.json", with_ratio(1.2))
    slow = _write(tmp_path / "slow.json", with_ratio(1.8))
    assert main(["compare", base, slow]) == 0
    assert main(["compare", base, slow, "--threshold", "*_ratio=10%"]) == 1


def test_phase_metrics_are_compared(tmp_path: Path) -> None:
    doc = _doc()
    worse = copy.deepcopy(doc)
    worse["benchmarks"][0]["extra_info"]["vramguard"]["phases"]["forward"]["peak_allocated"] *= 1.2
    result = compare_docs(doc, worse)
    assert [(r.metric, r.status) for r in result.regressions] == [("forward.peak_allocated", "REGRESSION")]


def test_one_sided_benchmarks_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base_doc = _doc(c=1.0 * GIB)
    cur_doc = _doc(d=2.0 * GIB)
    base = _write(tmp_path / "a.json", base_doc)
    cur = _write(tmp_path / "b.json", cur_doc)
    assert main(["compare", base, cur]) == 1  # case c is missing from the current run
    out = capsys.readouterr().out
    assert "only in baseline: test_qlora_step_gpu" in out and "case=c" in out
    assert "only in current:  test_qlora_step_gpu" in out and "case=d" in out
    assert out.rstrip().endswith("1 missing from the current run") and "no regression" not in out
    assert main(["compare", base, cur, "--allow-missing"]) == 0
    assert "no regression; 1 missing from the current run (allowed)" in capsys.readouterr().out
    # a benchmark only the current run has is new, not missing: it fails only when asked
    new = _write(tmp_path / "new.json", _doc(c=1.0 * GIB, d=2.0 * GIB))
    assert main(["compare", base, new]) == 0
    assert main(["compare", base, new, "--fail-on-new"]) == 1
    assert main(["compare", base, new, "--fail-on-missing"]) == 1  # the old flag: both sides must match
    assert main(["compare", base, cur, "--allow-missing", "--fail-on-missing"]) == 2


def test_names_and_labels_are_printed_as_they_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Parameter values and paths are printed as they are: read as rich markup, ``[r8]`` was an unknown style
    and vanished from the line, and ``[/]`` made ``compare`` an internal error."""
    folder = tmp_path / "runs[/]x"  # the folders "runs[" and "]x"
    folder.mkdir(parents=True)
    base_doc, cur_doc = _doc(**{"[r8]": 1.0 * GIB}), _doc(**{"[/]": 2.0 * GIB})
    for doc in (base_doc, cur_doc):
        doc["benchmarks"][0]["extra_info"]["vramguard"]["metrics"]["[b]odd[/b]"] = 1.0
    base, cur = _write(folder / "a.json", base_doc), _write(folder / "b.json", cur_doc)
    assert main(["compare", base, cur, "--verbose"]) == 1
    out = capsys.readouterr().out
    assert f"baseline: {base}" in out and f"current:  {cur}" in out
    assert "only in baseline: test_qlora_step_gpu case=[r8]," in out
    assert "only in current:  test_qlora_step_gpu case=[/]," in out
    assert "[b]odd[/b]" in out


def _edit_metric(doc: dict, case: str, metric: str, value: object = "delete") -> dict:
    doc = copy.deepcopy(doc)
    for bench in doc["benchmarks"]:
        if bench["params"]["case"] == case:
            metrics = bench["extra_info"]["vramguard"]["metrics"]
            if value == "delete":
                del metrics[metric]
            else:
                metrics[metric] = value
    return doc


@pytest.mark.parametrize("value", ["delete", None], ids=["lost", "null"])
def test_a_metric_missing_from_the_current_run_fails(tmp_path, capsys, value) -> None:
    base = _write(tmp_path / "a.json", _doc())
    cur = _write(tmp_path / "b.json", _edit_metric(_doc(), "b", "saved_bytes", value))
    assert main(["compare", base, cur]) == 1
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "MISSING" in row)
    assert "saved_bytes" in line and "case=b" in line
    assert "1 missing from the current run" in out and "no regression" not in out
    assert main(["compare", base, cur, "--allow-missing"]) == 0
    report = tmp_path / "r.json"
    assert main(["compare", base, cur, "--json", str(report)]) == 1
    data = json.loads(report.read_text())
    assert data["failed"] is True and data["missing"] == 1 and data["regressions"] == 0


def test_a_missing_ungated_metric_is_reported_not_judged(tmp_path: Path) -> None:
    base = _write(tmp_path / "a.json", _doc())
    cur_doc = _edit_metric(_doc(), "a", "step_time")
    del cur_doc["benchmarks"][0]["stats"]  # no timing at all (pytest-benchmark under xdist)
    cur = _write(tmp_path / "b.json", cur_doc)
    assert main(["compare", base, cur]) == 0  # step_time is not gated by default
    assert main(["compare", base, cur, "--threshold", "step_time=20%"]) == 1


def test_null_on_both_sides_and_new_metrics_pass(tmp_path: Path) -> None:
    """peak_reserved is null on CPU in both runs: nothing to compare, nothing missing."""
    base_doc = _edit_metric(_doc(), "a", "peak_reserved", None)
    base = _write(tmp_path / "a.json", base_doc)
    assert main(["compare", base, _write(tmp_path / "b.json", base_doc)]) == 0
    result = compare_docs(base_doc, _doc())  # the current run now records peak_reserved for case a
    assert [(r.metric, r.status) for r in result.rows if r.status not in ("ok",)] == [
        ("peak_reserved", "new")
    ]
    assert not result.failed and result.verdict() == "no regression"


def test_store_run_against_store_run_and_reports(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "store")
    store.add(_doc(), run_id="20260101T000000Z-night1")
    store.add(_inject(_doc("0.50.0"), "a", "peak_allocated", 1.05), run_id="20260102T000000Z-night2")
    summary, report = tmp_path / "summary.md", tmp_path / "report.json"
    rc = main(
        [
            "compare",
            f"{store.root}@previous",
            f"{store.root}@latest",
            "--markdown",
            str(summary),
            "--json",
            str(report),
        ]
    )
    assert rc == 1
    assert "**REGRESSION**" in summary.read_text() and "`0.49.2` → `0.50.0`" in summary.read_text()
    data = json.loads(report.read_text())
    assert data["regressions"] == 1 and data["version_changes"]["bitsandbytes"] == ["0.49.2", "0.50.0"]
    assert main(["compare", f"{store.root}@previous", f"{store.root}@previous"]) == 0


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda p, ok: [str(p / "missing.json"), ok], "no such file"),
        (lambda p, ok: [_bad(p, "{oops"), ok], "cannot read"),
        (lambda p, ok: [_bad(p, json.dumps({"benchmarks": 3})), ok], "not a benchmark JSON"),
        (lambda p, ok: [ok, ok, "--threshold", "peak_allocated"], "METRIC=3%"),
        (lambda p, ok: [ok, ok, "--threshold", "peak_allocated=lots"], "not a percentage"),
        (lambda p, ok: [ok, f"{ok}@latest"], "applies to a results store"),
        (lambda p, ok: [ok, f"{p}/nowhere@latest"], "no such file or directory"),
        (lambda p, ok: [ok], "required"),
        (lambda p, ok: [ok, _bad(p, _malformed(extra_info="x"))], "extra_info is not an object"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics=[1]))], "metrics is not an object"),
        (lambda p, ok: [ok, _bad(p, _malformed(phases={"forward": 3}))], "phase forward is not an object"),
        (lambda p, ok: [ok, _bad(p, _malformed(stats=[1]))], "stats is not an object"),
        (lambda p, ok: [_bad(p, _malformed(machine_info=[1])), ok], "machine_info is not an object"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics={"peak_allocated": 10**400}))], "not a finite number"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics={"peak_allocated": float("nan")}))], "not a finite"),
        # missing data is never a pass (these exited 0 with "no regression")
        (lambda p, ok: [_bad(p, _plain(), "p1"), _bad(p, _plain(), "p2")], "no vramguard memory fields"),
        (lambda p, ok: [ok, _bad(p, _plain())], "no vramguard memory fields"),
        (lambda p, ok: [ok, _bad(p, json.dumps({"machine_info": {}, "benchmarks": []}))], "no benchmarks"),
        (lambda p, ok: [ok, _bad(p, _duplicated())], "appears more than once"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics={"peak_allocated": -5}))], "is negative"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics={"peak_allocated": "9 GiB"}))], "not a number"),
        (lambda p, ok: [ok, _bad(p, _malformed(metrics={"peak_allocated": True}))], "not a number"),
        (lambda p, ok: [ok, _bad(p, _malformed(phases={"forward": {"peak_allocated": -1}}))], "negative"),
        (lambda p, ok: [ok, ok, "--threshold", "peak_alocated=3%"], "matches no metric"),
        (lambda p, ok: [ok, ok, "--threshold", "forwrd.*=3%"], "matches no metric"),
        # item 5: one line and exit 2, never a traceback (RecursionError exited 1, the regression code)
        (lambda p, ok: [ok, _bad(p, "[" * 100_000)], "nested too deeply"),
        (lambda p, ok: [ok, str(p / ("x" * 5000))], "cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make_args, message) -> None:
    ok = _write(tmp_path / "ok.json", _doc())
    assert main(["compare", *make_args(tmp_path, ok)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vramguard: error:") and message in err
    assert "Traceback" not in err


def _malformed(**edit: object) -> str:
    """A benchmark document with one part of the wrong JSON type (or a non-finite metric)."""
    doc = _doc()
    bench = doc["benchmarks"][0]
    payload = bench["extra_info"]["vramguard"]
    for key, value in edit.items():
        target = payload if key in ("metrics", "phases") else doc if key == "machine_info" else bench
        target[key] = value
    return json.dumps(doc)


def _plain() -> str:
    """A pytest-benchmark file without vramguard's memory fields (timings only)."""
    doc = _doc()
    for bench in doc["benchmarks"]:
        del bench["extra_info"]["vramguard"]
    return json.dumps(doc)


def _duplicated() -> str:
    """The same benchmark twice, the copies disagreeing (which one is the measurement?)."""
    doc = _doc()
    doc["benchmarks"].insert(
        0, _inject({"benchmarks": [doc["benchmarks"][1]]}, "b", "peak_allocated", 2.0)["benchmarks"][0]
    )
    return json.dumps(doc)


def _bad(path: Path, text: str, name: str = "bad") -> str:
    target = path / f"{name}.json"
    target.write_text(text)
    return str(target)


def test_parse_thresholds_rejects_garbage() -> None:
    assert parse_thresholds(["peak_allocated=3%", "step_time=off"]) == {
        "peak_allocated": 0.03,
        "step_time": None,
    }
    with pytest.raises(UsageError):
        parse_thresholds(["=3%"])


def test_cpu_payload_has_no_process_block_and_reset_is_harmless() -> None:
    import torch

    from vramguard.history.bench import process_memory, reset_cuda

    assert process_memory(torch.device("cpu")) is None
    reset_cuda(torch.device("cpu"))


def test_timing_only_benchmarks_are_not_gated(tmp_path: Path) -> None:
    """A pytest-benchmark file may hold timing-only benchmarks beside vramguard's: those are skipped."""
    base = _doc()
    timing = {"name": "test_tokenizer_speed", "params": None, "stats": {"mean": 0.1}, "extra_info": {}}
    base["benchmarks"].append(timing)
    result = compare_docs(base, _doc())
    assert not result.failed and result.only_baseline == [] and result.missing == 0
