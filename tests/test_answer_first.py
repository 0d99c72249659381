"""``vramguard estimate`` answers first: its first line is the verdict a person reads (fits or not, the expected
total and the high end, what to try), then at most a screen, identical decoder layers in one row; ``--verbose``
prints every table. Rendered from a committed full-size estimate (no run), and one tiny run through the CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vramguard.cli import main
from vramguard.estimate.run import FRAGMENTATION, high_total
from vramguard.step.report import AuditReport
from vramguard.units import format_bytes as fb
from vramguard.view.console import text_console
from vramguard.view.report import answer, answer_section, estimate_layout, layer_runs, render

ROOT = Path(__file__).resolve().parents[1]
EIGHT_B = ROOT / "docs" / "measurements" / "2026-11-22-h100" / "estimates" / "estimate-llama-3.1-8b-s1024-b1.json"
GiB = 1 << 30


def _report() -> AuditReport:
    """The committed 8B estimate (written before the fragmentation allowance had a range: its high end is
    given here from today's figures)."""
    report = AuditReport.from_dict(json.loads(EIGHT_B.read_text()))
    e = report.estimate
    assert e is not None
    (frag,) = [o for o in e.overheads if o.name == "fragmentation allowance"]
    frag.high_bytes = int(e.allocator_peak_bytes * FRAGMENTATION.high)
    return report


def _lines(report: AuditReport, sections: tuple[Any, ...], width: int = 10_000) -> list[str]:
    out = io.StringIO()
    render(report, text_console(out, width=width), sections)
    return out.getvalue().splitlines()


def test_the_first_line_is_the_answer_and_the_rest_a_screen() -> None:
    report = _report()
    e = report.estimate
    assert e is not None and len(report.layers) == 32
    lines = _lines(report, (answer_section(24 * GiB), *estimate_layout(False)))
    assert lines[0] == f"does not fit in 24.00 GiB: {fb(e.total_bytes)} expected, {fb(high_total(e))} at the high end"
    assert len(lines) <= 30, len(lines)  # was 70-75 lines (125 in a 100-column terminal), the answer last
    assert len(_lines(report, (answer_section(24 * GiB), *estimate_layout(False)), width=100)) <= 30
    rows = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert rows == ["layers.0", "layers.1-31"]  # 31 identical layers in one row
    full = _lines(report, (answer_section(None), *estimate_layout(True)))
    assert sum(line.startswith("│ layers.") for line in full) == 32  # --verbose: every layer, every table
    assert any(line.startswith("Peak per phase") for line in full) and any("Components" in line for line in full)


def test_the_answer_is_judged_at_the_expected_total_or_the_high_end() -> None:
    report = _report()
    e = report.estimate
    assert e is not None
    expected, high = e.total_bytes, high_total(e)
    between = (expected + high) // 2
    assert answer(report, None) == f"{fb(expected)} expected on the device, {fb(high)} at the high end"
    assert answer(report, high) == f"fits in {fb(high)}: {fb(expected)} expected, {fb(high)} at the high end"
    said = answer(report, between)
    assert said.startswith(f"fits in {fb(between)}: ") and "at the high end it does not (--fit-at high" in said
    assert answer(report, between, "high").startswith(f"does not fit in {fb(between)} at the high end: ")
    fit = {
        "dim": "batch",
        "largest": 0,
        "changes": [
            {"change": "--lora-rank 8", "total_bytes": 3 * GiB, "fits": False},
            {"change": "--gradient-checkpointing", "total_bytes": GiB, "fits": True},
        ],
    }
    from vramguard.cli.estimate import for_reading

    assert answer(report, 2 * GiB, fit=for_reading(fit), card="T4").endswith(
        "; try --gradient-checkpointing (1.00 GiB, costs recompute)"
    ) and answer(report, 2 * GiB, card="T4").startswith("does not fit in 2.00 GiB (T4): ")


def test_every_change_fit_suggests_has_its_cost_and_the_cheapest_comes_first() -> None:
    """Ranked by what fits, then step time (none, smaller matmuls, recompute, PCIe traffic), then options, then
    bytes; a change whose cost is not registered would read "unknown cost"."""
    from vramguard.estimate.fit import by_cost, cheaper_changes, cost_of
    from vramguard.workload.models import QLoRAConfig

    def estimate(config: QLoRAConfig) -> Any:  # fits in 8: micro-batches, checkpointing, offloading
        total = 9 if config.optimizer != "adamw" or config.lora_rank != 16 else 20
        total = 5 if config.offload_activations else 6 if config.gradient_checkpointing else total
        total = 7 if config.batch == 2 else total
        return total

    rows = cheaper_changes(
        QLoRAConfig(batch=8, lora_rank=16), 8, estimate, largest_batch=2, peak_phase="optimizer"
    )
    assert len(rows) == 10 and all(cost_of(r["change"]).word != "unknown cost" for r in rows), rows
    ranked = [r["change"] for r in by_cost(rows)]
    assert ranked[:4] == [
        "--batch 2 --gradient-accumulation-steps 4",  # fits: smaller matmuls
        "--gradient-checkpointing",  # recompute, one option
        "--gradient-checkpointing --lora-rank 8",  # recompute, two
        "--offload-activations",  # PCIe traffic
    ], ranked


def test_only_consecutive_equal_layers_share_a_row() -> None:
    rows = [SimpleNamespace(name=f"base_model.model.model.layers.{i}", v=v) for i, v in enumerate([1, 2, 2, 2, 1, 1])]
    runs = layer_runs(rows, lambda r: [r.v])  # type: ignore[arg-type, attr-defined]
    assert runs == [("layers.0", [1]), ("layers.1-3", [2]), ("layers.4-5", [1])]


def test_the_cli_answers_first_and_quiet_keeps_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One tiny run on an RTX 4090: the answer against the card's memory, its context allowance said as assumed."""
    out = tmp_path / "e.json"
    argv = ["estimate", "--seq-len", "16", "--batch", "1", "--steps", "1", "--gpu", "rtx4090"]
    assert main([*argv, "--json", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"fits in {fb(24564 << 20)} (GeForce RTX 4090): ") and "expected" in first
    report = AuditReport.from_dict(json.loads(out.read_text()))
    assert report.estimate is not None
    (context,) = [o for o in report.estimate.overheads if o.name == "CUDA context + kernels"]
    assert context.basis.startswith("GeForce RTX 4090: not measured on this card, assumed from the H100's 744 MiB")
    assert "GeForce RTX 4090 context assumed from the H100's, H100 figures otherwise" in report.verdict.line
