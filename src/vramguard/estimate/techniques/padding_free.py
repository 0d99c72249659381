"""Padding-free batches (``--padding-free``, TRL's ``padding_free``; with ``--packing``, TRL's bfd packing): the
rows flattened into one with position ids that restart per sequence (:func:`vramguard.workload.models.padding_free_batch`
for the loop; TRL's own collator for ``trl sft``).

The batch itself is the step's data (the loop's rows, the trainer's collator). On meta the position ids have no
values, so transformers' question "does each row hold one sequence?" (``find_packed_sequence_indices``, and
FlashAttention-2's ``_is_packed_sequence``) is answered as the real batch's boundaries answer it: that answer is
this technique's context (:func:`vramguard.estimate.meta.rows_answered`), entered under the tracker; the step's
decisions (:func:`vramguard.estimate.meta.target_decisions`) and the flash kernel ask it when transformers asks."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from vramguard.step.request import StepRequest
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step's batches are padding-free."""
    return bool(config.padding_free)


def context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[Any]:
    """The meta run's answer on the rows: the request's (``one_sequence_per_row``: the data's bound, packed rows
    priced one sequence each), else what the padding-free batch's boundaries say
    (:attr:`vramguard.estimate.meta.MetaQLoRAModel.one_sequence_per_row`)."""
    from vramguard.estimate.meta import rows_answered

    rows = request.one_sequence_per_row
    return rows_answered(model.one_sequence_per_row if rows is None else rows)


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
    context=context,
    cheaper=cheaper,
)
