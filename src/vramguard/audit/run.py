"""``vramguard audit``: train a small QLoRA model for a few steps and say where its memory went.

The job: build the model (4-bit NF4 via transformers, LoRA via PEFT, random weights), run real
steps under the live tracker, itemise one forward with the ledger, set the analytic expectation next
to the measurement and end with a verdict. Exit code 0 when the verdict is OK, 1 when it names a
problem (weight copies saved for backward, retained memory growing across steps), 2 on bad input.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from vramguard.errors import UsageError, first_line
from vramguard.estimate.techniques import routing as routing_technique
from vramguard.estimate.techniques import used_by
from vramguard.measure.events import AllocationLog
from vramguard.measure.tracker import MemoryTracker
from vramguard.model.analytic import Expectation, planned_expectation
from vramguard.step import verdict as checks
from vramguard.step.assemble import assemble_report
from vramguard.step.expectation import expectation_of
from vramguard.step.refusals import refuse_fp16_on_cpu
from vramguard.step.report import AuditReport, with_routing_note
from vramguard.step.request import StepRequest, audit_request
from vramguard.step.technique import bounding_requests, contexts_of, enter_stage, revised
from vramguard.units import format_bytes
from vramguard.workload.models import ModelSpec, QLoRAConfig, build_qlora
from vramguard.workload.routing import bounds_line, eager_top_k, figures
from vramguard.workload.training import StepResult, make_optimizer, run_steps

RoutingFigures = Callable[[dict[str, StepRequest]], dict[str, tuple[int, int]]]
"""``bounds -> {routing: (step peak, saved bytes)}``: each forced routing's request (the routing technique's
``bounded_by``) run, its figures."""

Progress = Callable[[str, int, int], None]


def resolve_device(name: str) -> str:
    """The device ``--device`` names: ``auto`` becomes cuda when torch sees a GPU, cpu otherwise."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def available_memory(device: str) -> tuple[int, str]:
    """Bytes a run on ``device`` can still get, and what that number is."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free), f"is free on {device}"
    import psutil

    return int(psutil.virtual_memory().available), "of RAM is available"


def check_fits(config: QLoRAConfig, spec: ModelSpec | None = None) -> Expectation:
    """Refuse (:class:`UsageError`) a configuration that cannot run here, before anything is allocated.

    Two checks. The audit builds the model once unquantized, in fp32 on the host, and writes that
    checkpoint to a temporary folder (random weights go through ``from_pretrained`` as users' do), so
    the host needs 4 B per parameter of RAM and of disk: a full-size preset (8B parameters: 32 GB) is
    refused here with that figure, not killed by the kernel mid-build. Then the training step's
    analytic memory must fit what the device has free; that model leaves out transient buffers, so it
    errs towards letting a run start.
    """
    refuse_what_the_audit_cannot_run(config)
    spec = spec or config.spec
    plan = planned_expectation(config, spec)
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


def refuse_what_the_audit_cannot_run(config: QLoRAConfig) -> None:
    """fp16 autocast on the CPU (:func:`refuse_fp16_on_cpu`) and flash_attention_2 (the flash_attn package
    is CUDA-only and the audit does not load it) are refused with a one-line :class:`UsageError`."""
    refuse_fp16_on_cpu(config, torch.device(config.device).type)
    if config.use_liger_kernel:  # before the build, which can take minutes
        _refuse_liger_here(config.device)
    if config.attn_implementation == "flash_attention_2":
        raise UsageError(
            "attn-implementation flash_attention_2 needs the flash_attn package and a CUDA GPU, which the audit "
            "does not load: price it with vramguard estimate --device cuda"
        )


def _refuse_liger_here(device: str) -> None:
    """UsageError (one line) where the audit cannot run Liger's kernels: off CUDA, or without the liger extra."""
    if torch.device(device).type != "cuda":
        raise UsageError(
            "use_liger_kernel runs Liger's Triton kernels on CUDA only: audit it with --device cuda"
        )
    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        raise UsageError(
            'use_liger_kernel needs liger-kernel and Triton: pip install -c constraints.txt -e ".[liger]"'
        )


def apply_liger_on_device(model: torch.nn.Module, device: str) -> None:
    """Liger's kernels applied to ``model`` as transformers' Trainer applies them for ``use_liger_kernel``
    (``apply_liger_kernel(model, {})``: Liger's defaults for the architecture), so the loop's steps run its Triton
    kernels and its fused linear cross-entropy. CUDA only (UsageError elsewhere: the kernels are Triton's, and
    vramguard estimate prices them on meta); liger-kernel and Triton must be installed (the liger extra)."""
    _refuse_liger_here(device)
    from transformers.integrations.liger import apply_liger_kernel

    try:
        apply_liger_kernel(model, {})
    except ImportError as exc:  # transformers' own check: liger-kernel missing or too old
        raise UsageError(
            "use_liger_kernel needs liger-kernel and Triton "
            f'(pip install -c constraints.txt -e ".[liger]"): {first_line(exc)}'
        ) from None


def run_audit(
    request: StepRequest | QLoRAConfig,
    progress: Progress | None = None,
    top: int = 3,
    events: AllocationLog | None = None,
    routing_figures: RoutingFigures | None = None,
    **options: Any,
) -> AuditReport:
    """Build, train the request's ``steps`` steps on its config's device, measure; pure apart from the compute
    (no printing). A config with ``options`` (the request's fields: ``steps``, 3 unless given, ``routing``, ...)
    is made into the request first (:meth:`StepRequest.on_device`). With ``events`` (CPU: the storage tracker's),
    every allocation of the steps is logged there and the report has a ``timeline``. The request's ``routing``:
    a mixture of experts' routing forced to one of :data:`vramguard.workload.routing.ROUTINGS` (None: the
    routing the router draws). ``routing_figures``: for eager experts and the routing drawn, the (step peak,
    saved bytes) of the same request with each forced routing
    (the routing technique's ``bounded_by`` requests, run by :func:`vramguard.estimate.run.forced_routing_figures`,
    given by the caller: the estimate builds on the
    audit, not the other way round); the ``routing:`` line then holds the drawn peak between them."""
    request = audit_request(request, options, steps=3)
    config, steps = request.config, request.steps
    refuse_what_the_audit_cannot_run(config)
    if events is not None and torch.device(config.device).type not in ("cpu", "cuda"):
        raise UsageError(f"allocation events are recorded on cpu and cuda, not {config.device}")
    check_fits(config)
    report_progress = progress or (lambda what, done, total: None)
    t0 = time.perf_counter()
    report_progress("building 4-bit model", 0, steps + 1)
    q = build_qlora(config)
    if config.use_liger_kernel:
        apply_liger_on_device(q.model, config.device)
    optimizer = make_optimizer(q, name=config.optimizer)
    techniques = used_by(config)
    expected = expectation_of(q, config, request.target, techniques=techniques)
    report_progress("step 1", 1, steps + 1)

    def on_step(r: StepResult) -> None:
        report_progress(f"step {r.step + 2}" if r.step + 1 < steps else "done", r.step + 2, steps + 1)

    # of the registry's techniques the loop enters the routing technique's context (a forced routing), outside the
    # tracker as on meta; Liger's context is the meta run's (on a device it is applied above) and offloading is
    # the Trainer's (vramguard audit refuses it for the loop)
    routed = [t for t in techniques if t.name == routing_technique.TECHNIQUE.name]
    contexts = contexts_of(routed, q, request)
    with contextlib.ExitStack() as stack:
        seen = enter_stage(stack, "around", routed, contexts)
        tracker = stack.enter_context(MemoryTracker(config.device, model=q.model, events=events))
        results, ledger = run_steps(q, steps, tracker, optimizer=optimizer, ledger_step=0, on_step=on_step)
    assert ledger is not None
    report = assemble_report(
        q, config, expected, tracker, results, ledger, optimizer, top, time.perf_counter() - t0, techniques=techniques
    )
    report = revised(report, routed, q, request, seen)  # a forced routing's routing: line
    bounds = bounding_requests(techniques, request, q)  # eager experts, the routing drawn: the forced routings'
    if not bounds:
        return report
    if routing_figures is None or torch.device(config.device).type != "cpu":
        # the build's line: these figures are for the routing this run drew. On a GPU the audit's phase peaks are
        # absolute allocator readings (weights and cuBLAS in), the meta runs' are not: nothing comparable yet
        return report
    measured = figures(report)
    line = bounds_line("eager", eager_top_k(q.model), routing_figures(bounds), measured)
    return with_routing_note(report, checks.ROUTING, line, measured[0])


