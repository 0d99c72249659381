"""pytest plugin (second ``pytest11`` entry point): versions in benchmark JSON, a results store,
an in-process memory gate, and one GPU per pytest-xdist worker.

* ``pytest_benchmark_update_machine_info`` adds a ``vramguard`` block (library versions, CUDA,
  GPU name, driver, pinned GPU, the store key) to pytest-benchmark's machine info.
* Every test whose ``benchmark`` fixture carries ``extra_info["vramguard"]`` becomes a record, also
  when pytest-benchmark disabled timing (it does under xdist). ``--vram-store DIR`` writes each
  process's records to the store (each xdist worker its own file); ``--vram-baseline PATH`` compares
  them, in the controller, with a stored run and fails the session above ``--vram-fail-above`` or
  when a baseline benchmark or metric is missing (unless ``--vram-allow-missing``). The baseline
  is read when the session starts, before this run stores anything, so a run is never compared
  with itself (also with ``--vram-store=S --vram-baseline=S``).
* GPU pinning: an xdist worker ``gwN`` gets ``CUDA_VISIBLE_DEVICES`` = the N-th visible GPU (round
  robin). CUDA reads that variable once, when it initialises, so pinning happens in
  ``pytest_load_initial_conftests`` (before conftest files are imported) and again, idempotently,
  in ``pytest_configure``; nothing may touch CUDA before that. GPUs are counted without
  initialising CUDA (``CUDA_VISIBLE_DEVICES``, pynvml or ``nvidia-smi -L``). ``VRAMGUARD_NO_PIN=1``
  turns pinning off.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import MutableMapping
from typing import Any

import pytest

from vramguard.errors import UsageError

_RECORDS = pytest.StashKey[list[dict[str, Any]]]()
_RESULTS = pytest.StashKey[list[tuple[str, Any]]]()
_GATE = pytest.StashKey[Any]()  # vramguard.history.compare.Gate
_BASELINE = pytest.StashKey[tuple[dict[str, Any], str]]()  # the baseline document and its label
_RUN_ID = "vramguard_run_id"
PINNED_ENV = "VRAMGUARD_PINNED_GPU"


# GPU pinning ------------------------------------------------------------------------------
def visible_gpus(env: MutableMapping[str, str] | None = None) -> list[str]:
    """GPU ids a worker may be given, found without initialising CUDA."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:  # no driver: try nvidia-smi
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [str(i) for i, _ in enumerate(row for row in out.splitlines() if row.startswith("GPU "))]
    return []


def pin_gpu(env: MutableMapping[str, str] | None = None, gpus: list[str] | None = None) -> str | None:
    """Set ``CUDA_VISIBLE_DEVICES`` for xdist worker ``gwN`` to GPU ``N mod len(gpus)``; return it."""
    env = os.environ if env is None else env
    if PINNED_ENV in env:
        return env[PINNED_ENV] or None
    worker = env.get("PYTEST_XDIST_WORKER")
    if not worker or env.get("VRAMGUARD_NO_PIN") == "1":
        return None
    m = re.search(r"(\d+)$", worker)
    gpus = visible_gpus(env) if gpus is None else gpus
    if not m or not gpus:
        env[PINNED_ENV] = ""
        return None
    gpu = gpus[int(m.group(1)) % len(gpus)]
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env[PINNED_ENV] = gpu
    return gpu


# machine info -----------------------------------------------------------------------------
def machine_block() -> dict[str, Any]:
    """Library versions and device identity (the store key comes from these)."""
    import torch

    from vramguard.environment import collect
    from vramguard.history.store import env_key

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = collect(device)
    block: dict[str, Any] = {
        "packages": _with_swept(env.packages),
        "python": env.python,
        "device": device,
        "gpu_name": env.gpu_name,
        "cuda": env.cuda,
        "torch_cuda_build": torch.version.cuda,
        "commit": env.commit,
        "pinned_gpu": os.environ.get(PINNED_ENV) or None,
        "driver": _driver_version(),
    }
    block["key"] = env_key({"vramguard": block})
    return block


def _with_swept(packages: dict[str, Any]) -> dict[str, Any]:
    """Also the version of the package that `vramguard sweep` / `bisect` varies, when not tracked."""
    from vramguard.environment import package_version

    swept = os.environ.get("VRAMGUARD_BISECT_PACKAGE")
    if swept and swept not in packages:
        return dict(packages, **{swept: package_version(swept)})
    return packages


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Record vramguard's environment block (library versions, device, GPU) in every pytest-benchmark run."""
    machine_info["vramguard"] = machine_block()


# options ------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the benchmark gate's options: baseline, thresholds, missing-data rules, results store, markdown
    summary."""
    group = parser.getgroup("vramguard-benchmark", "vramguard memory benchmarks")
    group.addoption(
        "--vram-baseline",
        metavar="PATH",
        default=None,
        help="compare benchmark memory with this run: JSON file, run directory or "
        "results store[@latest|@previous|@RUN_ID], read before this run stores anything; "
        "fail the session on a regression or missing data",
    )
    from vramguard.history.compare import add_gate_options

    add_gate_options(group.addoption, prefix="vram-")  # the same options as `vramguard compare`
    group.addoption(
        "--vram-store",
        metavar="DIR",
        default=os.environ.get("VRAMGUARD_STORE") or None,  # set by `vramguard sweep`
        help="write this run's benchmark records to a results store (default $VRAMGUARD_STORE)",
    )
    group.addoption(
        "--vram-summary",
        metavar="FILE",
        default=None,
        help="append the comparison as Markdown (e.g. $GITHUB_STEP_SUMMARY)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    """Pin each xdist worker to its own GPU before any conftest imports torch."""
    pin_gpu()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Pin the worker's GPU, check the gate's options, read the baseline (controller only, before this run
    stores anything) and give the session its run id; bad options end it with one line."""
    pin_gpu()
    config.stash[_RECORDS] = []
    config.stash[_RESULTS] = []
    from vramguard.history.compare import Gate

    try:
        config.stash[_GATE] = Gate.from_options(
            config.getoption("vram_threshold"),
            config.getoption("vram_fail_above"),
            config.getoption("vram_allow_missing"),
        )
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    workerinput = getattr(config, "workerinput", None)
    baseline = config.getoption("vram_baseline")
    if baseline and workerinput is None:
        # Chosen now, before this run stores a record: ``S@latest`` is the latest run before this one.
        config.stash[_BASELINE] = _load_baseline(baseline, config.stash[_GATE])
    if workerinput is None and not hasattr(config, _RUN_ID):
        from vramguard.history.store import new_run_id

        setattr(config, _RUN_ID, os.environ.get("VRAMGUARD_RUN_ID") or new_run_id())  # set by sweep
    elif workerinput is not None:
        setattr(config, _RUN_ID, workerinput.get(_RUN_ID))


def _load_baseline(spec: str, gate: Any) -> tuple[dict[str, Any], str]:
    """The baseline document and label; pytest.UsageError (one line) when it cannot gate anything."""
    from vramguard.history.compare import check_thresholds, entries, known_metrics
    from vramguard.history.store import load_spec

    try:
        doc, label = load_spec(spec)
        entries(doc, label)  # malformed, empty or without memory fields: fail before the tests run
        check_thresholds(gate.thresholds, known_metrics(doc))
    except UsageError as exc:
        raise pytest.UsageError(f"--vram-baseline: {exc}") from None
    return doc, label


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: give every worker the same run id, so their files form one run."""
    node.workerinput[_RUN_ID] = getattr(node.config, _RUN_ID, None)


# records ----------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """Keep the memory record of each passed benchmark that reported vramguard metrics."""
    report = yield
    if call.when == "call" and report.passed:
        fixture = getattr(item, "funcargs", {}).get("benchmark")
        extra = getattr(fixture, "extra_info", None) or {}
        if "vramguard" in extra:
            item.config.stash[_RECORDS].append(_entry(item, fixture))
    return report


def _entry(item: pytest.Item, fixture: Any) -> dict[str, Any]:
    if getattr(fixture, "stats", None) is not None:
        entry = fixture.stats.as_dict(include_data=False)
    else:  # timing disabled (xdist, --benchmark-disable): same shape, no stats
        callspec = getattr(item, "callspec", None)
        entry = {
            "group": None,
            "name": item.name,
            "fullname": item.nodeid,
            "params": dict(callspec.params) if callspec else None,
            "param": callspec.id if callspec else None,
            "extra_info": fixture.extra_info,
            "stats": None,
        }
    return json.loads(json.dumps(entry, default=str))


def _document(config: pytest.Config, records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "machine_info": {"node": platform.node(), "vramguard": machine_block()},
        "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "vramguard_run_id": getattr(config, _RUN_ID, None),
        "benchmarks": records,
    }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: collect a worker's records for the gate."""
    data = getattr(node, "workeroutput", {}).get("vramguard_records")
    if data:
        node.config.stash[_RECORDS].extend(json.loads(data))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Store the session's records in ``--vram-store`` (each xdist worker its own, under the controller's run
    id) and, with a baseline, run the gate."""
    config = session.config
    records = config.stash.get(_RECORDS, [])
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["vramguard_records"] = json.dumps(records)
    store_dir = config.getoption("vram_store")
    own = records if workeroutput is not None or not _is_controller(config) else []
    if store_dir and own:
        from vramguard.history.store import ResultStore

        writer = os.environ.get("PYTEST_XDIST_WORKER", "main")
        try:
            path = ResultStore(store_dir).add(_document(config, own), getattr(config, _RUN_ID, None), writer)
        except OSError as exc:
            config.stash[_RESULTS].append(("error", f"--vram-store: cannot write {store_dir}: {exc}"))
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        else:
            config.stash[_RESULTS].append(("stored", str(path)))
    if _BASELINE in config.stash and workeroutput is None:
        _gate(session, records)


def _is_controller(config: pytest.Config) -> bool:
    """The xdist controller distributes tests; its workers hold (and store) the records."""
    return getattr(config.option, "dist", "no") != "no" and getattr(config, "workerinput", None) is None


def _gate(session: pytest.Session, records: list[dict[str, Any]]) -> None:
    from vramguard.view.compare import markdown

    config = session.config
    base_doc, label = config.stash[_BASELINE]
    try:
        comparison = config.stash[_GATE].compare(base_doc, _document(config, records), label, "this run")
    except UsageError as exc:
        config.stash[_RESULTS].append(("error", f"--vram-baseline: {exc}"))
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    config.stash[_RESULTS].append(("compared", comparison))
    summary = config.getoption("vram_summary")
    if summary:
        try:
            with open(summary, "a") as fh:
                fh.write(markdown(comparison))
        except OSError as exc:
            config.stash[_RESULTS].append(("error", f"--vram-summary: cannot write {summary}: {exc}"))
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
            return
    if comparison.failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Print where the records went and the comparison table or the gate's error at the end of the session."""
    import io

    from vramguard.view.compare import render
    from vramguard.view.console import text_console

    for kind, value in config.stash.get(_RESULTS, []):
        if kind == "stored":
            terminalreporter.write_line(f"vramguard: benchmark records stored in {value}")
        elif kind == "error":
            terminalreporter.write_line(f"vramguard: error: {value}", red=True)
        else:
            terminalreporter.section("vramguard memory gate")
            buffer = io.StringIO()
            render(value, text_console(buffer))
            terminalreporter.write(buffer.getvalue())
            if value.failed:
                terminalreporter.write_line(
                    f"vramguard: memory gate failed against {value.baseline_label}: {value.verdict()}",
                    red=True,
                )
