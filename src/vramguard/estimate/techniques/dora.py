"""PEFT's DoRA (``--use-dora``, ``LoraConfig(use_dora=True)``): a magnitude vector per adapted layer, whose forward
dequantizes the base weight (and with ``lora_dropout`` keeps that copy for backward). PEFT builds and runs it
unchanged, on meta as on a device; the analytic model does not price it (measured only). Its note (the vectors,
and the weight copies their modules saved) is read from the model and the ledger by every producer
(:func:`vramguard.step.verdict.dora`)."""

from __future__ import annotations

from vramguard.step.technique import Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the adapters are DoRA's."""
    return bool(config.use_dora)


TECHNIQUE = Technique(
    name="use_dora",
    description="PEFT's DoRA: a trained magnitude vector per adapted layer, its forward dequantizing the base weight",
    stage="around",
    applies=applies,
    unmodelled="no analytic model for DoRA (use_dora): measured only",
)
