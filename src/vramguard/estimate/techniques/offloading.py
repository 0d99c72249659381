"""Activation offloading (``--offload-activations``, TRL's ``activation_offloading``): what autograd saves is kept
on the host, :func:`torch.autograd.graph.save_on_cpu` emulated on meta
(:class:`~vramguard.estimate.offload.OffloadActivations`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vramguard.estimate.offload import OffloadActivations
from vramguard.step import verdict as checks
from vramguard.step.report import Finding
from vramguard.step.request import StepRequest
from vramguard.step.technique import Place, Technique
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig


def applies(config: QLoRAConfig) -> bool:
    """Whether the step offloads its activations."""
    return bool(config.offload_activations)


def context(model: Any, request: StepRequest) -> OffloadActivations:
    """save_on_cpu around every forward of the model, its host copies outside the trackers: under the tracker,
    which counts the copies back in backward."""
    return OffloadActivations(model.model)


def findings(model: Any, request: StepRequest, seen: OffloadActivations) -> list[Finding]:
    """The activations offloaded to the host: how many a step, and their peak on the host."""
    cuda = request.target == "cuda"
    return [
        Finding(
            checks.OFFLOADING,
            f"activations offloaded to the host (save_on_cpu, emulated): {seen.packs // request.steps:,} saved "
            f"tensors per step, at most {format_bytes(seen.host_peak_bytes)} of host memory at once, "
            + ("not in the device figures" if cuda else "in the total (the host's: --device cpu)")
            + "; copied back one by one in backward (counted there). "
            "The per-layer table lists what stays on the device",
            seen.host_peak_bytes,
        )
    ]


def cheaper(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """``--offload-activations`` for a step that does not offload, on CUDA (on the host target offloading to the
    host saves nothing), where vramguard's loop prices it (the trainers' steps on meta do not run it yet)."""
    if config.offload_activations or place.target != "cuda" or place.trainer != "loop":
        return None
    return "--offload-activations", dataclasses.replace(config, offload_activations=True)


TECHNIQUE = Technique(
    name="offload_activations",
    description="activation offloading: the tensors autograd saves kept on the host (save_on_cpu)",
    stage="under",
    applies=applies,
    context=context,
    findings=findings,
    cheaper=cheaper,
)
