"""PEFT's DoRA (``--use-dora``, ``LoraConfig(use_dora=True)``): a magnitude vector per adapted layer, whose forward
dequantizes the base weight (and with ``lora_dropout`` keeps that copy for backward). PEFT builds and runs it
unchanged, on meta as on a device: no context on the step. The analytic model does not price it (measured only);
its note (the vectors, and the weight copies their modules saved) is read from the model and the ledger of every
producer's step (:func:`measured`: the audit's loop, the estimate's, each rank's)."""

from __future__ import annotations

from typing import Any

from vramguard.measure.ledger import LedgerReport
from vramguard.step import verdict as checks
from vramguard.step.report import Finding
from vramguard.step.technique import Technique
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig

DORA_MODULE = "lora_magnitude_vector"
"""The module PEFT's DoRA adds to each adapted layer (its magnitude vector, and the forward that dequantizes
the base weight for the weight norm)."""


def applies(config: QLoRAConfig) -> bool:
    """Whether the adapters are DoRA's."""
    return bool(config.use_dora)


def measured(model: Any, ledger: LedgerReport) -> Finding | None:
    """The note on what PEFT's DoRA adds to the step, read from the model and the ledger: its magnitude vectors
    (trainable parameters), the bytes its ``lora_magnitude_vector`` modules saved for backward and, of those,
    the dequantized weight copies (with ``lora_dropout`` PEFT's ``DoraLinearLayer.forward`` computes the base
    output again, ``F.linear(dropout(x), W)``, from the weight it dequantized, so autograd keeps ``W``);
    ``None`` where the model has no DoRA vectors."""
    vectors = [p for n, p in model.named_parameters() if f".{DORA_MODULE}." in n]
    if not vectors:
        return None
    mine = [r for r in ledger.records if f".{DORA_MODULE}." in f"{r.module}."]
    saved = sum(r.bytes for r in mine)
    copies = [r for r in mine if r.kind == "weight-copy"]
    copy_bytes = sum(r.bytes for r in copies)
    dtypes = "/".join(sorted({str(r.dtype).removeprefix("torch.") for r in copies}))
    where = (
        f", {format_bytes(copy_bytes)} of them {len(copies)} dequantized weight copies ({dtypes}: with "
        "lora_dropout PEFT computes the base output again as F.linear(dropout(x), W) from the dequantized "
        "weight, and autograd keeps W; lora_dropout 0 reuses the base layer's output)"
        if copies
        else ", no weight copy (without lora_dropout PEFT reuses the base layer's output; the weight is "
        "dequantized each forward for the weight norm, a transient)"
    )
    return Finding(
        checks.DORA,
        f"DoRA (PEFT use_dora): {len(vectors)} magnitude vectors ({sum(p.numel() for p in vectors):,} trainable "
        f"params); its {DORA_MODULE} modules saved {format_bytes(saved)} for backward{where}",
        saved,
    )


TECHNIQUE = Technique(
    name="use_dora",
    description="PEFT's DoRA: a trained magnitude vector per adapted layer, its forward dequantizing the base weight",
    stage="around",
    applies=applies,
    unmodelled="no analytic model for DoRA (use_dora): measured only",
    measured=measured,
)
