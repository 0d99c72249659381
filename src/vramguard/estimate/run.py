"""One QLoRA training step on the meta device, measured like the audit's, as an audit report.

The ledger and the storage tracker run unchanged: on meta every storage still has its real size,
so saved bytes per module and live bytes per phase are the libraries' own, without data. The
report is :class:`vramguard.audit.report.AuditReport` (the audit's schema), with ``device`` ``meta`` and
``estimate`` (:class:`~vramguard.audit.report.DeviceEstimate`) filled in.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from vramguard.audit.report import AuditReport, DeviceEstimate, Overhead, Verdict
from vramguard.audit.run import _assemble
from vramguard.errors import UsageError
from vramguard.estimate.meta import META, build_meta, forced_decisions
from vramguard.measure.tracker import MemoryTracker, StorageTracker
from vramguard.model.estimate import qlora_budget, weights_budget
from vramguard.units import format_bytes
from vramguard.workload.families import NoAnalyticModel
from vramguard.workload.models import ModelSpec, QLoRAConfig, QLoRAModel, parse_dtype
from vramguard.workload.training import PHASES, make_optimizer, run_steps

MiB = 1 << 20

CUDA_CONTEXT_BYTES = 512 * MiB
"""Assumed: the CUDA context and loaded kernels (torch + bitsandbytes), outside the caching allocator.
Typically 300-600 MiB with CUDA 12 and lazy module loading; more without it. Not measured here."""

CUBLAS_WORKSPACE_BYTES = 32 * MiB
"""Assumed: one cuBLAS/cuBLASLt workspace (torch's default on recent GPUs, ``:4096:8`` = 32 MiB).
torch takes it from the caching allocator, so a real ``max_memory_allocated`` includes it, but a meta
run calls no cuBLAS."""

FRAGMENTATION = 0.10
"""Assumed: reserved minus allocated at the peak, as a share of the allocator peak (the caching
allocator rounds blocks and keeps freed ones). Workload dependent; not measured here."""


def overheads(allocator_peak: int) -> list[Overhead]:
    """What the allocator peak (``torch.cuda.max_memory_allocated``) of the estimate leaves out."""
    return [
        Overhead(
            "CUDA context + kernels",
            CUDA_CONTEXT_BYTES,
            "assumed 512 MiB (typically 300-600 MiB, CUDA 12 lazy loading); outside the allocator",
        ),
        Overhead(
            "cuBLAS workspace",
            CUBLAS_WORKSPACE_BYTES,
            "assumed 32 MiB (torch's default :4096:8); in max_memory_allocated on a GPU, absent on meta",
        ),
        Overhead(
            "fragmentation allowance",
            int(allocator_peak * FRAGMENTATION),
            f"assumed {FRAGMENTATION:.0%} of the allocator peak (reserved - allocated); workload dependent",
        ),
    ]


def check_context(config: QLoRAConfig, spec: ModelSpec) -> None:
    """A sequence longer than the model's positions is bad input (said with the estimate's number
    by the caller); everything else is answered, however large: nothing is allocated."""
    limit = spec.fields.get("max_position_embeddings")
    if isinstance(limit, int) and config.seq_len > limit:
        raise _TooLong(limit)


class _TooLong(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit")
"""adamw: ``torch.optim.AdamW`` (what the audit uses); adamw-8bit: ``bitsandbytes.optim.AdamW8bit``
(two uint8 moments with blockwise absmax). Paged optimizers need CUDA unified memory: not offered."""


def make_estimate_optimizer(q: QLoRAModel, name: str = "adamw") -> torch.optim.Optimizer:
    if name == "adamw":
        return make_optimizer(q)
    if name == "adamw-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(q.trainable_parameters(), lr=1e-4)
    raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def run_estimate(
    config: QLoRAConfig,
    steps: int = 2,
    top: int = 3,
    method: str = "qlora",
    device: str = META,
    optimizer: str = "adamw",
) -> AuditReport:
    """Build ``config``'s model on meta, run ``steps`` steps under the tracker (the ledger on the
    first) and return the report. ``config.device`` is only validated; the run is on meta.

    ``method``: :data:`vramguard.estimate.meta.METHODS`. ``device="cpu"`` runs the same code on real
    tensors (random weights; not for ``qlora``, whose CPU reference is ``vramguard audit``): the
    tests' reference for ``lora`` and ``full``.
    """
    if steps < 1:
        raise UsageError(f"steps must be at least 1, got {steps}")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    config = dataclasses.replace(config, extra={**config.extra, "method": method, "optimizer": optimizer})
    config.validate()
    spec = ModelSpec.load(config.model)
    too_long: _TooLong | None = None
    try:
        check_context(config, spec)
    except _TooLong as exc:
        too_long = exc
    t0 = time.perf_counter()
    q = build_meta(config, spec, method=method, device=device)
    opt = make_estimate_optimizer(q, optimizer)
    try:
        if method != "qlora":
            raise NoAnalyticModel(f"no analytic model for --method {method}")
        budget = qlora_budget(
            q.model,
            q.spec,
            batch=config.batch,
            seq=config.seq_len,
            rank=config.lora_rank,
            compute_dtype=parse_dtype(config.compute_dtype),
            double_quant=config.double_quant,
            checkpointing=config.gradient_checkpointing,
            attn_implementation=q.attn_implementation,
            lora_dropout=config.lora_dropout > 0,
            device_type="cpu",  # the meta run takes the CPU's kernel choices (see estimate.meta)
        )
    except NoAnalyticModel as exc:
        budget = weights_budget(q.model, double_quant=config.double_quant, reason=str(exc))
    # every device: meta storages and the host-side ones the libraries keep (Adam's step counters),
    # as the CPU audit counts them
    source = StorageTracker(None)
    source.device = device
    with forced_decisions() as taken, MemoryTracker(device, model=q.model, source=source) as tracker:
        results, ledger = run_steps(q, steps, tracker, optimizer=opt, ledger_step=0)
    assert ledger is not None
    if taken["find_packed_sequence_indices"] == 0 and taken["scaled_dot_product_attention"] == 0:
        taken = {}  # neither branch exists in this transformers version / model: nothing was forced
    report = _assemble(q, q.config, budget, tracker, results, ledger, opt, top, time.perf_counter() - t0)
    weights = report.totals.model_resident_bytes
    trainable = sum(p.numel() * p.element_size() for p in q.trainable_parameters())
    phase = max(PHASES, key=lambda name: report.phases[name].peak_bytes)
    step_peak = report.phases[phase].peak_bytes
    allocator = weights + trainable + step_peak
    extra = overheads(allocator)
    estimate = DeviceEstimate(
        weights_bytes=weights,
        trainable_bytes=trainable,
        step_peak_bytes=step_peak,
        peak_phase=phase,
        allocator_peak_bytes=allocator,
        overhead_bytes=sum(o.bytes for o in extra),
        total_bytes=allocator + sum(o.bytes for o in extra),
        overheads=extra,
        forced_decisions=dict(taken),
    )
    if too_long is not None:
        raise UsageError(
            f"seq-len {config.seq_len:,} is beyond {spec.name}'s {too_long.limit:,} positions "
            f"(max_position_embeddings); it would need {format_bytes(estimate.total_bytes)} "
            f"({estimate.allocator_peak_bytes:,} B allocator peak, estimated on meta)"
        )
    fb = format_bytes
    line = (
        f"estimate: {fb(estimate.total_bytes)} on the device = allocator peak {fb(allocator)} "
        f"(weights {fb(weights)}, trainable {fb(trainable)}, {phase} peak {fb(step_peak)}) "
        f"+ {fb(estimate.overhead_bytes)} outside it (assumed)"
    )
    notes = [
        n
        for n in report.verdict.notes
        if not n.startswith("one step only") and (method == "qlora" or "prepare_model_for_kbit" not in n)
    ]
    notes.append(
        "estimated on the meta device: shapes and dtypes are real, values are not; unvalidated on GPU"
    )
    verdict = Verdict(
        ok=report.verdict.ok,
        line=line if report.verdict.ok else report.verdict.line + "; " + line,
        problems=report.verdict.problems,
        notes=notes,
    )
    return dataclasses.replace(report, verdict=verdict, estimate=estimate, device=device)
