"""``vramguard audit``: train a small QLoRA model for a few steps and say where its memory went.

The job: build the model (4-bit NF4 via transformers, LoRA via PEFT, random weights), run real
steps under the live tracker, itemise one forward with the ledger, set the analytic budget next
to the measurement and end with a verdict. Exit code 0 when the verdict is OK, 1 when it names a
problem (weight copies saved for backward, retained memory growing across steps), 2 on bad input.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vramguard import __version__, environment
from vramguard.audit.report import (
    SCHEMA_VERSION,
    AuditReport,
    BudgetComparison,
    LayerRow,
    PhasePeak,
    StepRow,
    Totals,
    Verdict,
)
from vramguard.errors import UsageError
from vramguard.measure.ledger import LedgerReport
from vramguard.measure.storage import frozen_resident_bytes, storage_nbytes
from vramguard.measure.tracker import MemoryTracker
from vramguard.model.estimate import (
    QUANT_BLOCKSIZE,
    Budget,
    activation_budget,
    qlora_budget,
    quantized_weight_bytes,
    weights_budget,
)
from vramguard.model.layers import checkpointed_layer_bytes, logits_fp32_bytes
from vramguard.units import format_bytes
from vramguard.workload.families import NoAnalyticModel
from vramguard.workload.models import ModelSpec, QLoRAConfig, QLoRAModel, build_qlora, parse_dtype
from vramguard.workload.training import PHASES, StepResult, make_optimizer, run_steps

ACTIVATION_BAND = 0.10
"""Measured activations within ±10 % of the analytic model count as agreeing."""

Progress = Callable[[str, int, int], None]


def resolve_device(name: str) -> str:
    """The device ``--device`` names: ``auto`` becomes cuda when torch sees a GPU, cpu otherwise."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) features of the seven linear projections of one Llama decoder layer."""
    f = spec.fields
    h, i, d = f["hidden_size"], f["intermediate_size"], spec.head_dim
    q, kv = f["num_attention_heads"] * d, f["num_key_value_heads"] * d
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def planned_budget(config: QLoRAConfig, spec: ModelSpec) -> Budget:
    """The analytic model of ``config`` from the model config alone, before anything is built.

    The activations are the family's own formula (:func:`activation_budget`, norms in fp32 as
    ``prepare_model_for_kbit_training`` leaves them); for a family without one, a lower bound any
    decoder keeps (each layer's input hidden state and the fp32 logits). The parameters are counted
    from the shapes: the seven projections per layer in 4 bits (fused projections hold the same
    elements), embeddings, lm_head and norms in fp32, LoRA on every projection. The tests hold it equal
    to the budget of the built model.
    """
    f = spec.fields
    try:
        empty = activation_budget(
            spec,
            batch=config.batch,
            seq=config.seq_len,
            rank=config.lora_rank,
            checkpointing=config.gradient_checkpointing,
            attn_implementation=config.attn_implementation,
            lora_dropout=config.lora_dropout > 0,
            device_type=torch.device(config.device).type,
        )
    except NoAnalyticModel as exc:
        per_layer = checkpointed_layer_bytes(config.batch, config.seq_len, f["hidden_size"])
        empty = Budget(
            layer_terms=[{"layer input (lower bound)": per_layer}] * f["num_hidden_layers"],
            logits_bytes=logits_fp32_bytes(config.batch, config.seq_len, f["vocab_size"]),
            no_analytic_model=str(exc),
        )
    layers, h, vocab = f["num_hidden_layers"], f["hidden_size"], f["vocab_size"]
    projections = _projections(spec)
    quantized = layers * sum(i * o for i, o in projections)
    quantized_bytes = layers * sum(
        quantized_weight_bytes(i * o, QUANT_BLOCKSIZE, config.double_quant) for i, o in projections
    )
    embeddings = vocab * h * (1 if f.get("tie_word_embeddings", False) else 2)
    other = embeddings + (2 * layers + 1) * h  # + input, post-attention and final norms
    lora = layers * sum(config.lora_rank * (i + o) for i, o in projections)
    return empty.with_weights(quantized, quantized_bytes, other, 4 * other, lora)


def available_memory(device: str) -> tuple[int, str]:
    """Bytes a run on ``device`` can still get, and what that number is."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free), f"is free on {device}"
    import psutil

    return int(psutil.virtual_memory().available), "of RAM is available"


def check_fits(config: QLoRAConfig, spec: ModelSpec | None = None) -> Budget:
    """Refuse (:class:`UsageError`) a configuration that cannot run here, before anything is allocated.

    Two checks. The audit builds the model once unquantized, in fp32 on the host, and writes that
    checkpoint to a temporary folder (random weights go through ``from_pretrained`` as users' do), so
    the host needs 4 B per parameter of RAM and of disk: a full-size preset (8B parameters: 32 GB) is
    refused here with that figure, not killed by the kernel mid-build. Then the training step's
    analytic memory must fit what the device has free; that model leaves out transient buffers, so it
    errs towards letting a run start.
    """
    spec = spec or ModelSpec.load(config.model)
    plan = planned_budget(config, spec)
    fb = format_bytes
    build = 4 * (plan.quantized_params + plan.other_params)
    host, host_what = available_memory("cpu")
    disk = shutil.disk_usage(tempfile.gettempdir()).free
    for room, what in ((host, host_what), (disk, f"free on {tempfile.gettempdir()}")):
        if build > room:
            raise UsageError(
                f"{spec.name} has {plan.quantized_params + plan.other_params:,} parameters: the audit builds "
                f"them once in fp32 from random weights ({fb(build)}) but only {fb(room)} {what}; audit a "
                "smaller preset"
            )
    available, what = available_memory(config.device)
    if plan.total_bytes > available:
        raise UsageError(
            f"{spec.name} at batch {config.batch} x seq {config.seq_len} needs at least {fb(plan.total_bytes)} "
            f"({plan.total_bytes:,} B by the analytic model: weights {fb(plan.weights_bytes)}, LoRA + grads "
            f"+ Adam {fb(plan.lora_training_bytes)}, saved activations {fb(plan.activation_bytes)}) but only "
            f"{fb(available)} {what}; lower --seq-len or --batch"
        )
    return plan


def budget_of(q: QLoRAModel, config: QLoRAConfig, device_type: str, analytic: bool = True) -> Budget:
    """The analytic budget of ``q``'s step for ``config`` with ``device_type``'s kernels; the weights
    alone (with the reason) where the analytic model has no answer, or with ``analytic`` False."""
    try:
        if not analytic:
            raise NoAnalyticModel(f"no analytic model for --method {config.extra.get('method')}")
        return qlora_budget(
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
            device_type=device_type,
        )
    except NoAnalyticModel as exc:  # measured all the same; compared with nothing
        return weights_budget(q.model, double_quant=config.double_quant, reason=str(exc))


def run_audit(
    config: QLoRAConfig, steps: int = 3, progress: Progress | None = None, top: int = 3
) -> AuditReport:
    """Build, train ``steps`` steps, measure; pure apart from the compute (no printing)."""
    if steps < 1:
        raise UsageError(f"steps must be at least 1, got {steps}")
    config.validate()
    check_fits(config)
    report_progress = progress or (lambda what, done, total: None)
    t0 = time.perf_counter()
    report_progress("building 4-bit model", 0, steps + 1)
    q = build_qlora(config)
    optimizer = make_optimizer(q)
    budget = budget_of(q, config, torch.device(config.device).type)
    report_progress("step 1", 1, steps + 1)

    def on_step(r: StepResult) -> None:
        report_progress(f"step {r.step + 2}" if r.step + 1 < steps else "done", r.step + 2, steps + 1)

    with MemoryTracker(config.device, model=q.model) as tracker:
        results, ledger = run_steps(q, steps, tracker, optimizer=optimizer, ledger_step=0, on_step=on_step)
    assert ledger is not None
    return assemble_report(
        q, config, budget, tracker, results, ledger, optimizer, top, time.perf_counter() - t0
    )


def lora_training_bytes(trainable: Iterable[torch.nn.Parameter], optimizer: Any) -> int:
    """LoRA weights + their gradients (same size, alive between backward and step) + optimizer state.
    ``optimizer`` may be a wrapper holding the real one as ``.optimizer`` (accelerate's, in a Trainer)."""
    weights = sum(p.numel() * p.element_size() for p in trainable)
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
    )


def budget_comparison(
    budget: Budget, totals: Totals, ledger: LedgerReport, measured_lora_training: int
) -> BudgetComparison:
    """Measured against the analytic budget (activation terms ``None`` where no analytic model applies)."""
    modelled = not budget.no_analytic_model
    return BudgetComparison(
        quantized_params=budget.quantized_params,
        lora_params=budget.lora_params,
        other_params=budget.other_params,
        analytic_weights_bytes=budget.weights_bytes,
        measured_weights_bytes=totals.model_resident_bytes,
        analytic_lora_training_bytes=budget.lora_training_bytes,
        measured_lora_training_bytes=measured_lora_training,
        analytic_activation_bytes=budget.activation_bytes if modelled else None,
        measured_activation_bytes=ledger.saved_bytes,
        analytic_logits_bytes=budget.logits_bytes if modelled else None,
        analytic_outside_layers_bytes=budget.logits_bytes + budget.shared_bytes if modelled else None,
        activation_ratio=(
            (ledger.saved_bytes / budget.activation_bytes if budget.activation_bytes else 0.0)
            if modelled
            else None
        ),
        analytic_model=budget.family if modelled else None,
        no_analytic_model=budget.no_analytic_model,
    )


def weight_copy_problem(ledger: LedgerReport) -> str | None:
    """The verdict's line for dequantized weights kept for backward, or ``None`` when there are none."""
    if not ledger.weight_copy_bytes:
        return None
    worst = next(r for r in ledger.records if r.kind == "weight-copy")
    return (
        f"{format_bytes(ledger.weight_copy_bytes)} of weight copies saved for backward "
        f"(largest: {worst.describe()})"
    )


def layer_rows(ledger: LedgerReport, budget: Budget | None = None, top: int = 3) -> list[LayerRow]:
    """Per decoder layer: what the ledger saw kept, by kind, the ``top`` modules, and the analytic
    budget's figure for the layer (``None`` without a budget or an analytic model)."""
    groups = ledger.by_layer()
    rows: list[LayerRow] = []
    for name in sorted(groups, key=lambda n: int(n.rsplit(".", 1)[1])):
        records = groups[name]
        index = int(name.rsplit(".", 1)[1])
        by_module: dict[str, int] = defaultdict(int)
        for r in records:
            by_module[r.module.removeprefix(name).lstrip(".") or "(layer)"] += r.bytes
        rows.append(
            LayerRow(
                name=name,
                saved_bytes=sum(r.bytes for r in records),
                activation_bytes=sum(r.bytes for r in records if r.kind == "activation"),
                weight_copy_bytes=sum(r.bytes for r in records if r.kind == "weight-copy"),
                analytic_bytes=(
                    None
                    if budget is None or budget.no_analytic_model
                    else budget.layer_bytes[index]
                    if index < len(budget.layer_bytes)
                    else 0
                ),
                top_modules=sorted(by_module.items(), key=lambda kv: -kv[1])[:top],
            )
        )
    return rows


def assemble_report(
    q: QLoRAModel,
    config: QLoRAConfig,
    budget: Budget,
    tracker: MemoryTracker,
    results: list[StepResult],
    ledger: LedgerReport,
    optimizer: torch.optim.Optimizer,
    top: int,
    elapsed: float,
) -> AuditReport:
    """The audit's document from one run (vramguard's loop, or the estimate's meta run)."""
    layers = layer_rows(ledger, budget, top)
    totals = totals_of(ledger, q.model, layers)
    modelled = None if budget.no_analytic_model else budget.family
    phases = {
        name: PhasePeak(
            peak_bytes=tracker.result.phases[name].peak_bytes,
            peak_above_start=tracker.result.phases[name].peak_above_start,
            reserved_peak_bytes=tracker.result.phases[name].reserved_peak_bytes,
        )
        for name in PHASES
    }
    comparison = budget_comparison(
        budget, totals, ledger, lora_training_bytes(q.trainable_parameters(), optimizer)
    )
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
    leak = (
        max((s.retained_bytes for s in steps), default=0) - steps[0].retained_bytes if len(steps) > 1 else 0
    )
    verdict = _verdict(config, totals, comparison, steps, leak, q, ledger)
    env = environment.collect(config.device).to_dict()
    return AuditReport(
        schema_version=SCHEMA_VERSION,
        vramguard_version=__version__,
        environment=env,
        config=config.to_dict(),
        device=tracker.result.device,
        layers=layers,
        totals=totals,
        phases=phases,
        budget=comparison,
        steps=steps,
        leak_bytes=leak,
        verdict=verdict,
        records=[r.to_dict() for r in ledger.records],
        elapsed_s=round(elapsed, 3),
        architecture={
            "model_type": q.spec.model_type,
            "model_class": q.model_class,
            "attn_implementation": q.attn_implementation,
            "analytic_model": modelled,
        },
    )


def _leak_tolerance(device: str) -> int:
    """Storage tracking is exact; the CUDA allocator may round a late workspace allocation."""
    return 64 * 1024 if device.startswith("cuda") else 0


def _verdict(
    config: QLoRAConfig,
    totals: Totals,
    budget: BudgetComparison,
    steps: list[StepRow],
    leak: int,
    q: QLoRAModel,
    ledger: LedgerReport,
) -> Verdict:
    problems: list[str] = []
    notes: list[str] = []
    if (copies := weight_copy_problem(ledger)) is not None:
        problems.append(copies)
    if leak > _leak_tolerance(config.device):
        problems.append(f"retained memory grew by {format_bytes(leak)} over {len(steps)} steps (a leak)")
    ratio = budget.activation_ratio
    notes.extend(q.notes)
    if ratio is None:
        notes.append(
            f"{budget.no_analytic_model}: saved activations measured "
            f"({format_bytes(budget.measured_activation_bytes)}), not compared with any formula"
        )
    elif abs(ratio - 1.0) > ACTIVATION_BAND:
        notes.append(
            f"saved activations are {ratio:.1%} of the analytic model "
            f"({format_bytes(budget.measured_activation_bytes)} vs {format_bytes(budget.analytic_activation_bytes)})"
        )
    norm_dtypes = {p.dtype for n, p in q.model.named_parameters() if "norm" in n}
    compute = parse_dtype(config.compute_dtype)
    if compute != torch.float32 and torch.float32 in norm_dtypes:
        notes.append(
            "activations are fp32, not " + config.compute_dtype + ": prepare_model_for_kbit_training "
            "upcast the norms, so the residual stream and everything after a norm is fp32 (2x the bytes)"
        )
    if len(steps) < 2:
        notes.append("one step only: growth across steps (a leak) was not checked")
    if problems:
        line = "PROBLEM: " + "; ".join(problems)
    else:
        checked = f"no growth across {len(steps)} steps" if len(steps) > 1 else "leak not checked"
        against = (
            f"{budget.no_analytic_model} (saved activations measured only)"
            if ratio is None
            else f"saved activations {ratio:.1%} of the analytic model"
        )
        line = f"OK: no weight copies saved for backward, {checked}; {against}"
    return Verdict(ok=not problems, line=line, problems=problems, notes=notes)
