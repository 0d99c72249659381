"""What a step refuses before anything is built, whichever runs it (the audit on a device, the estimate on meta)."""

from __future__ import annotations

from vramguard.errors import UsageError
from vramguard.workload.models import QLoRAConfig


def refuse_fp16_on_cpu(config: QLoRAConfig, device_type: str) -> None:
    """fp16 autocast on the CPU is refused (:class:`UsageError`), as accelerate refuses it for Trainer
    ("fp16 mixed precision requires a device in ...", with no GradScaler for the CPU)."""
    if config.mixed_precision == "fp16" and device_type == "cpu":
        raise UsageError(
            "fp16 mixed precision runs on a GPU only (accelerate refuses it on the CPU, as Trainer would): "
            "use --bf16, or estimate --device cuda"
        )
