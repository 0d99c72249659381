"""Liger's kernels (``--use-liger-kernel``, Trainer's ``use_liger_kernel``): applied as transformers' Trainer
applies them, priced on meta from liger-kernel's own code (:mod:`vramguard.estimate.liger`)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from vramguard.step import verdict as checks
from vramguard.step.report import Finding
from vramguard.step.request import StepRequest
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step runs Liger's kernels."""
    return bool(config.use_liger_kernel)


def refuse(request: StepRequest) -> None:
    """Before anything is built: the liger extra, a CUDA target and a meta run are needed."""
    from vramguard.estimate.liger import check

    check(request.target, request.device)


def context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """Liger applied to the model for the step, its Triton launches skipped; around the tracker (the kernels are
    in place when it starts). Yields what ran."""
    from vramguard.estimate.liger import liger_kernel
    from vramguard.estimate.meta import MetaQLoRAModel

    assert isinstance(model, MetaQLoRAModel)
    return liger_kernel(model.model, request.target, model.host_labels())


def findings(model: Any, request: StepRequest, seen: dict[str, Any]) -> list[Finding]:
    """One line on what ran (liger-kernel's version, the launches skipped, the cross-entropy's chunk)."""
    from vramguard.estimate.liger import liger_line

    return [Finding(checks.LIGER, liger_line(seen))]


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """``--use-liger-kernel`` for a step without it, on CUDA with the liger extra installed, where vramguard's loop
    prices it (the trainers' steps on meta do not run it yet)."""
    from vramguard.estimate.liger import missing

    if config.use_liger_kernel or place.target != "cuda" or place.trainer != "loop" or missing() is not None:
        return None
    return "--use-liger-kernel", dataclasses.replace(config, use_liger_kernel=True)


TECHNIQUE = Technique(
    name="use_liger_kernel",
    description="Liger's Triton kernels and fused linear cross-entropy, applied as Trainer applies them",
    stage="around",
    applies=applies,
    context=context,
    refuse=refuse,
    findings=findings,
    cheaper=cheaper,
)
