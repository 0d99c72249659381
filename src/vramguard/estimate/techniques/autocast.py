"""bf16 autocast (``--bf16``, Trainer's ``bf16``): the forward and the loss under ``torch.autocast(bf16)``, run on
meta with the target's own autocast policy (:mod:`vramguard.estimate.autocast`).

Its context stays where the step's other forced decisions are made
(:func:`vramguard.estimate.run.meta_step_contexts`): the trainers' steps and a sharded step's ranks enter it there
too, so moving it here would split one decision in two places. This module is the technique's value: whether a
step uses it and the alternative ``--fit`` offers."""

from __future__ import annotations

import dataclasses

from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step runs under bf16 autocast."""
    return config.mixed_precision == "bf16"


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """``--bf16`` for a step without autocast, on a card that runs bf16 (CUDA at compute capability 8.0 or newer;
    not a T4) or on the CPU (its autocast has bf16). Not for one under fp16 autocast: half precision already."""
    if config.mixed_precision != "no" or not (place.ampere or place.target == "cpu"):
        return None
    return "--bf16", dataclasses.replace(config, mixed_precision="bf16")


TECHNIQUE = Technique(
    name="bf16",
    description="bf16 autocast: the forward and the loss under torch.autocast(bf16), as accelerate runs them",
    stage="around",
    applies=applies,
    cheaper=cheaper,
)
