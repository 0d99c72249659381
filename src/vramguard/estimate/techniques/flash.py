"""FlashAttention-2 (``--attn-implementation flash_attention_2``): transformers' flash path on meta, flash-attn
2's kernels priced from its own rules (:mod:`vramguard.estimate.flash`).

Its context is the kernel (:func:`vramguard.estimate.flash.flash_attention_2`), entered under the tracker by the
loop's meta step, and by the trainers' steps and a sharded step's ranks (whose trackers start inside their own
runs); it is refused off CUDA when the context is made, before the step runs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from vramguard.errors import UsageError
from vramguard.estimate.flash import FLASH_ATTENTION_2
from vramguard.step.request import StepRequest
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step's attention is FlashAttention-2."""
    return config.attn_implementation == FLASH_ATTENTION_2


def context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[None]:
    """transformers' flash path on the model with flash-attn 2's kernels priced from its rules, under the
    tracker; a padding-free batch's rows answered as the padding-free technique's context says. Refused in one
    line off CUDA (flash-attn has no CPU build)."""
    from vramguard.estimate.flash import flash_attention_2

    if request.target != "cuda":
        raise UsageError("flash_attention_2 runs on CUDA only: estimate it with --device cuda")
    return flash_attention_2(model.model, request.target)


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
    context=context,
    cheaper=cheaper,
)
