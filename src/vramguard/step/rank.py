"""One rank of a sharded step, measured as the single-device step is: shared by the audit's real ranks, the
estimate's ranks on torch's fake process group and ``VramGuardCallback``'s ranks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from vramguard.measure.tracker import MemorySource, MemoryTracker
from vramguard.model.analytic import Expectation, weights_expectation
from vramguard.step import verdict as checks
from vramguard.step.assemble import assemble_report
from vramguard.step.report import AuditReport, DistributedSection, Finding, RankRow
from vramguard.step.request import StepRequest
from vramguard.step.technique import Technique
from vramguard.workload.models import QLoRAConfig, QLoRAModel, parse_dtype
from vramguard.workload.sharding import ShardingConfig, apply_sharding, rank_terms, transient_terms
from vramguard.workload.training import PHASES, make_optimizer, run_steps


def measure_rank(
    q: QLoRAModel,
    request: StepRequest,
    sharding: ShardingConfig,
    mesh: Any,
    rank: int,
    top: int,
    expected: Expectation,
    source: MemorySource | None = None,
    meta_run: bool = False,
    engine: str = "",
    techniques: Sequence[Technique] = (),
) -> tuple[AuditReport, RankRow]:
    """Shard ``q``'s model with the real engine over ``mesh`` and run the request's ``steps`` steps of vramguard's
    loop on its ``device`` (meta, or the config's: :meth:`StepRequest.on_device`) under the audit's tracker and
    ledger; this rank's report and its :class:`RankRow`.

    The process group is the caller's (gloo between real processes, or torch's fake process group on meta).
    ``expected`` is the analytic expectation of the unsharded model (weights and activations of one rank's
    batch). ``techniques``: those the step uses (:func:`vramguard.estimate.techniques.used_by`, given by the
    caller: the step part imports no registry), whose notes on the measured step the report takes (DoRA's);
    none by default."""
    config, steps, device = request.config, request.steps, request.device
    t0 = time.perf_counter()
    model = apply_sharding(q.model, sharding, mesh)
    q = dataclasses.replace(q, model=model)
    optimizer = make_optimizer(q, name=config.optimizer)
    with MemoryTracker(device, model=model, source=source) as tracker:
        results, ledger = run_steps(q, steps, tracker, optimizer=optimizer, ledger_step=0)
    assert ledger is not None
    transient = transient_terms(model, parse_dtype(config.compute_dtype))  # FSDP1 sizes its units lazily
    report = assemble_report(
        q,
        config,
        expected,
        tracker,
        results,
        ledger,
        optimizer,
        top,
        time.perf_counter() - t0,
        meta_run=meta_run,
        techniques=techniques,
    )
    row = rank_row(report, model, ledger, rank, transient)
    return report, row


def rank_row(
    report: AuditReport, model: torch.nn.Module, ledger: Any, rank: int, transient: dict[str, int]
) -> RankRow:
    """One rank's :class:`RankRow` from its report, its (sharded) model and its ledger: the terms of what it
    holds (:func:`~vramguard.workload.sharding.rank_terms`), the highest phase peak, and the allocator peak =
    weights + LoRA shard + that peak. Shared by the audit's ranks, the estimate's and ``VramGuardCallback``'s."""
    terms = rank_terms(model)
    return row_of(
        report,
        ledger,
        rank,
        transient,
        terms=terms.to_dict(),
        trainable_bytes=terms.trainable_bytes,
        resident_at_start=report.totals.model_resident_bytes + terms.trainable_bytes,
    )


def row_of(
    report: AuditReport,
    ledger: Any,
    rank: int,
    transient: dict[str, int],
    *,
    terms: dict[str, int],
    trainable_bytes: int,
    resident_at_start: int,
) -> RankRow:
    """A :class:`RankRow` from a rank's report and ledger, what the engine says the rank holds (``terms``, its
    ``trainable_bytes``) and what was resident when the step's tracker started: the allocator peak is that plus
    the highest phase peak. FSDP's rows (:func:`rank_row`) and ZeRO-3's are both made here."""
    phases = {name: report.phases[name].peak_bytes for name in PHASES if name in report.phases}
    peak_phase = max(phases, key=lambda n: phases[n])
    reserved = [p.reserved_peak_bytes for p in report.phases.values() if p.reserved_peak_bytes is not None]
    allocator = resident_at_start + phases[peak_phase]
    return RankRow(
        rank=rank,
        weights_bytes=report.totals.model_resident_bytes,
        trainable_bytes=trainable_bytes,
        lora_training_bytes=report.budget.measured_lora_training_bytes,
        saved_bytes=report.totals.saved_bytes,
        gathered_weight_bytes=ledger.gathered_bytes,
        gathered_held_bytes=ledger.gathered_held_bytes,
        step_peak_bytes=phases[peak_phase],
        peak_phase=peak_phase,
        allocator_peak_bytes=allocator,
        reserved_bytes=max(reserved) if reserved else None,
        total_bytes=allocator,
        phases=phases,
        terms=terms,
        transient=transient,
    )


def merged(
    reports: list[AuditReport], rows: list[RankRow], sharding: ShardingConfig, engine: str
) -> AuditReport:
    """Rank 0's report with the ``distributed`` section of every rank; its verdict fails when any rank's does
    (each other rank's problems are named with its rank)."""
    first = reports[0]
    findings: list[Finding | None] = list(first.verdict.findings)
    for r, report in enumerate(reports[1:], start=1):
        findings += [
            dataclasses.replace(f, message=f"rank {r}: {f.message}")
            for f in report.verdict.findings
            if f.problem
        ]
    fb = _fmt
    peak = max(rows, key=lambda row: row.allocator_peak_bytes)
    headline = (
        f"{sharding.sharding} over {sharding.world_size} ranks ({engine}): rank {peak.rank} peaks at "
        f"{fb(peak.allocator_peak_bytes)} (weights {fb(peak.weights_bytes)}, {peak.peak_phase} peak "
        f"{fb(peak.step_peak_bytes)})"
    )
    verdict = checks.verdict(findings, len(first.steps), headline=headline)
    if verdict.ok:
        verdict = dataclasses.replace(verdict, line=f"OK: {headline}")
    section = DistributedSection(
        world_size=sharding.world_size,
        sharding=sharding.sharding,
        cpu_offload=sharding.cpu_offload,
        engine=engine,
        per_rank=rows,
    )
    return dataclasses.replace(first, verdict=verdict, distributed=section)


def _fmt(n: int) -> str:
    from vramguard.units import format_bytes

    return format_bytes(n)


RECIPE_NOT_MODELLED = (
    "no analytic model for a rank of the FSDP + QLoRA recipe (its fp32 LoRA adapters keep fp32 copies of their "
    "inputs, its norms are not upcast, an unsharded unit's weights may be kept for backward): measured only"
)


def rank_expectation(q: QLoRAModel, config: QLoRAConfig) -> Expectation:
    """The expectation a rank's report carries: the unsharded model's weights and LoRA terms, no activation
    formula (:data:`RECIPE_NOT_MODELLED`). Taken before sharding."""
    return weights_expectation(q.model, double_quant=config.double_quant, reason=RECIPE_NOT_MODELLED)
