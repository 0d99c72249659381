"""bf16 autocast (``--bf16``, Trainer's ``bf16``): the forward and the loss under ``torch.autocast(bf16)``, run on
meta with the target's own autocast policy (:mod:`vramguard.estimate.autocast`). Named by the flag ``--fit``
offers; a step under fp16 autocast (``--fp16``) runs under the same context, in fp16.

Its context (:func:`vramguard.estimate.meta.target_autocast`) is entered around the tracker, inside the step's
decisions (:func:`vramguard.estimate.meta.target_decisions`, whose sdpa it casts for), by the loop's meta step,
the trainers' steps and a sharded step's ranks alike; what it yields counts the functions routed through the
target's autocast (the report's ``forced_decisions``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from vramguard.step.request import StepRequest
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step runs under Trainer's autocast: bf16 (or fp16, the same context in half precision)."""
    return config.mixed_precision != "no"


def context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[dict[str, int]]:
    """The target's autocast on meta for the step (Trainer's mixed precision, bf16 or fp16), around the tracker;
    yields its counts (``autocast_routed``, ``autocast_unprobed``)."""
    from vramguard.estimate.meta import target_autocast

    return target_autocast(request.target)


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """``--bf16`` for a step without autocast, on a card that runs bf16 (CUDA at compute capability 8.0 or newer;
    not a T4) or on the CPU (its autocast has bf16). Not for one under fp16 autocast: half precision already."""
    if config.mixed_precision != "no" or not (place.ampere or place.target == "cpu"):
        return None
    return "--bf16", dataclasses.replace(config, mixed_precision="bf16")


TECHNIQUE = Technique(
    name="bf16",
    description="bf16 autocast: the forward and the loss under torch.autocast(bf16) (or fp16), as accelerate runs them",
    stage="around",
    applies=applies,
    context=context,
    cheaper=cheaper,
)
