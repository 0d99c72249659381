"""The default run spreads over pytest-xdist workers; a run that records numbers (benchmarks, the results
store) or uses the GPU goes in one process (the root conftest's ``pytest_cmdline_main``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vramguard_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_default_run_is_spread_over_workers() -> None:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-n auto" in addopts and "not gpu" in addopts


@pytest.mark.parametrize(
    ("options", "one_process"),
    [
        ({"markexpr": "not gpu and not slow"}, False),
        ({"markexpr": "slow"}, False),
        ({"markexpr": "gpu"}, True),
        ({"markexpr": "gpu and benchmark"}, True),
        ({"markexpr": "not gpu and not slow", "benchmark_json": "b.json"}, True),
        ({"markexpr": "not gpu and not slow", "vram_store": "results/store"}, True),
    ],
)
def test_runs_that_record_numbers_go_in_one_process(options: dict[str, str], one_process: bool) -> None:
    reason = _root_conftest().one_process_reason(SimpleNamespace(**options))
    assert (reason is not None) == one_process, reason


def test_the_controller_imports_no_torch() -> None:
    """pytest loads the conftests of every test path in the xdist controller too, before it starts the workers;
    none of them may import torch there (3.7 CPU s at each start when two did). A fresh interpreter loads them as
    pytest does (each folder first on ``sys.path``) and names what imported torch if anything did."""
    code = (
        "import importlib.util, sys\n"
        "for folder in ('tests', 'tests_memory', 'tests_grad'):\n"
        "    sys.path.insert(0, folder)\n"
        "    spec = importlib.util.spec_from_file_location(folder + '_conftest', folder + '/conftest.py')\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "    assert 'torch' not in sys.modules, folder + '/conftest.py imports torch'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr.strip().splitlines()[-1:]


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    """A new pytest session; none of this (maybe xdist worker) session's PYTEST_* variables leak into it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONBREAKPOINT"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_benchmark_json_run_records_its_benchmarks(tmp_path: Path) -> None:
    """End to end: with ``-n auto`` in addopts, ``--benchmark-json`` still records the benchmark in one
    process (on xdist workers pytest-benchmark would disable it and write no benchmark), and a plain run of
    the same file is spread over workers."""
    import json

    out = tmp_path / "b.json"
    run = _pytest(f"--benchmark-json={out}", "benchmarks/test_kn_matmul.py")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "bringing up nodes" not in run.stdout
    assert len(json.loads(out.read_text())["benchmarks"]) >= 1
    # one worker shows that -n auto was kept (each worker imports every plugin again)
    plain = _pytest("tests/test_units.py", "-k", "parse", "--maxprocesses", "1")
    assert plain.returncode == 0 and "bringing up nodes" in plain.stdout, plain.stdout[-2000:]
