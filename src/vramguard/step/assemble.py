"""The one assembler of a step report: what a producer measured (:class:`Measured`) in, the
:class:`~vramguard.step.report.AuditReport` with its verdict out.

The producers are vramguard's loop (:func:`vramguard.audit.run.run_audit`), the meta-device run
(:func:`vramguard.estimate.run.run_estimate`) and the Trainer callback
(:class:`vramguard.integrations.transformers.VramGuardCallback`); each measures its own way, hands the
numbers and its own findings here, and gets the same document and the same verdict rules
(:mod:`vramguard.step.verdict`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vramguard import __version__, environment
from vramguard.measure.events import Timeline, timeline
from vramguard.measure.ledger import LedgerReport
from vramguard.measure.storage import frozen_resident_bytes, local_tensor, storage_nbytes
from vramguard.measure.tracker import MemoryTracker
from vramguard.model.analytic import Expectation
from vramguard.step import verdict as checks
from vramguard.step.report import (
    SCHEMA_VERSION,
    AnalyticComparison,
    AuditReport,
    Finding,
    LayerRow,
    PhasePeak,
    StepRow,
    Totals,
)
from vramguard.step.technique import Technique, measured_notes
from vramguard.workload.models import QLoRAConfig, QLoRAModel
from vramguard.workload.training import PHASES, StepResult


def lora_training_bytes(trainable: Iterable[torch.nn.Parameter], optimizer: Any) -> int:
    """LoRA weights + their gradients (same size, alive between backward and step) + optimizer state.
    ``optimizer`` may be a wrapper holding the real one as ``.optimizer`` (accelerate's, in a Trainer), or
    DeepSpeed's ZeRO-3 optimizer (:func:`vramguard.workload.zero3.lora_training_bytes`: partitions, fp32 master,
    gradient partitions)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        from vramguard.workload import zero3

        return zero3.lora_training_bytes(trainable, optimizer)
    weights = sum(local_tensor(p).numel() * p.element_size() for p in trainable)  # a DTensor: its shard
    inner = getattr(optimizer, "optimizer", optimizer)
    state = sum(
        storage_nbytes(t)
        for s in getattr(inner, "state", {}).values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return 2 * weights + state


def totals_of(ledger: LedgerReport, model: torch.nn.Module, layers: list[LayerRow]) -> Totals:
    """The report's totals: what the ledger saw kept, by probe and kind, and the model's resident bytes."""
    return Totals(
        saved_bytes=ledger.saved_bytes,
        hook_bytes=ledger.bytes_by("hook"),
        ctx_bytes=ledger.bytes_by("ctx"),
        activation_bytes=ledger.activation_bytes,
        weight_copy_bytes=ledger.weight_copy_bytes,
        resident_seen_bytes=ledger.resident_bytes,
        model_resident_bytes=frozen_resident_bytes(model),
        outside_layers_bytes=ledger.saved_bytes - sum(row.saved_bytes for row in layers),
        gathered_weight_bytes=ledger.gathered_bytes,
    )


def compare_with_expectation(
    expected: Expectation, totals: Totals, ledger: LedgerReport, measured_lora_training: int
) -> AnalyticComparison:
    """Measured against the analytic expectation (activation terms ``None`` where no analytic model applies)."""
    modelled = not expected.no_analytic_model
    return AnalyticComparison(
        quantized_params=expected.quantized_params,
        lora_params=expected.lora_params,
        other_params=expected.other_params,
        analytic_weights_bytes=expected.weights_bytes,
        measured_weights_bytes=totals.model_resident_bytes,
        analytic_lora_training_bytes=expected.lora_training_bytes,
        measured_lora_training_bytes=measured_lora_training,
        analytic_activation_bytes=expected.activation_bytes if modelled else None,
        measured_activation_bytes=ledger.saved_bytes,
        analytic_logits_bytes=expected.logits_bytes if modelled else None,
        analytic_outside_layers_bytes=expected.logits_bytes + expected.shared_bytes if modelled else None,
        activation_ratio=(
            (ledger.saved_bytes / expected.activation_bytes if expected.activation_bytes else 0.0)
            if modelled
            else None
        ),
        analytic_model=expected.family if modelled else None,
        no_analytic_model=expected.no_analytic_model,
    )


def layer_rows(
    ledger: LedgerReport, expected: Expectation | None = None, top: int = 3, family: Any = None
) -> list[LayerRow]:
    """Per decoder layer: what the ledger saw kept, by kind, the ``top`` modules, and the analytic
    expected's figure for the layer (``None`` without an expected or an analytic model). With a vision-language
    model's ``family`` (:class:`vramguard.workload.vision.VisionFamily`), per layer of each stack
    (:meth:`~vramguard.workload.vision.VisionFamily.layer_of`: the tower's blocks, the projector, the language
    model's decoder layers), in the stacks' order, each row with its stack."""
    if family is None:
        groups = ledger.by_layer()
        order = sorted(groups, key=lambda n: (n.rsplit(".", 1)[0], int(n.rsplit(".", 1)[1])))
        return [_layer_row(name, groups[name], expected, top) for name in order]
    from vramguard.workload.vision import STACKS

    groups = ledger.group(lambda r: family.layer_of(r.module))
    stacks = {name: family.stack_of(name) for name in groups}

    def key(name: str) -> tuple[int, str, int]:  # by stack, then by list and index (a projector: no index)
        head, _, index = name.rpartition(".")
        return (STACKS.index(stacks[name]), *((head, int(index)) if index.isdigit() else (name, -1)))

    return [_layer_row(name, groups[name], expected, top, stacks[name]) for name in sorted(groups, key=key)]


def _layer_row(
    name: str, records: list[Any], expected: Expectation | None, top: int, stack: str | None = None
) -> LayerRow:
    """The row of one layer's ``records``; the analytic figure is a language model's decoder layer's only."""
    tail = name.rpartition(".")[2]
    index = int(tail) if tail.isdigit() else -1
    by_module: dict[str, int] = defaultdict(int)
    for r in records:
        by_module[r.module.removeprefix(name).lstrip(".") or "(layer)"] += r.bytes
    analytic: int | None = None
    if stack in (None, "language model") and expected is not None and not expected.no_analytic_model:
        analytic = expected.layer_bytes[index] if 0 <= index < len(expected.layer_bytes) else 0
    return LayerRow(
        name=name,
        saved_bytes=sum(r.bytes for r in records),
        activation_bytes=sum(r.bytes for r in records if r.kind == "activation"),
        weight_copy_bytes=sum(r.bytes for r in records if r.kind == "weight-copy"),
        analytic_bytes=analytic,
        top_modules=sorted(by_module.items(), key=lambda kv: -kv[1])[:top],
        stack=stack,
    )


def phase_peaks(tracker: MemoryTracker, phases: Iterable[str]) -> dict[str, PhasePeak]:
    """The peaks of the named ``phases`` the tracker saw (one it never entered is left out)."""
    peaks = {}
    for name in phases:
        stats = tracker.result.phases.get(name)
        if stats is not None:
            peaks[name] = PhasePeak(stats.peak_bytes, stats.peak_above_start, stats.reserved_peak_bytes)
    return peaks


@dataclass
class Measured:
    """What one producer measured over its steps, with its own findings, for :func:`assemble`.

    ``findings_first`` go before the shared checks (weight copies, leak), ``findings`` after them; each
    list keeps its order. ``ok_detail`` ends the OK line (``None``: ``; `` and the saved activations
    against the analytic model, :func:`~vramguard.step.verdict.activation_summary`); ``offloaded``: the activations were kept on the host (no deviation note against the model)."""

    model: torch.nn.Module
    ledger: LedgerReport
    tracker: MemoryTracker
    phases: tuple[str, ...]
    steps: list[StepRow]
    expected: Expectation
    optimizer: Any
    trainable: Iterable[torch.nn.Parameter]
    config: dict[str, Any]
    architecture: dict[str, Any]
    environment_device: str
    elapsed_s: float
    leak_tolerance: int
    top: int = 3
    findings_first: list[Finding | None] = field(default_factory=list)
    findings: list[Finding | None] = field(default_factory=list)
    ok_detail: str | None = None
    offloaded: bool = False
    timeline: Timeline | None = None
    autocast: str = "no"  # Trainer's mixed precision (QLoRAConfig.mixed_precision)
    family: Any = None  # a vision-language model's VisionFamily: the layer table per layer of each stack


def autocast_cast_modules(model: torch.nn.Module) -> frozenset[str]:
    """Modules with an unquantized 2-D weight (no bitsandbytes ``quant_state``): under autocast, a copy of
    their weight saved for backward is autocast's cast, not a dequantization."""
    return frozenset(
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
        and getattr(module.weight, "quant_state", None) is None
    )


def assemble(m: Measured) -> AuditReport:
    """The report and its verdict from one producer's measurement."""
    layers = layer_rows(m.ledger, m.expected, m.top, m.family)
    totals = totals_of(m.ledger, m.model, layers)
    comparison = compare_with_expectation(
        m.expected, totals, m.ledger, lora_training_bytes(m.trainable, m.optimizer)
    )
    cast = autocast_cast_modules(m.model) if m.autocast != "no" else frozenset()
    judged = [
        *m.findings_first,
        checks.weight_copies(m.ledger, cast),
        checks.autocast_casts(m.ledger, cast, m.autocast),
        checks.leak(m.steps, m.leak_tolerance),
        checks.activation_comparison(comparison, offloaded=m.offloaded),
        *m.findings,
    ]
    return AuditReport(
        schema_version=SCHEMA_VERSION,
        vramguard_version=__version__,
        environment=environment.collect(m.environment_device).to_dict(),
        config=m.config,
        device=m.tracker.result.device,
        layers=layers,
        totals=totals,
        phases=phase_peaks(m.tracker, m.phases),
        budget=comparison,  # schema 1's key for the comparison with the analytic expectation
        steps=m.steps,
        leak_bytes=checks.leak_bytes([s.retained_bytes for s in m.steps]),
        verdict=checks.verdict(
            judged,
            len(m.steps),
            ok_detail="; " + checks.activation_summary(comparison) if m.ok_detail is None else m.ok_detail,
        ),
        # (the saved records, then a sharded model's saved all-gathered weights: kind gathered-weight)
        records=[r.to_dict() for r in (*m.ledger.records, *m.ledger.gathered)],
        elapsed_s=round(m.elapsed_s, 3),
        architecture=m.architecture,
        timeline=m.timeline,
    )


def assemble_report(
    q: QLoRAModel,
    config: QLoRAConfig,
    expected: Expectation,
    tracker: MemoryTracker,
    results: list[StepResult],
    ledger: LedgerReport,
    optimizer: torch.optim.Optimizer,
    top: int,
    elapsed: float,
    meta_run: bool = False,
    *,
    techniques: Sequence[Technique],
) -> AuditReport:
    """The report of a run of vramguard's loop (the audit's, or with ``meta_run`` the estimate's) through
    :func:`~vramguard.step.assemble.assemble`: the build's notes, the fp32-activation check (``qlora``
    only: the norms are upcast by ``prepare_model_for_kbit_training``), the notes of the step's ``techniques``
    on what was measured (:func:`~vramguard.step.technique.measured_notes`: DoRA's) and, for the audit, the
    note that one step checks no leak. The meta run records its step options (method, optimizer, offloading)
    in the config."""
    steps = [
        StepRow(
            step=r.step + 1,
            loss=r.loss,
            retained_bytes=r.retained_bytes,
            retained_after_forward=r.after_forward_bytes - r.start_bytes,
            peak_bytes=r.peak_bytes,
        )
        for r in results
    ]
    return assemble(
        Measured(
            model=q.model,
            ledger=ledger,
            tracker=tracker,
            phases=PHASES,
            steps=steps,
            expected=expected,
            optimizer=optimizer,
            trainable=q.trainable_parameters(),
            config=config.to_dict(step_options=meta_run or config.optimizer != "adamw"),
            architecture={
                "model_type": q.spec.model_type,
                "model_class": q.model_class,
                "attn_implementation": q.attn_implementation,
                "analytic_model": None if expected.no_analytic_model else expected.family,
            },
            environment_device=config.device,
            elapsed_s=elapsed,
            leak_tolerance=checks.leak_tolerance(config.device),
            top=top,
            findings_first=checks.notes(checks.BUILD, q.notes),
            findings=[
                checks.fp32_activations(q.model, config.compute_dtype) if config.method == "qlora" else None,
                *measured_notes(techniques, q.model, ledger),
                checks.vision(q, ledger),
                None if meta_run else checks.one_step(steps),
            ],
            offloaded=config.offload_activations,  # on the host by design: no deviation note
            autocast=config.mixed_precision,
            timeline=timeline(tracker.events) if tracker.events is not None else None,
            family=getattr(getattr(q, "vision", None), "family", None),
        )
    )
