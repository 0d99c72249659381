"""``--fit``'s probes read only the figure: they run without the data's bounds (``StepRequest.bounds``), which
for packed padding-free rows is a second meta run (the rows one sequence each) whose only product is a note."""

from __future__ import annotations

from typing import Any

import pytest

from vramguard.estimate import run as estimate_run
from vramguard.estimate.run import run_estimate
from vramguard.workload.models import QLoRAConfig


def test_a_probe_without_bounds_has_the_figure_of_the_full_estimate_from_one_meta_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = QLoRAConfig(seq_len=48, batch=2, padding_free=True, packing=True)
    runs: list[Any] = []
    original = estimate_run.meta_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(estimate_run, "meta_step", counted)
    full = run_estimate(config, steps=2, target="cuda")
    assert len(runs) == 2  # the packed rows' low run too
    probe = run_estimate(config, steps=2, target="cuda", bounds=False)
    assert len(runs) == 3
    assert full.estimate is not None and probe.estimate is not None
    assert probe.estimate.total_bytes == full.estimate.total_bytes
    assert probe.estimate.high_total_bytes == full.estimate.high_total_bytes
    assert probe.to_dict()["phases"] == full.to_dict()["phases"]


def test_fit_runs_its_probes_without_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator ``--fit`` gives its search asks for no bounds (one meta run a probe)."""
    import argparse

    from vramguard.cli import estimate as cli

    asked: list[Any] = []
    config = QLoRAConfig(seq_len=48, batch=2, padding_free=True, packing=True)
    report = run_estimate(config, steps=1, target="cuda")

    def fake(c: QLoRAConfig, **options: Any) -> Any:
        asked.append(options.get("bounds", True))
        return report

    monkeypatch.setattr(estimate_run, "run_estimate", fake)
    args = argparse.Namespace(steps=1, target="cuda", fit_at="expected", fit_dim="batch")
    runner = cli._runner(args, "loop", None, lambda what: None)
    cli._fit(config, 1 << 40, args, report, runner, cli._place(args, "loop", None))
    assert asked and not any(asked)
