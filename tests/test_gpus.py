"""``--gpu NAME``: a registered table of cards, each with its usable memory and CUDA context allowance, measured
where the project measured them (held here to the committed records) and said to be assumed elsewhere."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from vramguard.cli import main
from vramguard.cli.estimate import fit_size
from vramguard.errors import UsageError
from vramguard.estimate.fit import FIT_AT, search
from vramguard.estimate.gpus import GPUS, gpu_named, register
from vramguard.estimate.run import CUDA_CONTEXT_BYTES, overheads
from vramguard.step.report import DeviceEstimate, Overhead
from vramguard.workload.models import QLoRAConfig

MEASUREMENTS = Path(__file__).resolve().parents[1] / "docs" / "measurements"


def test_the_measured_cards_hold_the_measurements_and_the_others_say_assumed() -> None:
    h100, h200 = GPUS["h100"], GPUS["h200"]
    assert f"{h100.memory_mib}MiB" in (MEASUREMENTS / "2026-11-22-h100" / "env.txt").read_text()
    assert f"NVIDIA H200 ({h200.memory_mib} MiB)" in (MEASUREMENTS / "2026-11-27-h200" / "README.md").read_text()
    assert h100.context_bytes == CUDA_CONTEXT_BYTES and h100.measured
    assert h200.context_basis.startswith("not measured") and not h200.measured
    for gpu in GPUS.values():
        if gpu.name not in ("h100", "h200"):
            assert gpu.memory_basis.startswith("not measured") and gpu.context_basis.startswith("not measured")
    wanted = {"rtx3090", "rtx4090", "rtx5090", "a10", "l4", "l40s", "a10040gb", "a10080gb", "h100", "h200", "t4"}
    assert wanted <= set(GPUS)


@pytest.mark.parametrize(
    ("text", "name"), [("RTX 4090", "rtx4090"), ("rtx-4090", "rtx4090"), ("A100-80GB", "a10080gb"), ("H100", "h100")]
)
def test_a_card_is_found_by_any_spelling(text: str, name: str) -> None:
    assert gpu_named(text) is GPUS[name]


def test_an_unknown_card_is_one_line_with_the_nearest_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match=r"unknown GPU 'rtx4909': did you mean rtx4090"):
        gpu_named("rtx4909")
    assert main(["estimate", "--gpu", "rtx4909"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean rtx4090" in err
    for argv in (["--gpu", "t4", "--device", "cpu"], ["--gpu", "t4", "--world-size", "2", "--sharding", "fsdp2"]):
        assert main(["estimate", *argv]) == 2  # a CUDA card's figures on the host, or per rank: not priced
        assert capsys.readouterr().err.count("\n") == 1


def test_a_taken_name_is_refused() -> None:
    with pytest.raises(ValueError, match="taken"):
        register(dataclasses.replace(GPUS["t4"], name="t4b", aliases=("4090",)))
    assert "t4b" not in GPUS
    with pytest.raises(UsageError):
        gpu_named("t4b")  # nothing of it registered: its free name neither


def test_the_card_changes_the_context_allowance_alone() -> None:
    default = overheads(8 << 30)
    t4 = overheads(8 << 30, gpu=GPUS["t4"])
    assert [o.name for o in default] == [o.name for o in t4]
    assert default[0].basis.startswith("744 MiB measured on an H100") and t4[0].basis.startswith("T4: not measured")
    assert default[1:] == t4[1:]


def _args(fit: str | None, fit_at: str = "expected") -> argparse.Namespace:
    return argparse.Namespace(fit=fit, fit_at=fit_at)


def test_fit_takes_the_cards_memory_or_a_size_with_its_unit() -> None:
    gpu = GPUS["rtx4090"]
    assert fit_size(_args(""), gpu) == gpu.usable_bytes == 24564 << 20  # --fit --gpu rtx4090
    assert fit_size(_args("24GiB"), gpu) == 24 << 30  # --fit 24GiB --gpu rtx4090: the size given
    assert fit_size(_args(None), gpu) is None
    with pytest.raises(UsageError, match="needs a size"):
        fit_size(_args(""), None)
    with pytest.raises(UsageError, match="no unit"):
        fit_size(_args("24"), gpu)
    with pytest.raises(UsageError, match="give --fit"):
        fit_size(_args(None, "high"), gpu)


def test_fit_at_high_searches_with_the_high_end() -> None:
    """The fragmentation allowance's high share decides what fits with ``--fit-at high``: a smaller batch."""

    def estimate(config: QLoRAConfig) -> object:
        total = 1000 + 100 * config.batch
        frag = Overhead("fragmentation allowance", 50, "", low_bytes=10, high_bytes=50 + 10 * config.batch)
        estimate = DeviceEstimate(0, 0, 0, "backward", total - 50, 50, total, overheads=[frag])
        return SimpleNamespace(estimate=estimate)

    expected = search(QLoRAConfig(), 2000, lambda c: FIT_AT["expected"](estimate(c)), limit=64)  # type: ignore[arg-type]
    high = search(QLoRAConfig(), 2000, lambda c: FIT_AT["high"](estimate(c)), limit=64)  # type: ignore[arg-type]
    assert (expected.largest, high.largest) == (10, 9)  # high: 1000 + 100 b + 10 b <= 2000
