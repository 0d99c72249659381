"""The one verdict on a step report: structured findings (kind, bytes, message) and the line they make.

Every producer of a report (vramguard's loop, the meta-device estimate, the Trainer callback) hands its
observations to :func:`vramguard.step.assemble.assemble` as :class:`Finding` objects; the checks every
producer shares are the functions below, and :func:`verdict` turns the findings into the
:class:`~vramguard.step.report.Verdict`. Code that needs to know what a verdict says reads
``Finding.kind``, never the wording.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vramguard.measure.ledger import LedgerReport
from vramguard.step.report import AnalyticComparison, Finding, StepRow, Verdict
from vramguard.units import format_bytes
from vramguard.workload.models import parse_dtype

ACTIVATION_BAND = 0.10
"""Measured activations within ±10 % of the analytic model count as agreeing."""

# kinds of problem (they fail the verdict)
WEIGHT_COPIES = "weight-copies"
LEAK = "leak"
STOPPED = "stopped"
HOST_COPIES_KEPT = "host-copies-kept"
NOTHING_MEASURED = "nothing-measured"
PHASES_MISSING = "phases-missing"
NO_LEDGER = "no-ledger"
# kinds of note
BUILD = "build"
NO_ANALYTIC_MODEL = "no-analytic-model"
ACTIVATIONS_OFF_MODEL = "activations-off-model"
FP32_ACTIVATIONS = "fp32-activations"
ONE_STEP = "one-step"
STEPS_SAMPLED = "steps-sampled"
OFFLOADING = "offloading"
BACKWARD_PEAK = "backward-peak"
META_RUN = "meta-run"
PAGED_OPTIMIZER = "paged-optimizer"
DORA = "dora"
AUTOCAST_CASTS = "autocast-casts"
LIGER = "liger"  # use_liger_kernel: priced on meta from liger-kernel's own code, its kernels not run
DATA_BOUNDS = "data-bounds"  # what the batch's data decides: the figure is the longest batch; low / high named
PEAK_TERM = "peak-term"  # one term of the saved activations sets the step's peak
CONFIG = "config"  # how a --config file (and the flags) were read: priced, no byte, not priced
ROUTING = "routing"  # an eager mixture of experts: the step peak for forced routings, and the one drawn
VISION = "vision"  # a vision-language model: saved bytes of its vision tower, projector, language model


def leak_tolerance(device: str) -> int:
    """Growth of retained bytes that is not a leak: storage tracking is exact; the CUDA allocator may round
    a late workspace allocation."""
    return 64 * 1024 if device.startswith("cuda") else 0


def leak_bytes(retained: Sequence[int]) -> int:
    """How far the bytes retained after each step rose above the first step's (0 with fewer than two)."""
    if len(retained) < 2:
        return 0
    return max(retained) - retained[0]


def weight_copies(ledger: LedgerReport, cast_by_autocast: frozenset[str] = frozenset()) -> Finding | None:
    """The problem of dequantized weights kept for backward, or ``None`` when there are none. Copies saved in
    ``cast_by_autocast`` (modules whose weight is not quantized, under Trainer's autocast: autocast's cast of
    the weight, not a dequantization) are :func:`autocast_casts`' note instead."""
    copies = [r for r in ledger.records if r.kind == "weight-copy" and r.module not in cast_by_autocast]
    if not copies:
        return None
    total = sum(r.bytes for r in copies)
    return Finding(
        WEIGHT_COPIES,
        f"{format_bytes(total)} of weight copies saved for backward (largest: {copies[0].describe()})",
        total,
        problem=True,
    )


def autocast_casts(ledger: LedgerReport, cast_by_autocast: frozenset[str], autocast: str) -> Finding | None:
    """The note on autocast's low-precision copies of unquantized weights (the fp32 ``lm_head`` that
    ``prepare_model_for_kbit_training`` leaves) that the step saves for backward: cast again every forward."""
    copies = [r for r in ledger.records if r.kind == "weight-copy" and r.module in cast_by_autocast]
    if not copies:
        return None
    total = sum(r.bytes for r in copies)
    return Finding(
        AUTOCAST_CASTS,
        f"{autocast} autocast copies of unquantized weights saved for backward: {format_bytes(total)} "
        f"(largest: {copies[0].describe()}); autocast casts each such fp32 weight every forward",
        total,
    )


def leak(steps: Sequence[StepRow], tolerance: int) -> Finding | None:
    """The problem of retained memory growing across steps by more than ``tolerance``."""
    grown = leak_bytes([s.retained_bytes for s in steps])
    if grown <= tolerance:
        return None
    return Finding(
        LEAK,
        f"retained memory grew by {format_bytes(grown)} over {len(steps)} steps (a leak)",
        grown,
        problem=True,
    )


def activation_comparison(comparison: AnalyticComparison, offloaded: bool = False) -> Finding | None:
    """The note on the measured saved activations against the analytic model: measured only (no model for
    the architecture), or off the model by more than :data:`ACTIVATION_BAND` (not said when the activations
    are ``offloaded`` to the host: the device keeps less by design)."""
    ratio = comparison.activation_ratio
    if ratio is None:
        return Finding(
            NO_ANALYTIC_MODEL,
            f"{comparison.no_analytic_model}: saved activations measured "
            f"({format_bytes(comparison.measured_activation_bytes)}), not compared with any formula",
            comparison.measured_activation_bytes,
        )
    if abs(ratio - 1.0) > ACTIVATION_BAND and not offloaded:
        return Finding(
            ACTIVATIONS_OFF_MODEL,
            f"saved activations are {ratio:.1%} of the analytic model "
            f"({format_bytes(comparison.measured_activation_bytes)} vs {format_bytes(comparison.analytic_activation_bytes)})",
            comparison.measured_activation_bytes,
        )
    return None


def fp32_activations(model: torch.nn.Module, compute_dtype: str) -> Finding | None:
    """The note that the activations are fp32 although ``compute_dtype`` is not: the norms were upcast by
    ``prepare_model_for_kbit_training``."""
    norm_dtypes = {p.dtype for n, p in model.named_parameters() if "norm" in n}
    if parse_dtype(compute_dtype) == torch.float32 or torch.float32 not in norm_dtypes:
        return None
    return Finding(
        FP32_ACTIVATIONS,
        "activations are fp32, not " + compute_dtype + ": vramguard's loop ran prepare_model_for_kbit_training, "
        "which upcast the norms, so the residual stream and everything after a norm is fp32 (2x the bytes; "
        "TRL's SFTTrainer skips it: --trainer sft)",
    )


def activation_summary(comparison: AnalyticComparison) -> str:
    """The OK line's clause on the saved activations: their share of the analytic model, or measured only."""
    if comparison.activation_ratio is None:
        return f"{comparison.no_analytic_model} (saved activations measured only)"
    return f"saved activations {comparison.activation_ratio:.1%} of the analytic model"


def one_step(steps: Sequence[StepRow]) -> Finding | None:
    """The note that a single step cannot show a leak."""
    if len(steps) >= 2:
        return None
    return Finding(ONE_STEP, "one step only: growth across steps (a leak) was not checked")


def vision(model: Any, ledger: LedgerReport) -> Finding | None:
    """For a vision-language model (its ``vision`` setup, :mod:`vramguard.workload.vision`): the saved bytes of
    the first forward per stack (vision tower, projector, language model), each record under the stack of the
    module that saved it; None for a text model."""
    setup = getattr(model, "vision", None)
    return None if setup is None else vision_stacks(setup.family, ledger)


def vision_stacks(family: Any, ledger: LedgerReport) -> Finding | None:
    """The saved bytes of ``ledger`` per stack of ``family`` (a
    :class:`vramguard.workload.vision.VisionFamily`; None: a text model, no finding)."""
    if family is None:
        return None
    from vramguard.workload.vision import saved_by_stack

    stacks = saved_by_stack(ledger.records, family)
    total = sum(stacks.values()) or 1
    parts = ", ".join(f"{name} {format_bytes(b)} ({100 * b / total:.1f} %)" for name, b in stacks.items())
    return Finding(VISION, f"saved for backward by stack: {parts}", stacks["vision tower"])


def notes(kind: str, messages: Iterable[str]) -> list[Finding]:
    """Plain notes of one kind (e.g. what the model's build changed from the request)."""
    return [Finding(kind, m) for m in messages]


def verdict(
    findings: Iterable[Finding | None], steps: int, ok_detail: str = "", headline: str = ""
) -> Verdict:
    """The verdict of ``findings`` (``None`` entries are checks that found nothing) over ``steps`` steps.

    With problems the line is ``PROBLEM: `` and their messages (then ``headline``, when given); without, the
    ``headline`` or ``OK: no weight copies saved for backward, <growth checked><ok_detail>``."""
    found = [f for f in findings if f is not None]
    problems = [f for f in found if f.problem]
    if problems:
        line = "PROBLEM: " + "; ".join(f.message for f in problems) + (f"; {headline}" if headline else "")
    elif headline:
        line = headline
    else:
        checked = f"no growth across {steps} steps" if steps > 1 else "leak not checked"
        line = f"OK: no weight copies saved for backward, {checked}{ok_detail}"
    return Verdict(line=line, findings=found)
