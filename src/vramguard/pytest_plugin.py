"""pytest plugin (entry point ``pytest11``): vramguard's markers, and skipping of ``gpu`` tests without CUDA."""

from __future__ import annotations

import pytest

MARKERS: tuple[str, ...] = (
    "gpu: needs a CUDA device; run with `pytest -m gpu` on a GPU machine",
    "slow: long-running (real releases, large models); not in the default run",
    "benchmark: peak-memory benchmarks (pytest-benchmark); CPU runs use the live tracker",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker) and none is available")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
