"""FlashAttention-2 (``--attn-implementation flash_attention_2``): transformers' flash path on meta, flash-attn
2's kernels priced from its own rules (:mod:`vramguard.estimate.flash`).

Its context (the kernel) stays in :func:`vramguard.estimate.run.meta_step_contexts`, entered after the tracker
and by the trainers' steps and a sharded step's ranks as well; this module is the technique's value: whether a
step uses it and the alternative ``--fit`` offers."""

from __future__ import annotations

import dataclasses

from vramguard.estimate.flash import FLASH_ATTENTION_2
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step's attention is FlashAttention-2."""
    return config.attn_implementation == FLASH_ATTENTION_2


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """``--attn-implementation flash_attention_2`` for a step on sdpa or eager attention, on a card that has it
    (CUDA at compute capability 8.0 or newer), where the attention runs in half precision (flash-attn takes
    fp16/bf16 only: under autocast; without it ``--bf16`` comes first). On a trainer's step too, whatever the
    compute dtype: transformers casts fp32 q, k, v to the target's autocast dtype, which the trainer's autocast
    on meta is (:func:`vramguard.estimate.trainer._accelerate_autocast_on_meta`)."""
    if config.attn_implementation not in ("sdpa", "eager") or not place.ampere or config.mixed_precision == "no":
        return None
    return f"--attn-implementation {FLASH_ATTENTION_2}", dataclasses.replace(
        config, attn_implementation=FLASH_ATTENTION_2
    )


TECHNIQUE = Technique(
    name=FLASH_ATTENTION_2,
    description="FlashAttention-2: transformers' flash path, flash-attn 2's kernels priced from its rules",
    stage="under",
    applies=applies,
    cheaper=cheaper,
)
