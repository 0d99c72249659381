"""A meta step's accumulation priced from two micro-batches equals the N run in full, byte for byte.

With gradient accumulation N > 2 the estimate runs each step's first micro-batch (where the gradients are
allocated) and its last (the steady state every later one repeats) and prices the N-2 between from the last
(:class:`vramguard.workload.training.Repeats`): the phases' and modules' call counts and deltas, the forced
decisions and the offloaded packs. Each case here runs the estimate both ways (``VRAMGUARD_ALL_MICRO_BATCHES``
runs every micro-batch) and compares the whole JSON report (totals, peaks per phase, modules, ledger, forced
decisions, notes) but its wall time, and counts the forwards each ran.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pathlib import Path

from vramguard.estimate.run import ALL_MICRO_BATCHES, run_estimate
from vramguard.workload import training
from vramguard.workload.models import QLoRAConfig

SMALL = dict(seq_len=32, batch=1)
VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "llama-ga4-cuda": ({**SMALL, "batch": 2, "gradient_accumulation_steps": 4}, "cuda"),
    "checkpointing-dropout-bf16-ga3": (
        {
            **SMALL,
            "gradient_accumulation_steps": 3,
            "gradient_checkpointing": True,
            "lora_dropout": 0.05,
            "mixed_precision": "bf16",
        },
        "cuda",
    ),
    "padding-free-packing-ga4": (
        {"seq_len": 48, "batch": 2, "gradient_accumulation_steps": 4, "padding_free": True, "packing": True},
        "cuda",
    ),
    "offloading-ga3": ({**SMALL, "gradient_accumulation_steps": 3, "offload_activations": True}, "cuda"),
    "cpu-8bit-ga5": ({**SMALL, "gradient_accumulation_steps": 5, "optimizer": "adamw-8bit"}, "cpu"),
    "gemma2-eager-ga3": ({**SMALL, "model": "tiny-gemma2", "gradient_accumulation_steps": 3}, "cuda"),
    "qwen3-moe-ga3": ({**SMALL, "model": "tiny-qwen3-moe", "gradient_accumulation_steps": 3}, "cuda"),
    # a vision-language batch's values carried beside its meta tensors (image grids, the image tokens' positions)
    "qwen2.5-vl-images-ga3": (
        {"model": str(VLM / "tiny-qwen2.5-vl.json"), "seq_len": 64, "batch": 2, "image_size": "56x56",
         "gradient_accumulation_steps": 3, "target_modules": "all-linear"},
        "cuda",
    ),
}


def _document(report: Any) -> str:
    """The report as JSON, without its wall time."""
    doc = report.to_dict()
    doc.pop("elapsed_s", None)
    return json.dumps(doc, sort_keys=True, default=str)


def _estimate(
    monkeypatch: pytest.MonkeyPatch, config: QLoRAConfig, target: str, full: bool
) -> tuple[str, int]:
    """(the report's document, the forwards run) of a 2-step estimate, every micro-batch run or not."""
    forwards = []
    original = training.forward_as_trainer

    def counted(*args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(training, "forward_as_trainer", counted)
    monkeypatch.setenv(ALL_MICRO_BATCHES, "1" if full else "")
    report = run_estimate(config, steps=2, target=target)
    return _document(report), len(forwards)


@pytest.mark.parametrize("case", list(CASES))
def test_two_micro_batches_price_all_of_them(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    fields, target = CASES[case]
    config = QLoRAConfig(**fields)
    n = config.gradient_accumulation_steps
    full, full_forwards = _estimate(monkeypatch, config, target, full=True)
    priced, priced_forwards = _estimate(monkeypatch, config, target, full=False)
    # 2 steps of n micro-batches against 2 of 2, in each meta run (packed rows' data bounds run a second)
    assert full_forwards % (2 * n) == 0 and priced_forwards == full_forwards // (2 * n) * 4
    assert priced == full


TRAINER_CASES: dict[str, dict[str, Any]] = {
    "sft-ga4": {**SMALL, "gradient_accumulation_steps": 4},
    "sft-checkpointing-packing-ga3": {
        "seq_len": 48,
        "batch": 2,
        "gradient_accumulation_steps": 3,
        "gradient_checkpointing": True,
        "padding_free": True,
        "packing": True,
        "lora_dropout": 0.05,
    },
    "sft-bf16-8bit-ga3": {
        **SMALL,
        "gradient_accumulation_steps": 3,
        "mixed_precision": "bf16",
        "optimizer": "adamw-8bit",
    },
    # TRL's vision collator's batches (Qwen3-VL: mm_token_type_ids, deepstack's masks), their values on meta
    "sft-qwen3-vl-images-ga3": {
        "model": str(VLM / "tiny-qwen3-vl.json"),
        "seq_len": 128,
        "batch": 1,
        "image_size": "56x56",
        "gradient_accumulation_steps": 3,
        "target_modules": "all-linear",
    },
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_the_trainers_micro_batches_are_priced_from_two(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """TRL's SFTTrainer on meta (``--trainer sft``, the default): its training_step runs for the first and the
    last micro-batch of each step, and the report is the full run's, byte for byte."""
    from trl import SFTTrainer

    from vramguard.estimate.trainer import run_trainer_estimate

    config = QLoRAConfig(**TRAINER_CASES[case])
    n = config.gradient_accumulation_steps
    docs, calls = [], []
    for full in (True, False):
        counted: list[int] = []
        original = SFTTrainer.compute_loss

        def compute_loss(self: Any, *args: Any, _counted: list[int] = counted, **kwargs: Any) -> Any:
            _counted.append(1)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(SFTTrainer, "compute_loss", compute_loss)
        monkeypatch.setenv(ALL_MICRO_BATCHES, "1" if full else "")
        docs.append(_document(run_trainer_estimate(config, "sft", steps=2, target="cuda")))
        calls.append(len(counted))
        monkeypatch.setattr(SFTTrainer, "compute_loss", original)
    assert calls == [2 * n, 2 * 2]
    assert docs[1] == docs[0]
