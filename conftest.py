"""Root conftest: the suites must never reach a model hub, and must not depend on the caller's cwd."""

from __future__ import annotations

import os
import re
import sys

import pytest

# Every model is built from a config with random weights; a download attempt is a bug, so fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# One intra-op thread per process in a run that records no numbers (pytest_cmdline_main sets it, so the workers
# and every child they start inherit it): the suites' tensors are tiny, so OpenMP's threads only spin against
# the other xdist workers and their children on the same cores. On the 2-core reference machine the default run
# took 365 s with torch's default threads, 261 s with one (docs/measurements/2026-11-25-test-run-cpu-time/).
# A caller's own OMP_NUM_THREADS is kept, and a run that records numbers (benchmarks, the store) keeps torch's
# default, as its baselines were measured.


#: options of a run whose numbers are recorded: pytest-benchmark times nothing on xdist workers, and the
#: GPU suites share one device, so such a run goes in one process whatever ``-n auto`` (addopts) says
ONE_PROCESS_OPTIONS = (
    "benchmark_json",
    "benchmark_save",
    "benchmark_autosave",
    "benchmark_only",
    "benchmark_compare",
    "benchmark_histogram",
    "vram_store",
    "vram_baseline",
    "vram_require_gpu",
)


def one_process_reason(option: object) -> str | None:
    """Why a run must not be spread over xdist workers (None: it may be)."""
    for name in ONE_PROCESS_OPTIONS:
        if getattr(option, name, None):
            return f"--{name.replace('_', '-')}"
    markexpr = getattr(option, "markexpr", "") or ""
    if re.search(r"(?<!not )\bgpu\b", markexpr):
        return f"-m {markexpr!r}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The default run spreads over pytest-xdist workers (``-n auto`` in pyproject's addopts); a run that
    records numbers or uses the GPU runs in one process. An explicit ``-n N`` is left as it is. A run that
    records nothing gets one intra-op thread a process (above)."""
    recorded = one_process_reason(config.option)
    if getattr(config.option, "numprocesses", None) == "auto" and recorded:
        config.option.numprocesses = 0
    if recorded is None and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:  # imported before this hook (a plugin): it read the variable already
            sys.modules["torch"].set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, the test modules) lives until the process ends: freeze
    it out of the garbage collector's full passes, which otherwise walk it again every few tests."""
    import gc

    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before xdist's, which starts the workers
def pytest_sessionstart(session: pytest.Session) -> None:
    """The controller of a spread run that collects tests_grad starts the capability probes (below). A JUnit
    XML report names the processor it was measured on (``processor`` property of the test suite): CPU
    kernels differ per instruction set, so the release matrix's table states it per row."""
    from _pytest.junitxml import xml_key

    config = session.config
    if (
        getattr(config, "workerinput", None) is None
        and config.pluginmanager.hasplugin("dsession")  # workers will start (not -n 0, not --collect-only)
        and not (
            getattr(config.option, "showfixtures", False)
            or getattr(config.option, "show_fixtures_per_test", False)
        )
        and _collects_tests_grad(config)
    ):
        _probe_while_the_workers_start(config)
    xml = session.config.stash.get(xml_key, None)
    if xml is not None:
        from vramguard.grad.capabilities import processor

        xml.add_global_property("processor", processor())


# -- the capability probes, once per run -------------------------------------------------------------------
# vramguard.grad.capabilities probes the installed bitsandbytes in a child process, once per process: on
# xdist every worker that needs a probe paid for it (a child importing torch, bitsandbytes and transformers:
# ~8 CPU s, ~12 s on 2 busy cores). Now the first worker that needs them runs them (the same child, on this
# machine, in this run) and the others read its result from the run's shared temporary folder.


# The workers need the probes when the first test that reads them runs (tests_grad's strict xfails evaluate
# their conditions then, not at import). Left to the workers, the first one ran the child while the other
# waited on the lock, a core idle for the child's ~8 s. So the controller of a run that collects tests_grad
# starts the same probes (in the same way, into the same file, under the same lock) as its session starts,
# while the workers start and collect; a worker that finds the lock taken waits for it. A run that starts no
# workers (``--markers``, ``--fixtures``, ``--collect-only``, ``-n 0``) starts none.

SHARED_PROBES = "vramguard-capabilities.json"


@pytest.hookimpl(trylast=True)  # after the tmpdir plugin's: the basetemp is known
def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, :func:`vramguard.grad.capabilities.probe_all` is shared by the run's workers."""
    if getattr(config, "workerinput", None) is not None:
        _share_probes_between_workers(config)


def _collects_tests_grad(config: pytest.Config) -> bool:
    from pathlib import Path

    root = Path(__file__).resolve().parent
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == root or root / "tests_grad" in (path, *path.parents):
            return True
    return False


def _read_or_run_probes(shared, run):  # type: ignore[no-untyped-def]
    """The probes' results from ``shared``, or ``run()``'s written there; under the file's lock."""
    import dataclasses
    import json

    from filelock import FileLock

    from vramguard.atomic import write_text_atomic
    from vramguard.grad import capabilities

    with FileLock(str(shared) + ".lock"):
        if shared.exists():
            return {name: capabilities.Probe(**p) for name, p in json.loads(shared.read_text()).items()}
        results = run()
        write_text_atomic(shared, json.dumps({n: dataclasses.asdict(p) for n, p in results.items()}))
        return results


def _probe_while_the_workers_start(config: pytest.Config) -> None:
    import threading

    from vramguard.grad import capabilities

    # the workers' basetemps are <this basetemp>/popen-gwN
    shared = config._tmp_path_factory.getbasetemp() / SHARED_PROBES  # type: ignore[attr-defined]
    thread = threading.Thread(
        target=_read_or_run_probes,
        args=(shared, capabilities.probe_all),
        name="vramguard-probes",
        daemon=True,
    )
    thread.start()
    config.add_cleanup(thread.join)


def _share_probes_between_workers(config: pytest.Config) -> None:
    import functools

    from vramguard.grad import capabilities

    own = capabilities.probe_all

    @functools.cache
    def probe_all() -> dict[str, capabilities.Probe]:
        # <basetemp>/popen-gwN is this worker's; its parent is the run's, shared by all its workers
        shared = config._tmp_path_factory.getbasetemp().parent / SHARED_PROBES  # type: ignore[attr-defined]
        return _read_or_run_probes(shared, own)

    capabilities.probe_all = probe_all
