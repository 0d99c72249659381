"""Padding-free batches (``--padding-free``, TRL's ``padding_free``; with ``--packing``, TRL's bfd packing): the
rows flattened into one with position ids that restart per sequence (:func:`vramguard.workload.models.padding_free_batch`
for the loop; TRL's own collator for ``trl sft``).

The batch is made by the step's data (the loop's rows, the trainer's collator), not by a context on the step: its
context is empty. This module is the technique's value: whether a step uses it and the alternative ``--fit``
offers."""

from __future__ import annotations

import dataclasses

from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step's batches are padding-free."""
    return bool(config.padding_free)


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """For a step whose batches are padded: ``--padding-free`` on vramguard's loop; ``--packing --padding-free`` (bfd,
    padding-free) on ``trl sft``, whose SFTTrainer refuses padding_free without packing at a max_length; nothing on
    transformers' Trainer, which has no padding-free collator."""
    if config.padding_free or place.trainer == "trainer":
        return None
    if place.trainer == "sft":
        return "--packing --padding-free", dataclasses.replace(config, padding_free=True, packing=True)
    return "--padding-free", dataclasses.replace(config, padding_free=True)


TECHNIQUE = Technique(
    name="padding_free",
    description="padding-free batches: the rows flattened into one, position ids restarting per sequence",
    stage="under",
    applies=applies,
    cheaper=cheaper,
)
