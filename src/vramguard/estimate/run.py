"""One QLoRA training step on the meta device, measured like the audit's, as an audit report.

The ledger and the storage tracker run unchanged: on meta every storage still has its real size,
so saved bytes per module and live bytes per phase are the libraries' own, without data. The
report is :class:`vramguard.step.report.AuditReport` (the audit's schema), with ``device`` ``meta`` and
``estimate`` (:class:`~vramguard.step.report.DeviceEstimate`) filled in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from vramguard.errors import UsageError, first_line
from vramguard.estimate.kernels import cuda_kernel_temporaries
from vramguard.estimate.meta import build_meta, target_decisions
from vramguard.estimate.techniques import autocast, offloading, routing, used_by
from vramguard.estimate.ghosts import ghost_layers
from vramguard.measure.events import AllocationLog
from vramguard.measure.ledger import LedgerReport
from vramguard.measure.tracker import MemoryTracker, StorageTracker
from vramguard.model.analytic import Expectation
from vramguard.step import verdict as checks
from vramguard.step.assemble import assemble_report
from vramguard.step.expectation import expectation_of
from vramguard.step.refusals import refuse_fp16_on_cpu
from vramguard.step.request import META, StepRequest
from vramguard.step.technique import Technique, bounding_requests, contexts_of, enter_all, enter_stage, revised
from vramguard.step.report import AuditReport, DeviceEstimate, Finding, Overhead, with_routing_note
from vramguard.units import format_bytes
from vramguard.workload.models import ModelSpec, QLoRAConfig, QLoRAModel, packed_lengths
from vramguard.workload.routing import META_RUNS, ROUTINGS, bounds_line, eager_top_k
from vramguard.workload.routing import figures as routing_figures_of
from vramguard.workload.training import PHASES, Repeats, StepResult, make_optimizer, repeatable, run_steps

MiB = 1 << 20

CUDA_CONTEXT_BYTES = 744 * MiB
"""The CUDA context and loaded kernels (torch + bitsandbytes), outside the caching allocator: NVML's
process bytes minus the allocator's reserved bytes, 742-744 MiB in all 32 GPU benchmark runs on an H100
(torch 2.11, CUDA 13.0, driver 580; docs/measurements/2026-11-22-h100/). Other GPUs, drivers and CUDA
versions differ by a few hundred MiB."""

CUBLAS_WORKSPACE_BYTES = 64 * MiB
"""cuBLAS's workspaces: 32 MiB per handle (torch's default ``:4096:8``), one handle for the forward's
thread and one for autograd's backward thread, both taken from the caching allocator on first use and
kept. Measured on an H100: a tiny model's step leaves 64 MiB that ``torch._C._cuda_clearCublasWorkspaces``
frees, and the 1B and 8B steps' ``max_memory_allocated`` exceed the meta allocator peak by 64 MiB plus
0.01 %. A meta run calls no cuBLAS, so it is added here."""


@dataclasses.dataclass(frozen=True)
class Fragmentation:
    """Reserved minus allocated at a step's peak (``max_memory_reserved - max_memory_allocated``), as shares
    of the allocator peak, from ``steps`` steps measured on an H100 with torch's default caching allocator
    (no ``expandable_segments``): ``expected``, the median, is the figure in the total; ``low`` and ``high``
    are the smallest and largest share measured (rounded outwards). ``docs/scripts/fragmentation.py`` derives
    them from docs/measurements/2026-11-22-h100*/ (its table is in docs/estimate.md;
    ``tests/test_fragmentation.py`` holds these constants to it)."""

    expected: float
    low: float
    high: float
    steps: int
    mode: str


FRAGMENTATION = Fragmentation(0.05, 0.01, 0.11, 11, "without gradient checkpointing")
"""11 steps of 1 GiB or more (1.9-10.6 %, median 4.8 %); no trend with size from 4 to 62 GiB."""

FRAGMENTATION_CHECKPOINTING = Fragmentation(0.14, 0.11, 0.23, 7, "with gradient checkpointing")
"""7 steps of 2-11 GiB (11.4-22.5 %, median 13.6 %): recomputation frees and re-requests a layer's blocks.
The earlier flat 25 % was the largest share of the benchmark matrix, set by a 0.27 GiB step (small-llama,
seq 512), where the allocator's 2 MiB and 20 MiB segments are a large part of a 70 MiB gap."""

FRAGMENTATION_OFFLOADING = Fragmentation(0.24, 0.19, 0.28, 2, "with activation offloading")
"""2 steps, both the 1B shape at seq 1024 without checkpointing (save_on_cpu 19.9 %, TRL's offloading 27.1 %):
every saved tensor is made on the device and freed after its copy. Thin evidence: a range, not a bound."""

MIN_MEASURED_PEAK = 1 << 30
"""Steps under 1 GiB are not in the figures: there the allocator's fixed granularity (2 MiB segments for
blocks up to 1 MiB, 20 MiB segments for requests of 1-10 MiB) makes a gap of a few MiB to tens of MiB that is
10-36 % of the peak on the H100's tiny-model steps; a share says nothing about it."""


def fragmentation_of(checkpointing: bool = False, offloading: bool = False) -> Fragmentation:
    """The measured figures for the step's kind: offloading first (measured without checkpointing), then
    checkpointing."""
    if offloading:
        return FRAGMENTATION_OFFLOADING
    return FRAGMENTATION_CHECKPOINTING if checkpointing else FRAGMENTATION


def small_step_caveat(allocator_peak: int) -> str:
    """Under :data:`MIN_MEASURED_PEAK` the shares were not measured (the allocator's granularity sets the gap
    there): said where the allowance is, empty otherwise."""
    if allocator_peak >= MIN_MEASURED_PEAK:
        return ""
    return (
        "; under 1 GiB no step was measured for these shares: there the allocator's 2 and 20 MiB segments set the "
        "gap (10-36 % of the H100's tiny steps)"
    )


def overheads(
    allocator_peak: int,
    checkpointing: bool = False,
    offloading: bool = False,
    target: str = "cuda",
    offloaded_bytes: int = 0,
    gpu: Any = None,
) -> list[Overhead]:
    """What the allocator peak of the meta run leaves out of the ``target``'s memory. On cuda a GPU's: the
    context, cuBLAS's workspaces and the fragmentation allowance at its expected (median) share, its
    ``low_bytes`` and ``high_bytes`` the measured range. On cpu none of those (the host's kernels), but the
    ``offloaded_bytes`` that activation offloading packs to the host stay in the host's memory there (an upper
    bound: their peak and the step's are added, whenever each falls). ``gpu``: the card
    (:class:`vramguard.estimate.gpus.Gpu`) whose context allowance replaces the H100's."""
    if target != "cuda":
        if not offloaded_bytes:
            return []
        return [
            Overhead(
                "activations offloaded to the host",
                offloaded_bytes,
                "save_on_cpu's copies at their peak (emulated on meta): on the host target they stay in the host's "
                "memory; added to the step's peak, an upper bound",
            )
        ]
    f = fragmentation_of(checkpointing, offloading)
    return [
        Overhead(
            "CUDA context + kernels",
            CUDA_CONTEXT_BYTES,
            "744 MiB measured on an H100 (NVML, CUDA 13); outside the allocator, varies by GPU and driver",
        )
        if gpu is None
        else Overhead("CUDA context + kernels", gpu.context_bytes, f"{gpu.label}: {gpu.context_basis}"),
        Overhead(
            "cuBLAS workspaces",
            CUBLAS_WORKSPACE_BYTES,
            "2 x 32 MiB (forward and autograd threads), measured on an H100; in max_memory_allocated, "
            "absent on meta",
        ),
        Overhead(
            "fragmentation allowance",
            int(allocator_peak * f.expected),
            f"{f.expected * 100:.0f} % of the allocator peak, expected: reserved - allocated, the median of "
            f"{f.steps} H100 steps {f.mode} (measured {f.low * 100:.0f}-{f.high * 100:.0f} %; high "
            f"{f.high * 100:.0f} % = {format_bytes(int(allocator_peak * f.high))})"
            + small_step_caveat(allocator_peak),
            low_bytes=int(allocator_peak * f.low),
            high_bytes=int(allocator_peak * f.high),
        ),
    ]


def high_total(estimate: DeviceEstimate) -> int:
    """The total with each overhead at its high bound (the fragmentation allowance's largest measured share)."""
    return estimate.high_total_bytes


def check_context(config: QLoRAConfig, spec: ModelSpec) -> None:
    """A sequence longer than the model's positions is bad input (said with the estimate's number
    by the caller); everything else is answered, however large: nothing is allocated."""
    limit = max_positions(spec)
    if limit is not None and config.seq_len > limit:
        raise _TooLong(limit)


def max_positions(spec: ModelSpec) -> int | None:
    """The model's ``max_position_embeddings``: a vramguard preset's field, else the Hugging Face
    config's (top level, or its ``text_config``); None where neither says."""
    hf = spec.hf or {}
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    for source in (spec.fields, hf, text):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class TooLarge(UsageError):
    """The step needs a tensor larger than torch can describe (over 2^63 bytes): it fits nowhere."""


class _TooLong(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' ``Optimizer8bit.get_state_buffer``: a state buffer is paged for ``p.numel() >= 1e5``."""


def make_estimate_optimizer(
    q: QLoRAModel, name: str = "adamw", target: str = "cuda"
) -> torch.optim.Optimizer:
    """The optimizer the estimate steps with: :func:`vramguard.workload.training.make_optimizer`'s, the
    audit's.

    bitsandbytes' 8-bit optimizers make their two quantization maps (256 fp32 each) on the host when built and
    move them to the device of the first parameter that gets 8-bit state, in the first step: a device
    allocation on a GPU, none on the CPU, where they already are. For the ``cpu`` target they are moved to the
    meta run's device here, before the step, so the step makes no copy either."""
    optimizer = make_optimizer(q, name=name)
    maps = getattr(optimizer, "name2qmap", None)
    if target == "cpu" and maps:
        device = q.trainable_parameters()[0].device
        for key in list(maps):
            maps[key] = maps[key].to(device)
    return optimizer


def paged_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes, tensors) of the optimizer state a paged bitsandbytes optimizer keeps in unified memory:
    ``state1`` and ``state2`` of every parameter with at least :data:`PAGED_MIN_NUMEL` elements."""
    total = count = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.numel() < PAGED_MIN_NUMEL:
                continue
            for name in ("state1", "state2"):
                t = optimizer.state.get(p, {}).get(name)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                    count += 1
    return total, count


PEAK_TERM_SHARE = 0.25
"""A term of the saved activations "sets the peak" when it is at least this share of the step's peak."""


def peak_term(
    report: AuditReport, config: QLoRAConfig, vocab: int, target: str, step_peak: int, phase: str
) -> Finding | None:
    """One line when one term of what the step saves sets its peak: the ``s x s`` attention tensors (the
    probabilities of eager or math attention, a mask, soft-capping's tanh) or the logits (``x vocab``), with
    the setting that removes it; None when neither is :data:`PEAK_TERM_SHARE` of the step's peak."""
    tokens = config.seq_len * (config.batch if config.padding_free else 1)
    square = sum(
        r["bytes"]
        for r in report.records
        if len(r["shape"]) >= 2 and r["shape"][-1] == r["shape"][-2] == tokens and r["kind"] == "activation"
    )
    logits = sum(
        r["bytes"]
        for r in report.records
        if len(r["shape"]) >= 2 and r["shape"][-1] == vocab and r["kind"] == "activation"
    )
    if max(square, logits) < PEAK_TERM_SHARE * step_peak:
        return None
    share = f"{max(square, logits) / step_peak:.0%} of the {phase} peak"
    if square >= logits:
        if report.architecture.get("attn_implementation") == "eager":
            remedy = (
                "--gradient-checkpointing (this model runs eager attention, which keeps them in every layer)"
            )
        elif target == "cuda" and config.mixed_precision == "no":
            remedy = "--bf16 (under autocast sdpa's inputs are bf16 and CUDA runs flash attention, which keeps none)"
        else:
            remedy = "--gradient-checkpointing"
        what = f"the s x s attention tensors ({format_bytes(square)}, {share})"
    else:
        remedy = (
            "a fused linear cross-entropy (Liger's: --use-liger-kernel or use_liger_kernel, priced on meta with "
            'the liger extra, pip install "vramguard[liger]"); otherwise a smaller --batch or --seq-len'
        )
        what = f"the logits x vocab {vocab:,} ({format_bytes(logits)}, {share})"
    return Finding(checks.PEAK_TERM, f"peak: {what} set it; removed by {remedy}", max(square, logits))


def data_bounds(q: QLoRAModel, request: StepRequest, estimate: DeviceEstimate) -> Finding | None:
    """What the batch's data decides, in one line: the figure is for the longest batch the config allows
    (``batch`` rows of ``seq_len`` tokens, every row full); the rows' lengths and, with packing, the sequences
    in a row decide lower figures. With packing and sdpa or eager attention the rows' boundaries decide whether
    transformers builds the packed-sequence mask: priced as real packed rows hold several sequences (the high,
    and the expected for TRL's bfd packing of shorter documents), and run again with every row one sequence (a
    document as long as the row: the low). None for the low run itself, and for a request without ``bounds``
    (its figure alone is read)."""
    config = request.config
    if request.one_sequence_per_row is not None or not request.bounds:
        return None
    fb = format_bytes
    tokens = f"{config.batch:,} x {config.seq_len:,} tokens"
    packed = config.packing and q.attn_implementation in ("sdpa", "eager") and not q.one_sequence_per_row
    if packed and request.device == META:  # (on a real device the position ids' values decide: nothing to force)
        low = run_estimate(dataclasses.replace(request, one_sequence_per_row=True)).estimate
        assert low is not None
        return Finding(
            checks.DATA_BOUNDS,
            f"data: packed rows, priced full ({tokens}); the sequences in a row decide the packed-sequence mask "
            f"of {q.attn_implementation}: high {fb(estimate.total_bytes)} when a row holds several sequences "
            f"(this figure, and the expected one for bfd packing of shorter documents), low "
            f"{fb(low.total_bytes)} when every row is one sequence (documents as long as a row); the lengths "
            "change no byte, the number of sequences only TRL's boundary tensors (4 B a sequence)",
            estimate.total_bytes - low.total_bytes,
        )
    if config.padding_free:
        return Finding(
            checks.DATA_BOUNDS,
            f"data: padding-free rows, priced full ({tokens}: the longest batch the config allows); a batch of "
            f"shorter sequences holds fewer tokens and needs less{_varlen_clause(q, config)}",
        )
    return Finding(
        checks.DATA_BOUNDS,
        f"data: every row priced at max_length ({tokens}: the longest batch the config allows); TRL pads a batch "
        "to its longest row, so a batch whose rows are all shorter needs less",
    )


def _varlen_clause(q: QLoRAModel, config: QLoRAConfig) -> str:
    """With flash_attention_2, what each sequence of a padding-free batch adds to the varlen backward; empty
    otherwise."""
    if q.attn_implementation != "flash_attention_2":
        return ""
    from vramguard.estimate.flash import varlen_bytes_per_sequence

    fields = q.spec.fields
    heads = int(fields["num_attention_heads"])
    per_sequence = varlen_bytes_per_sequence(heads, int(fields.get("head_dim") or fields["hidden_size"] // heads))
    sequences = config.batch * len(packed_lengths(config.seq_len, config.packing))
    return (
        f"; with flash_attention_2 each sequence in the batch adds 128 rows to the varlen backward's "
        f"fp32 softmax_d and dq_accum ({format_bytes(per_sequence)} a sequence, one layer's at a "
        f"time): priced at {sequences:,} sequences, so a packed batch of more, shorter documents needs "
        "that much more for each one beyond"
    )


@contextlib.contextmanager
def meta_step_contexts(
    q: QLoRAModel, request: StepRequest, techniques: list[Technique]
) -> Iterator[tuple[dict[str, int], dict[str, Any]]]:
    """What a meta step of ``q`` runs under where its tracker starts inside its own run (a trainer's step, one
    rank of a sharded step), entered at once: the step's decisions for the request's target
    (:func:`~vramguard.estimate.meta.target_decisions`), then the contexts of ``techniques`` (their autocast,
    attention kernel, rows' answer, routing: :func:`~vramguard.step.technique.contexts_of`), stage by stage
    (:func:`~vramguard.step.technique.enter_all`). Yields the decisions' counter and what each technique saw, by
    name. Refused in one line where a technique is not priced (flash_attention_2 off CUDA)."""
    contexts = contexts_of(techniques, q, request)
    with contextlib.ExitStack() as stack:
        taken = stack.enter_context(target_decisions(request.target))
        yield taken, enter_all(stack, techniques, contexts)


def run_estimate(
    request: StepRequest | QLoRAConfig, top: int = 3, events: AllocationLog | None = None, **options: Any
) -> AuditReport:
    """Run ``request``'s step on meta (:class:`~vramguard.step.request.StepRequest`: the model built there,
    ``steps`` steps under the tracker, the ledger on the first) and return the report, with ``top`` layers
    itemised. A config with ``options`` (the request's fields, and ``method``, ``optimizer`` and
    ``offload_activations``, which replace the config's when given) is made into the request first.
    ``config.device`` is only validated; the run is on the request's ``device``: meta, or ``cpu`` on real
    tensors (random weights; not for ``qlora``, whose CPU reference is ``vramguard audit``), the tests'
    reference for ``lora`` and ``full``.

    The request's ``target``: the device whose kernel choices the meta run takes (:data:`TARGETS`): ``cuda``,
    where the step will run, or ``cpu``, whose audit the meta run then equals to the byte. ``routing``: a
    mixture of experts' routing forced to one of :data:`vramguard.workload.routing.ROUTINGS`
    (the routing technique, :mod:`vramguard.estimate.techniques.routing`), as the audit forces it on a device.

    ``events``: every allocation and free of the steps is logged there (the storages the tracker counts, with
    phase, module stack and category); the report then has a ``timeline``.
    """
    if not isinstance(request, StepRequest):
        request = StepRequest.of(request, **options)
    elif options:
        raise TypeError(f"a StepRequest carries its options; got {sorted(options)}")
    too_long = refused_before_the_build(request)
    config = request.config
    t0 = time.perf_counter()
    q = build_meta(config, config.spec, method=config.method, device=request.device)
    bounds = bounding_requests(used_by(config), request, q)
    if bounds:  # a loop over the experts hit: routing decides the peak, and meta has no routing to draw
        top_k = eager_top_k(q.model)
        del q
        return routing_bounds(bounds, top_k, top, events)
    step = meta_step(q, request, events, too_long)
    report = assemble_report(
        q,
        q.config,
        step.expected,
        step.tracker,
        step.results,
        step.ledger,
        step.optimizer,
        top,
        time.perf_counter() - t0,
        meta_run=True,
        techniques=used_by(config),
    )
    return estimate_report(q, request, step, report, too_long)


def refused_before_the_build(request: StepRequest) -> _TooLong | None:
    """What ``request`` refuses before anything is built (fp16 autocast on the CPU, Liger where it is not
    priced); a sequence beyond the model's positions is returned, said by the caller with the estimate's
    number."""
    config = request.config
    refuse_fp16_on_cpu(config, request.target)
    for technique in used_by(config):  # before anything is built (Liger: the extra, the target, the device)
        technique.refuse(request)
    try:
        check_context(config, config.spec)
    except _TooLong as exc:
        return exc
    return None


@dataclasses.dataclass
class MetaStep:
    """What one meta run of a request measured, and what its techniques saw: the forced decisions ``taken``,
    the routing ``forced`` and, by technique name, what each technique's context yielded (``seen``)."""

    expected: Expectation
    optimizer: torch.optim.Optimizer
    tracker: MemoryTracker
    results: list[StepResult]
    ledger: LedgerReport
    taken: dict[str, int]
    forced: dict[str, Any]
    seen: dict[str, Any]


def meta_step(
    q: QLoRAModel, request: StepRequest, events: AllocationLog | None, too_long: _TooLong | None
) -> MetaStep:
    """``request``'s steps of ``q`` under the tracker, in the contexts put on the step: the target's decisions
    (:func:`~vramguard.estimate.meta.target_decisions`: every technique's context inside them), a vision
    model's values, then the techniques' (:func:`~vramguard.step.technique.enter_stage`, by their stage around
    or under the tracker: autocast and the routing around it, offloading, flash-attn 2's kernel and the rows'
    answer under it); a tensor beyond what torch can describe is :class:`TooLarge`."""
    config, target, device = request.config, request.target, request.device
    opt = make_estimate_optimizer(q, config.optimizer, target)
    # the meta run takes the target's kernel choices (see estimate.meta)
    techniques = used_by(config)
    expected = expectation_of(q, config, target, analytic=config.method == "qlora", techniques=techniques)
    source = meta_source(device, target)
    contexts = contexts_of(techniques, q, request)
    try:
        with contextlib.ExitStack() as stack:
            taken = stack.enter_context(target_decisions(target))  # the step's own: every technique's inside
            stack.enter_context(image_values_step(q))
            seen = enter_stage(stack, "around", techniques, contexts)
            tracker = stack.enter_context(MemoryTracker(device, model=q.model, source=source, events=events))
            seen |= enter_stage(stack, "under", techniques, contexts)
            repeats = step_repeats(q, request, tracker, [taken, *seen.values()], events)
            if request.routing is None and request.device == META:
                stack.enter_context(ghost_layers(q, lambda: tracker, [taken, *seen.values()], events))
            results, ledger = run_steps(
                q, request.steps, tracker, optimizer=opt, ledger_step=0, repeats=repeats
            )
    except RuntimeError as exc:
        if "overflow" not in str(exc):
            raise
        raise too_large(exc, request, too_long) from None
    assert ledger is not None
    taken = {**taken, **(seen.get(autocast.TECHNIQUE.name) or {})}  # its counts after the decisions' own
    if taken["find_packed_sequence_indices"] == 0 and taken["scaled_dot_product_attention"] == 0:
        taken = {}  # neither branch exists in this transformers version / model: nothing was forced
    forced = seen.get(routing.TECHNIQUE.name) or {}
    if request.routing is not None:  # the experts calls given the forced routing, the loop's steps answered from it
        taken = {**taken, "routing_forced": forced["forced"], "routing_answered": forced.get("answered", 0)}
    return MetaStep(expected, opt, tracker, results, ledger, taken, forced, seen)


ALL_MICRO_BATCHES = "VRAMGUARD_ALL_MICRO_BATCHES"
"""Set (to anything but empty or 0), every micro-batch of a meta step runs, none priced from another (the
reference tests/test_micro_batches.py holds the shortcut to)."""


def step_repeats(
    q: QLoRAModel,
    request: StepRequest,
    tracker: MemoryTracker,
    counters: list[Any],
    events: AllocationLog | None,
) -> Repeats | None:
    """The step's middle micro-batches priced from its last (:class:`~vramguard.workload.training.Repeats`),
    where that is the same as running them: more than two, one device (no ``no_sync`` that could hold
    gradients back), no allocation log (it lists each one), no forced routing, and every counter (``taken``,
    what each technique saw) one that counts (``counts``/``add``; Liger's does not) or one that saw nothing
    (None, an empty dict: a technique's context with nothing to do); None otherwise, or with
    :data:`ALL_MICRO_BATCHES` set."""
    if q.config.gradient_accumulation_steps <= 2 or events is not None or request.routing is not None:
        return None
    if os.environ.get(ALL_MICRO_BATCHES, "") not in ("", "0"):
        return None
    model = q.model
    if hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync") or request.device != META:
        return None
    counting = repeatable(counters)
    return None if counting is None else Repeats(tracker, counting)


def meta_source(device: str, target: str) -> StorageTracker:
    """The tracker's source on every device: meta storages and the host-side ones the libraries keep (Adam's
    step counters), as the CPU audit counts them; for ``cuda``, what its kernels hold inside themselves
    (:mod:`vramguard.estimate.kernels`)."""
    source = StorageTracker(None)
    source.device = device
    if target == "cuda":
        source.kernel_temporaries = cuda_kernel_temporaries
    return source


def image_values_step(q: QLoRAModel) -> contextlib.AbstractContextManager[Any]:
    """A vision-language model's rows with their values carried beside their meta tensors
    (:func:`vramguard.estimate.vision.values_on_meta`); a context that does nothing for a text model. (A forced
    routing is the routing technique's: :mod:`vramguard.estimate.techniques.routing`.)"""
    image_values = getattr(q, "image_values", None)
    if image_values is None:
        return contextlib.nullcontext()
    from vramguard.estimate.vision import values_on_meta

    return values_on_meta(image_values)


def too_large(exc: RuntimeError, request: StepRequest, too_long: _TooLong | None) -> TooLarge:
    """The one line for a step whose tensor torch cannot describe (e.g. the math attention's b x a x s x s
    probabilities at seq 10^9: more than 2^63 bytes), with the model's positions when the sequence is beyond
    them."""
    config = request.config
    beyond = (
        f"seq-len {config.seq_len:,} is beyond {config.spec.name}'s {too_long.limit:,} positions "
        "(max_position_embeddings); "
        if too_long is not None
        else ""
    )
    return TooLarge(
        f"{beyond}batch {config.batch:,} x seq-len {config.seq_len:,} needs a tensor larger than torch "
        f"can describe (over 2^63 bytes) on {request.target}: {first_line(exc)}"
    )


def estimate_report(
    q: QLoRAModel, request: StepRequest, step: MetaStep, report: AuditReport, too_long: _TooLong | None
) -> AuditReport:
    """The meta run's ``report`` with the device estimate, its headline and the estimate's notes; a sequence
    beyond the model's positions is refused here, with the figure it would need."""
    config, target = request.config, request.target
    offload = step.seen.get(offloading.TECHNIQUE.name)
    offloaded = offload.host_peak_bytes if offload is not None else 0
    estimate = device_estimate(report, q, config, target, offloaded, request.gpu)
    estimate.forced_decisions = dict(step.taken)
    if too_long is not None:
        raise UsageError(
            f"seq-len {config.seq_len:,} is beyond {config.spec.name}'s {too_long.limit:,} positions "
            f"(max_position_embeddings); it would need {format_bytes(estimate.total_bytes)} "
            f"({estimate.allocator_peak_bytes:,} B allocator peak, estimated on meta)"
        )
    line = headline(estimate, config, bool(config.offload_activations), offloaded, gpu=request.gpu)
    notes = estimate_notes(q, request, step, estimate, report)
    verdict = checks.verdict([*report.verdict.findings, *notes], len(report.steps), headline=line)
    report = dataclasses.replace(report, verdict=verdict, estimate=estimate, device=request.device)
    return revised(report, used_by(config), q, request, step.seen)  # e.g. a forced routing's routing: line


def estimate_notes(
    q: QLoRAModel, request: StepRequest, step: MetaStep, estimate: DeviceEstimate, report: AuditReport
) -> list[Finding]:
    """The estimate's own findings, in order: the meta run, the paged optimizer's state, the offloaded
    activations, Liger's kernels, what the data decides and the term that sets the peak."""
    config, target, cuda = request.config, request.target, request.target == "cuda"
    notes = [meta_run_note(cuda)]
    if config.optimizer == "paged-adamw-8bit":
        notes.append(paged_note(step.optimizer, cuda))
    for technique in used_by(config):
        notes += technique.findings(q, request, step.seen[technique.name])
    bounds = data_bounds(q, request, estimate)
    if bounds is not None:
        notes.append(bounds)
    vocab = int(q.spec.fields["vocab_size"])
    term = peak_term(report, config, vocab, target, estimate.step_peak_bytes, estimate.peak_phase)
    if term is not None:
        notes.append(term)
    return notes


def meta_run_note(cuda: bool) -> Finding:
    """The line that says the figures come from a meta run, and what they were checked against."""
    return Finding(
        checks.META_RUN,
        "estimated on the meta device: shapes and dtypes are real, values are not"
        + (
            "; against an H100 and an H200 (docs/measurements/2026-11-22-h100, 2026-11-25-h100, "
            "2026-11-27-h200, 2026-11-27-h200-blog13b): activations to the byte, the allocator peak within 1.1 % "
            "where measured (checkpointing, eager and sdpa attention, packing through sdpa, Liger, DoRA, MoE, "
            "gradient accumulation, both AdamW steps; flash-attn not measured; the 13B shapes 0.3-1.0 % low, "
            "the caching allocator's whole blocks), rank 0 of FSDP within 1.2 %; "
            "reserved memory varies more (the fragmentation line)"
            if cuda
            else "; with the CPU's kernels: on a CUDA device fp32 GQA attention keeps more (--device cuda)"
        ),
    )


def paged_note(optimizer: torch.optim.Optimizer, cuda: bool) -> Finding:
    """The paged optimizer's state: counted on the device, where it lives in CUDA unified memory."""
    paged, tensors = paged_state_bytes(optimizer)
    return Finding(
        checks.PAGED_OPTIMIZER,
        f"paged optimizer: {format_bytes(paged)} of its state ({tensors} moment tensors of parameters "
        f"with >= {PAGED_MIN_NUMEL:,} elements) would live in CUDA unified memory (cudaMallocManaged, "
        "outside torch's allocator: max_memory_allocated leaves it out); counted here on the device, "
        "where it stays until memory runs short, then the driver pages it to the host (evictable)"
        + ("" if cuda else "; with --device cpu, plain host memory, counted with the step's tensors")
        + ". "
        "Estimated by running AdamW8bit: paged memory does not exist on meta",
        paged,
    )


def device_estimate(
    report: AuditReport, q: QLoRAModel, config: QLoRAConfig, target: str, offloaded: int, gpu: Any = None
) -> DeviceEstimate:
    """The device's figures of a meta step's ``report``: weights, trainable parameters, the highest phase's peak,
    the allocator peak and what the meta run leaves out on ``target`` (:func:`overheads`; ``offloaded``: the
    bytes the config's activation offloading keeps on the host; ``gpu``: the card whose context allowance it
    takes)."""
    weights = report.totals.model_resident_bytes
    trainable = sum(p.numel() * p.element_size() for p in q.trainable_parameters())
    phase = max(PHASES, key=lambda name: report.phases[name].peak_bytes)
    step_peak = report.phases[phase].peak_bytes
    allocator = weights + trainable + step_peak
    extra = overheads(
        allocator,
        checkpointing=config.gradient_checkpointing,
        offloading=bool(config.offload_activations),
        target=target,
        offloaded_bytes=offloaded,
        gpu=gpu,
    )
    return DeviceEstimate(
        weights_bytes=weights,
        trainable_bytes=trainable,
        step_peak_bytes=step_peak,
        peak_phase=phase,
        allocator_peak_bytes=allocator,
        overhead_bytes=sum(o.bytes for o in extra),
        total_bytes=allocator + sum(o.bytes for o in extra),
        overheads=extra,
        forced_decisions={},
        target=target,
    )


def headline(
    estimate: DeviceEstimate, config: QLoRAConfig, offloading: bool, offloaded: int, gpu: Any = None
) -> str:
    """The estimate's one line: the total and its parts (with a GPU's overheads on the ``cuda`` target; ``gpu``:
    the card whose context allowance the total takes)."""
    fb = format_bytes
    weights, trainable, allocator = estimate.weights_bytes, estimate.trainable_bytes, estimate.allocator_peak_bytes
    phase, step_peak = estimate.peak_phase, estimate.step_peak_bytes
    frag = fragmentation_of(config.gradient_checkpointing, offloading)
    return (
        f"estimate: {fb(estimate.total_bytes)} on the device = allocator peak {fb(allocator)} "
        f"(weights {fb(weights)}, trainable {fb(trainable)}, {phase} peak {fb(step_peak)}) "
        f"+ {fb(estimate.overhead_bytes)} the meta run leaves out "
        f"({'H100 figures' if gpu is None else f'{gpu.context_note}, H100 figures otherwise'}; fragmentation at "
        f"{frag.expected * 100:.0f} %, the median measured {frag.mode}, of {frag.low * 100:.0f}-"
        f"{frag.high * 100:.0f} %: {fb(high_total(estimate))} at {frag.high * 100:.0f} %"
        f"{small_step_caveat(allocator)})"
        if estimate.target == "cuda"
        else f"estimate: {fb(estimate.total_bytes)} of the host's memory for the step's tensors (CPU kernels): "
        f"weights {fb(weights)} + trainable {fb(trainable)} + {phase} peak {fb(step_peak)}"
        + (f" + at most {fb(offloaded)} of activations offloaded to the host" if offloaded else "")
        + " (the figures `vramguard audit --device cpu` measures for the step; the Python process's own memory "
        "is not in it, nor a GPU's overheads: --device cuda adds those)"
    )


def forced_routing_figures(bounds: dict[str, StepRequest]) -> dict[str, tuple[int, int]]:
    """The (step peak, saved bytes) of each of ``bounds``' requests (the routing technique's ``bounded_by``: the
    step with each forced routing, :data:`~vramguard.workload.routing.ROUTINGS`), estimated on meta with the
    kernels of its target (the audit's request: its device's; on the CPU they equal an audit with the routing
    forced, to the byte): what ``run_audit(routing_figures=)`` holds the routing its router drew against."""
    return {
        kind: routing_figures_of(run_estimate(dataclasses.replace(forced, device=META, gpu=None)))
        for kind, forced in bounds.items()
    }


def routing_bounds(
    bounds: dict[str, StepRequest], top_k: int, top: int = 3, events: AllocationLog | None = None
) -> AuditReport:
    """The estimate of a mixture of experts with ``eager`` experts: the step run with each forced routing
    (``bounds``: the routing technique's ``bounded_by`` requests); the report is the highest one's, its
    ``routing:`` line names all (:func:`~vramguard.workload.routing.bounds_line`)."""
    reports = {kind: run_estimate(forced, top) for kind, forced in bounds.items()}
    high = highest_routing(reports)
    if events is not None:  # the timeline of the run reported
        reports[high] = run_estimate(bounds[high], top, events)
    return with_bounds(reports, high, top_k)


def highest_routing(reports: dict[str, Any]) -> str:
    """Of one step's reports under each forced routing (:data:`~vramguard.workload.routing.ROUTINGS`), the
    routing whose step peak is highest (the later one in :data:`ROUTINGS` on a tie): the one an estimate
    reports."""
    return max(reports, key=lambda kind: (routing_figures_of(reports[kind])[0], ROUTINGS.index(kind)))


def with_bounds(reports: dict[str, Any], high: str, top_k: int, forced_by: str = META_RUNS) -> Any:
    """``reports[high]`` with the ``routing:`` line that names every forced routing's figures
    (:func:`~vramguard.workload.routing.bounds_line`; ``forced_by``: how each ran): the estimate of eager
    experts, on one device or one rank of a sharded step."""
    figures = {kind: routing_figures_of(r) for kind, r in reports.items()}
    line = bounds_line("eager", top_k, figures, None, forced_by=forced_by)
    return with_routing_note(reports[high], checks.ROUTING, line, figures[high][0])
