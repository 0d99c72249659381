"""A pytest plugin that writes each test's CPU seconds, its own and its children's, one JSON line a test
(``/tmp/cpuprof-<pid>.jsonl``), and each process's CPU seconds at the end of collection
(``/tmp/cpuprof-collect-<pid>.json``). Use: ``PYTHONPATH=docs/measurements/2026-11-25-test-run-cpu-time
python -m pytest -p cpuprof``. A child's CPU counts once it has been waited for."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = _cpu()
    yield
    after = _cpu()
    line = {"id": item.nodeid, "self": after[0] - before[0], "kids": after[1] - before[1]}
    with Path(f"/tmp/cpuprof-{os.getpid()}.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    own, children = _cpu()
    Path(f"/tmp/cpuprof-collect-{os.getpid()}.json").write_text(json.dumps({"self": own, "kids": children}))
