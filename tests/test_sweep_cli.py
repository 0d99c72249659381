"""``vramguard sweep`` end to end, offline: the generated ``vg-dummy`` wheels of test_bisect_cli.

The probe writes one record to the store named by ``$VRAMGUARD_STORE`` under ``$VRAMGUARD_RUN_ID``,
as the benchmark plugin does; its ``peak_allocated`` grows at 1.5 (``LEAK``), so every stored number
proves which overlay ran. 1.3 is a broken build.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version
from test_bisect_cli import (  # wheelhouse_fixture: the fixture `wheelhouse`, built once for both files
    assert_cache_consistent,
    assert_one_line_error,
    wheelhouse_fixture,  # noqa: F401
)

from vramguard.bisect.sweep import MARKER_WRITER, done_runs, same_environment, select_releases
from vramguard.cli import main
from vramguard.history.compare import entries
from vramguard.history.store import ResultStore

PROBE = r"""
import os, sys, vgdummy
from vramguard.history.store import ResultStore
from vramguard.bisect.sweep import environment_for
env = environment_for("vg-dummy", vgdummy.__version__)
bench = {"name": "test_x", "params": {}, "extra_info": {"vramguard": {"metrics": {
    "peak_allocated": 100 + 1000 * vgdummy.LEAK}}}}
ResultStore(os.environ["VRAMGUARD_STORE"]).add(
    {"machine_info": {"vramguard": env}, "benchmarks": [bench]}, os.environ["VRAMGUARD_RUN_ID"], "main")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("overlays")


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture(autouse=True)
def _no_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMGUARD_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("VRAMGUARD_STORE", raising=False)


def sweep(capsys, wheelhouse: Path, cache: Path, store: Path, *args: str, command: list[str]) -> tuple:
    argv = ["sweep", "vg-dummy", *args, "--store", str(store), "--find-links", str(wheelhouse)]
    code = main([*argv, "--cache-dir", str(cache), "--", *command])
    out, err = capsys.readouterr()
    return code, out, err


def stored_peaks(store: Path) -> dict[str, float]:
    """peak_allocated per vg-dummy version, from the store alone."""
    out = {}
    s = ResultStore(store)
    for run in s.runs():
        doc = s.load(run)
        version = doc["machine_info"]["vramguard"]["packages"]["vg-dummy"]
        ((_, metrics),) = entries(doc, run.run_id).items()
        out[version] = metrics["peak_allocated"]
    return out


def test_every_release_is_measured_stored_and_logged(capsys, wheelhouse, cache, probe, tmp_path) -> None:
    store, log = tmp_path / "store", tmp_path / "log.json"
    code, _out, err = sweep(
        capsys, wheelhouse, cache, store, "--from", "1.2", "--to", "1.6", "--log", str(log),
        command=[sys.executable, str(probe)],
    )  # fmt: skip
    assert code == 0, err
    # the stored numbers come from the overlay each run imported: the step at 1.5, 1.3 skipped (broken)
    assert stored_peaks(store) == {"1.2": 100, "1.4": 100, "1.5": 1100, "1.6": 1100}
    data = json.loads(log.read_text())
    assert data["status"] == "done" and data["releases"] == ["1.2", "1.3", "1.4", "1.5", "1.6"]
    outcomes = {r["version"]: r["outcome"] for r in data["results"]}
    assert outcomes == {"1.2": "ok", "1.3": "skip", "1.4": "ok", "1.5": "ok", "1.6": "ok"}
    assert "broken build" in next(r for r in data["results"] if r["version"] == "1.3")["reason"]
    for line in ("[1/5] vg-dummy 1.2: ok", "[2/5] vg-dummy 1.3: skip", "[5/5] vg-dummy 1.6: ok"):
        assert line in err
    assert ResultStore(store).verify() == []
    assert_cache_consistent(cache)


def test_rerun_resumes_and_measures_only_what_is_missing(capsys, wheelhouse, cache, probe, tmp_path) -> None:
    store = tmp_path / "store"
    code, _, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.0,1.1", command=[sys.executable, str(probe)]
    )
    assert code == 0, err
    runs_before = len(ResultStore(store).runs())
    log = tmp_path / "again.json"
    code, _, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.0,1.1,1.2", "--log", str(log),
        command=[sys.executable, str(probe)],
    )  # fmt: skip
    assert code == 0, err
    outcomes = {r["version"]: r["outcome"] for r in json.loads(log.read_text())["results"]}
    assert outcomes == {"1.0": "resumed", "1.1": "resumed", "1.2": "ok"}
    assert len(ResultStore(store).runs()) == runs_before + 1
    # --no-resume measures again
    code, _, err = sweep(
        capsys,
        wheelhouse,
        cache,
        store,
        "--versions",
        "1.0",
        "--no-resume",
        command=[sys.executable, str(probe)],
    )
    assert code == 0 and "[1/1] vg-dummy 1.0: ok" in err
    assert len(ResultStore(store).runs()) == runs_before + 2


def test_a_failed_release_is_retried_not_resumed(capsys, wheelhouse, cache, probe, tmp_path) -> None:
    store = tmp_path / "store"
    code, out, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.0", command=[sys.executable, str(probe), "1"]
    )
    assert code == 1, err
    assert "1.0: failed - the command exited 1" in out
    assert len(ResultStore(store).runs()) == 1  # what it stored is kept
    code, _, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.0", command=[sys.executable, str(probe)]
    )
    assert code == 0 and "[1/1] vg-dummy 1.0: ok" in err
    assert len(ResultStore(store).runs()) == 2


def test_a_command_that_always_fails_is_reported_per_release_and_loses_nothing(
    capsys, wheelhouse, cache, probe, tmp_path
) -> None:
    store = tmp_path / "store"
    code, _, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.0", command=[sys.executable, str(probe)]
    )
    assert code == 0, err
    before = stored_peaks(store)
    log = tmp_path / "log.json"
    code, out, err = sweep(
        capsys, wheelhouse, cache, store, "--versions", "1.1,1.2", "--log", str(log),
        command=[sys.executable, "-c", "import sys; sys.exit(3)"],
    )  # fmt: skip
    assert code == 1 and "Traceback" not in err + out
    assert "[1/2] vg-dummy 1.1: failed (exit 3" in err and "[2/2] vg-dummy 1.2: failed (exit 3" in err
    assert "1.1: failed - the command exited 3" in out and "1.2: failed - the command exited 3" in out
    assert stored_peaks(store) == before and ResultStore(store).verify() == []
    assert [r["exit_code"] for r in json.loads(log.read_text())["results"]] == [3, 3]


def test_exit_zero_without_a_stored_run_is_a_failure(capsys, wheelhouse, cache, tmp_path) -> None:
    code, out, _err = sweep(capsys, wheelhouse, cache, tmp_path / "s", "--versions", "1.0", command=["true"])
    assert code == 1 and "stored no run" in out


def test_exit_125_is_a_recorded_skip_and_timeout_is_a_failure(capsys, wheelhouse, cache, tmp_path) -> None:
    log = tmp_path / "log.json"
    cmd = [
        sys.executable,
        "-c",
        "import sys, time, vgdummy; time.sleep(30) if vgdummy.LEAK else sys.exit(125)",
    ]
    code, _, err = sweep(
        capsys, wheelhouse, cache, tmp_path / "s", "--versions", "1.4,1.5", "--timeout", "3", "--log", str(log),
        command=cmd,
    )  # fmt: skip
    assert code == 1, err
    results = json.loads(log.read_text())["results"]
    assert [(r["outcome"], r["exit_code"]) for r in results] == [("skip", 125), ("timeout", None)]


@pytest.mark.parametrize(
    "args, needle, asks_index",
    [
        (["--versions", "1.0,7.7"], "7.7 not listed", True),
        (["--versions", "x"], "'x' is not a version", False),
        (["--versions", ","], "lists no version", False),
        (["--from", "1.6", "--to", "1.2"], "empty range", False),
        (["--from", "3.0", "--to", "4.0"], "no release", True),
        (["--from", "1.0"], "--versions A,B,C or --from V1 --to V2", False),
        (["--versions", "1.0", "--from", "1.0", "--to", "1.2"], "not both", False),
        (["--from", "1.0", "--to", "1.2", "--every", "0"], "at least 1", False),
    ],
)
def test_bad_input_is_one_line(
    capsys, monkeypatch, wheelhouse, cache, tmp_path, args, needle, asks_index
) -> None:
    """What no index can make right is refused before the index is asked: no ``pip index versions`` (a
    process, about 0.3 CPU s) for it."""
    if not asks_index:
        from vramguard.bisect import sweep as sweep_module

        def asked(*_args: object, **_kwargs: object) -> None:
            raise AssertionError("the index was asked")

        monkeypatch.setattr(sweep_module, "available_versions", asked)
    code, out, err = sweep(capsys, wheelhouse, cache, tmp_path / "s", *args, command=["true"])
    assert_one_line_error(code, out, err, needle)


def test_unknown_package_and_missing_parts_are_one_line(capsys, wheelhouse, tmp_path) -> None:
    code = main(
        [
            "sweep",
            "nope-pkg",
            "--versions",
            "1.0",
            "--store",
            str(tmp_path),
            "--find-links",
            str(wheelhouse),
            "--",
            "true",
        ]
    )
    assert_one_line_error(code, *capsys.readouterr(), "'nope-pkg' not found")
    code = main(["sweep", "vg-dummy", "--versions", "1.0", "--find-links", str(wheelhouse), "--", "true"])
    assert_one_line_error(code, *capsys.readouterr(), "--store")
    code = main(["sweep", "vg-dummy", "--versions", "1.0", "--store", str(tmp_path)])
    assert_one_line_error(code, *capsys.readouterr(), "missing COMMAND")


def test_range_selection() -> None:
    vs = [Version(f"1.{i}") for i in range(10)]
    assert [str(v) for v in select_releases(vs, start="1.2", end="1.8", every=3)] == ["1.2", "1.5", "1.8"]
    assert [str(v) for v in select_releases(vs, start="1.2", end="1.7", every=3)] == ["1.2", "1.5", "1.7"]
    assert [str(v) for v in select_releases(vs, versions="1.3,1.1,1.3")] == ["1.1", "1.3"]


def test_the_benchmark_plugin_writes_where_the_sweep_says(capsys, wheelhouse, cache, tmp_path) -> None:
    """Through pytest: VRAMGUARD_STORE is --vram-store's default, VRAMGUARD_RUN_ID its run id, and the
    swept (untracked) package's version is in the record."""
    tests = tmp_path / "bench"
    tests.mkdir()
    (tests / "test_b.py").write_text(
        "import vgdummy\n"
        "def test_b(benchmark):\n"
        "    benchmark.extra_info['vramguard'] = {'metrics': {'peak_allocated': 7 + vgdummy.LEAK}}\n"
        "    benchmark(lambda: None)\n"
    )
    store = tmp_path / "store"
    # (hypothesis' plugin is not needed; with PYTHONDONTWRITEBYTECODE a pytest process rewrites hypothesis)
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q", "-o", "addopts="]
    cmd += ["-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    code, _, err = sweep(capsys, wheelhouse, cache, store, "--versions", "1.4,1.5", command=cmd)
    assert code == 0, err
    assert stored_peaks(store) == {"1.4": 7, "1.5": 8}


def test_no_traceback_from_the_console_script(wheelhouse, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramguard", "sweep", "vg-dummy", "--from", "2", "--to", "1", "--store", str(tmp_path),
         "--find-links", str(wheelhouse), "--", "true"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "empty range" in proc.stderr


def test_the_device_of_a_cpu_only_torch_is_known_without_importing_it() -> None:
    """What a sweep's run records as its device: the probe of every release asks it, so a ``+cpu`` build of
    torch is answered from its metadata, and the answer is torch's own."""
    import torch

    code = (
        "import sys; from vramguard.bisect.sweep import environment_for; "
        "print(environment_for('vg-dummy', '1.0')['device'], 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    device, imported = proc.stdout.split()
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert imported == str(not torch.__version__.endswith("+cpu"))


def test_markers_of_another_shape_resume_nothing() -> None:
    """Found by fuzzing ``sweep``: a marker without machine_info, with machine_info as a list, or recording a
    version that is no version was an internal error (KeyError, AttributeError, InvalidVersion) before any
    release ran. Such a marker now resumes nothing: its release is measured again."""
    import tempfile

    env = {"packages": {"torch": "2.13.0"}, "python": "3.11", "device": "cpu"}
    with tempfile.TemporaryDirectory() as folder:
        store = ResultStore(folder)
        ok = {"package": "vg-dummy", "version": "1.0", "outcome": "ok"}
        for machine_info in (None, [1], {"vramguard": {**env, "packages": {"torch": "x.y"}}}):
            path = store.add({"machine_info": {"vramguard": env}, "benchmarks": []}, None, MARKER_WRITER)
            record = {**json.loads(path.read_text()), "vramguard_sweep": ok}
            if machine_info is None:
                del record["machine_info"]
            else:
                record["machine_info"] = machine_info
            path.write_text(json.dumps(record))
        markers = done_runs(store)
    assert len(markers) == 1 and not same_environment(markers[0]["info"], env)  # "x.y" is not 2.13.0
    assert same_environment({**env, "packages": {"torch": "x.y"}}, {**env, "packages": {"torch": "x.y"}})
