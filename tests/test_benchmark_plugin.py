"""The benchmark plugin: versions in machine info, records in the store, the in-process gate, GPU pinning."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

# The pytester fixture restores sys.modules when a test ends: a heavy module imported for the first
# time inside such a test (bitsandbytes, transformers) would be dropped and later imported again, and
# torch refuses to register its operator libraries twice. So: import nothing new inside these tests;
# what an inner session imports (torch and bitsandbytes for the versions, hypothesis' terminal summary)
# is imported here first, since the plugin itself imports them only when a session needs them.
import bitsandbytes  # noqa: F401
import hypothesis  # noqa: F401
import pytest
import torch

from vramguard.history.store import ResultStore
from vramguard.pytest.benchmark import pin_gpu, visible_gpus

pytest_plugins = ["pytester"]

# A stand-in benchmark: its "memory" comes from the environment, so a test can inject a change.
BENCH = """
import os, pytest

@pytest.mark.parametrize("size", ["s", "m"])
def test_step(benchmark, size):
    peak = int(os.environ["FAKE_PEAK"]) * (2 if size == "m" else 1)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    metrics = {"peak_allocated": peak, "retained_after_forward": peak // 2, "step_time": 0.01}
    metrics.pop(os.environ.get("FAKE_DROP", ""), None)  # a run that lost a metric
    benchmark.extra_info["vramguard"] = {"params": {"size": size}, "metrics": metrics}
"""


@pytest.fixture
def bench(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_bench=BENCH)
    monkeypatch.setenv("FAKE_PEAK", "1000000")
    # the inner run is a session of its own, in this process, without the worker's variables
    # (pytest-benchmark would think it is a worker and disable itself)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    return pytester


def test_machine_info_carries_versions(bench: pytest.Pytester) -> None:
    out = bench.path / "out.json"
    result = bench.runpytest("-p", "no:cacheprovider", f"--benchmark-json={out}")
    result.assert_outcomes(passed=2)
    info = json.loads(out.read_text())["machine_info"]["vramguard"]
    assert info["packages"]["bitsandbytes"] == importlib.metadata.version("bitsandbytes")
    assert info["packages"]["torch"] == torch.__version__
    assert {"transformers", "peft", "trl"} <= set(info["packages"])
    assert "cuda" in info and "gpu_name" in info and info["key"]


def test_gate_fails_above_threshold_and_passes_unchanged(bench, monkeypatch, tmp_path: Path) -> None:
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    assert len(ResultStore(store).runs()) == 1

    same = bench.runpytest("-p", "no:cacheprovider", f"--vram-baseline={store}", "--vram-fail-above=3%")
    assert same.ret == 0
    same.stdout.fnmatch_lines(["*no regression*"])

    monkeypatch.setenv("FAKE_PEAK", "1050000")  # +5 %
    worse = bench.runpytest("-p", "no:cacheprovider", f"--vram-baseline={store}", "--vram-fail-above=3%")
    assert worse.ret == 1
    worse.assert_outcomes(passed=2)  # the tests passed; the gate failed the session
    worse.stdout.fnmatch_lines(
        ["*peak_allocated*+5.00%*REGRESSION*", "vramguard: memory gate failed against *: 4 regression(s)"]
    )

    loose = bench.runpytest("-p", "no:cacheprovider", f"--vram-baseline={store}", "--vram-fail-above=10%")
    assert loose.ret == 0


def test_gate_under_xdist_collects_every_worker(bench, monkeypatch, tmp_path: Path) -> None:
    """One store as baseline and destination: under xdist the workers store their records before the
    controller gates, and the gate used to pick this very run as ``@latest`` (a +5 % run passed)."""
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    monkeypatch.setenv("FAKE_PEAK", "1050000")  # +5 %
    worse = bench.runpytest_subprocess(  # (no hypothesis plugin: not needed)
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-n", "2", f"--vram-store={store}",
        f"--vram-baseline={store}",
    )  # fmt: skip
    assert worse.ret == 1  # the controller gated on both workers' records
    worse.stdout.fnmatch_lines(["*memory gate failed*: 4 regression(s)"])
    runs = ResultStore(store).runs()
    assert len(runs) == 2 and len(runs[1].files) == 2  # one file per worker, one shared run id
    assert {json.loads(f.read_text())["vramguard_writer"] for f in runs[1].files} == {"gw0", "gw1"}
    assert [r.seq for r in runs] == [1, 2]


def test_bad_gate_options_are_usage_errors(bench: pytest.Pytester) -> None:
    r = bench.runpytest("-p", "no:cacheprovider", "--vram-baseline=/nonexistent/base.json")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--vram-baseline: no such file or directory*"])
    r = bench.runpytest("-p", "no:cacheprovider", "--vram-fail-above=lots")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    malformed = bench.path / "malformed.json"
    malformed.write_text(json.dumps({"machine_info": {}, "benchmarks": [{"name": "x", "extra_info": "?"}]}))
    r = bench.runpytest("-p", "no:cacheprovider", f"--vram-baseline={malformed}")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--vram-baseline: *extra_info is not an object*"])
    assert "Traceback" not in r.stdout.str() + r.stderr.str()
    assert "passed" not in r.stdout.str()  # refused before the benchmarks ran, not after


def test_a_baseline_that_cannot_gate_is_refused_before_the_run(
    bench: pytest.Pytester, tmp_path: Path
) -> None:
    """A plain pytest-benchmark file, an empty run, a misspelt threshold: exit 4 at start, not a pass."""
    plain = tmp_path / "plain.json"
    bench.runpytest("-p", "no:cacheprovider", f"--benchmark-json={plain}")
    doc = json.loads(plain.read_text())
    for b in doc["benchmarks"]:
        b["extra_info"].pop("vramguard", None)
    plain.write_text(json.dumps(doc))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"machine_info": {}, "benchmarks": []}))
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    for args, message in [
        ([f"--vram-baseline={plain}"], "no vramguard memory fields"),
        ([f"--vram-baseline={empty}"], "holds no benchmarks"),
        ([f"--vram-baseline={store}", "--vram-threshold=peak_alocated=5%"], "matches no metric"),
        ([f"--vram-baseline={store}@nosuchrun"], "no run in"),
    ]:
        r = bench.runpytest("-p", "no:cacheprovider", *args)
        assert r.ret == pytest.ExitCode.USAGE_ERROR, args
        r.stderr.fnmatch_lines([f"*--vram-baseline: *{message}*"])
        assert "Traceback" not in r.stdout.str() + r.stderr.str()


def test_gate_never_compares_a_run_with_itself(bench, monkeypatch, tmp_path: Path) -> None:
    """``--vram-store=S --vram-baseline=S``: the run used to be stored first and then gated against
    itself (S@latest), so a doubled peak passed."""
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    monkeypatch.setenv("FAKE_PEAK", "2000000")  # 2x
    both = (f"--vram-store={store}", f"--vram-baseline={store}")
    worse = bench.runpytest("-p", "no:cacheprovider", *both)
    assert worse.ret == 1
    worse.stdout.fnmatch_lines(["*peak_allocated*+100.00%*REGRESSION*"])
    runs = ResultStore(store).runs()
    assert len(runs) == 2  # stored all the same: nothing recorded is lost
    worse.stdout.fnmatch_lines([f"baseline: *@{runs[0].run_id} *"])  # the run before, not this one
    # and the next run is gated against this one (the latest before it), not against itself
    same = bench.runpytest("-p", "no:cacheprovider", *both)
    assert same.ret == 0
    same.stdout.fnmatch_lines([f"*baseline*{runs[1].run_id}*", "*no regression*"])


def test_gate_fails_on_missing_data_unless_allowed(bench, monkeypatch, tmp_path: Path) -> None:
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    gate = ("-p", "no:cacheprovider", f"--vram-baseline={store}")

    skip_m = ("--deselect", "test_bench.py::test_step[m]")
    one = bench.runpytest(*gate, *skip_m)  # the 'm' benchmark did not run
    one.assert_outcomes(passed=1, deselected=1)
    assert one.ret == 1
    one.stdout.fnmatch_lines(["only in baseline: test_step size=m*", "*memory gate failed*: 1 missing*"])
    assert bench.runpytest(*gate, *skip_m, "--vram-allow-missing").ret == 0

    monkeypatch.setenv("FAKE_DROP", "retained_after_forward")  # the run lost a metric
    lost = bench.runpytest(*gate)
    assert lost.ret == 1
    lost.stdout.fnmatch_lines(["*retained_after_forward*MISSING*", "*memory gate failed*: 2 missing*"])
    ok = bench.runpytest(*gate, "--vram-allow-missing")
    assert ok.ret == 0
    ok.stdout.fnmatch_lines(["*no regression; 2 missing from the current run (allowed)*"])

    bench.makepyfile(test_plain="def test_plain():\n    pass\n")
    nothing = bench.runpytest(*gate, "-k", "plain")  # tests passed, but no benchmark ran at all
    nothing.assert_outcomes(passed=1, deselected=2)
    assert nothing.ret == pytest.ExitCode.USAGE_ERROR
    nothing.stdout.fnmatch_lines(["vramguard: error: --vram-baseline: this run holds no benchmarks*"])


def test_unwritable_store_or_summary_is_one_line_not_internal_error(bench, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = bench.runpytest("-p", "no:cacheprovider", f"--vram-store={blocker / 'store'}")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stdout.fnmatch_lines(["vramguard: error: --vram-store: cannot write *"])
    store = tmp_path / "store"
    bench.runpytest("-p", "no:cacheprovider", f"--vram-store={store}").assert_outcomes(passed=2)
    r = bench.runpytest(
        "-p", "no:cacheprovider", f"--vram-baseline={store}", f"--vram-summary={blocker / 's.md'}"
    )
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stdout.fnmatch_lines(["vramguard: error: --vram-summary: cannot write *"])
    assert "INTERNALERROR" not in r.stdout.str() + r.stderr.str()


def test_pin_gpu_round_robin_per_worker() -> None:
    pinned = []
    for worker in ("gw0", "gw1", "gw2", "gw3", "gw4"):
        env = {"PYTEST_XDIST_WORKER": worker, "CUDA_VISIBLE_DEVICES": "0,1,3,4"}
        pinned.append(pin_gpu(env))
        assert env["CUDA_VISIBLE_DEVICES"] == pinned[-1]
    assert pinned == ["0", "1", "3", "4", "0"]


def test_pin_gpu_is_idempotent_and_optional() -> None:
    env = {"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "2,5"}
    assert pin_gpu(env) == "5"
    assert pin_gpu(env) == "5" and env["CUDA_VISIBLE_DEVICES"] == "5"  # the second call keeps it
    assert pin_gpu({"CUDA_VISIBLE_DEVICES": "0,1"}) is None  # not an xdist worker
    assert (
        pin_gpu({"PYTEST_XDIST_WORKER": "gw0", "VRAMGUARD_NO_PIN": "1", "CUDA_VISIBLE_DEVICES": "0"}) is None
    )
    assert pin_gpu({"PYTEST_XDIST_WORKER": "gw0"}, gpus=[]) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_visible_gpus_counts_with_nvml_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    fake = types.ModuleType("pynvml")
    fake.NVMLError = type("NVMLError", (Exception,), {})  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    env = {"PYTEST_XDIST_WORKER": "gw4"}
    assert visible_gpus(env) == ["0", "1", "2"]
    assert pin_gpu(env) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"

    def broken() -> None:
        raise fake.NVMLError("driver not loaded")

    fake.nvmlInit = broken  # type: ignore[attr-defined]
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert visible_gpus({}) == []
