"""One real QLoRA training step (forward, backward, optimizer step), measured phase by phase.

Shared by ``vramguard audit``, the benchmarks and tests_memory, so they all measure the same thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.measure.events import GRADIENTS, OPTIMIZER, optimizer_state
from vramguard.measure.ledger import LedgerReport, SavedTensorLedger
from vramguard.measure.tracker import FrameStats, MemoryTracker
from vramguard.workload.models import OPTIMIZERS, QLoRAModel

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


@dataclass
class StepResult:
    """Live bytes of one step; ``retained_bytes`` is what stays after the step is done."""

    step: int
    loss: float | None  # None on the meta device (vramguard estimate): no values
    start_bytes: int
    after_forward_bytes: int
    retained_bytes: int
    peak_bytes: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """The step's measurements as JSON."""
        return asdict(self)


@dataclass
class Repeats:
    """A step's micro-batches 2..N-1 priced from its last one, where they are the same (one device, no
    DeepSpeed engine, no allocation log: the caller decides): the first micro-batch differs (autograd
    allocates the gradients there), every later one starts where the one before it started (the gradients
    are added in place, its activations and loss freed) and sees the same shapes, so it makes the same
    allocations and frees.
    :func:`train_step` then runs the first and the last and adds the N-2 between to every sum the step keeps:
    the phases' and modules' calls and deltas (``tracker``) and the ``counters`` (objects with ``counts()``, a
    dict of counts, and ``add(dict)``: the forced decisions, a technique's). Peaks, retained bytes and the
    ledger (the first micro-batch's) are those of the full run; tests/test_micro_batches.py holds the reports
    equal byte for byte."""

    tracker: MemoryTracker
    counters: list[Any]
    _before: tuple[Any, list[dict[str, int]]] | None = None

    def begin(self) -> None:
        """Before the micro-batch whose repeats are priced."""
        self._before = (self.tracker.counts(), [c.counts() for c in self.counters])

    def repeat(self, times: int) -> None:
        """After it: its sums added ``times`` more times."""
        assert self._before is not None
        tracked, counted = self._before
        self.tracker.add_counts(tracked, times)
        for counter, before in zip(self.counters, counted, strict=True):
            counter.add({name: times * (n - before.get(name, 0)) for name, n in counter.counts().items()})
        self._before = None


def repeatable(counters: list[Any]) -> list[Any] | None:
    """The counters of a step's contexts that count (``counts``/``add``: the forced decisions, autocast's), the
    ones that saw nothing (None, an empty dict: a technique's context with nothing to do) left out; None where
    one cannot add (Liger's), so a span of the step cannot be priced from another (:class:`Repeats`, the
    identical layers of :mod:`vramguard.estimate.ghosts`)."""
    kept = [c for c in counters if c is not None and not (isinstance(c, dict) and not c)]
    return kept if all(hasattr(c, "counts") and hasattr(c, "add") for c in kept) else None


def optimizer_on(name: str, device: str) -> str:
    """The optimizer ``name`` runs as on ``device``: the paged one's state needs CUDA's unified memory, so
    elsewhere (meta, the CPU) it runs as ``adamw-8bit``, the same state with none of it paged."""
    return "adamw-8bit" if name == "paged-adamw-8bit" and torch.device(device).type != "cuda" else name


def make_optimizer(q: QLoRAModel, lr: float = 1e-4, name: str = "adamw") -> torch.optim.Optimizer:
    """The optimizer of the trainable parameters, by its :data:`~vramguard.workload.models.OPTIMIZERS` name:
    torch AdamW (8 bytes of state per trainable fp32 parameter), or bitsandbytes ``AdamW8bit`` for both 8-bit
    names on meta or a CPU, where unified memory (the paged one's) cannot be had
    (:func:`vramguard.estimate.run.paged_state_bytes` names what would be paged), and ``PagedAdamW8bit`` for
    the paged name on CUDA. Any other name is a :class:`UsageError`. torch picks AdamW's implementation by the
    parameters' device when it runs the first step; on meta the estimate answers that choice as its target would
    (:func:`vramguard.estimate.meta.forced_decisions`)."""
    if name == "adamw":
        return torch.optim.AdamW(q.trainable_parameters(), lr=lr)
    if name == "adamw-fused":
        return torch.optim.AdamW(q.trainable_parameters(), lr=lr, fused=True)
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        import bitsandbytes as bnb

        if optimizer_on(name, q.config.device) == "paged-adamw-8bit":
            return bnb.optim.PagedAdamW8bit(q.trainable_parameters(), lr=lr)  # its state in unified memory
        return bnb.optim.AdamW8bit(q.trainable_parameters(), lr=lr)  # paged: see OPTIMIZERS
    raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``QLoRAConfig.mixed_precision`` -> the dtype Trainer's autocast runs in."""


def forward_as_trainer(q: QLoRAModel, batch: dict[str, Any], forward: Any = None) -> Any:
    """``forward(**batch)`` (default ``q.model``; a DeepSpeed engine under ZeRO-3) as ``Trainer`` runs it with
    ``bf16`` / ``fp16`` (``q.config.mixed_precision``).

    Trainer leaves autocast to accelerate (``autocast_smart_context_manager`` is a null context), whose
    ``Accelerator.prepare_model`` replaces the model's ``forward`` by ``convert_outputs_to_fp32(autocast(
    forward))``: ``torch.autocast(device_type, dtype)`` with the default cache around the whole forward, the
    loss included (the labels go in with the batch), then every fp16/bf16 tensor of the output (the logits)
    converted to fp32 by ``.float()``, outside autocast; ``loss.backward()`` and the optimizer step run
    outside it. The device type is the model's; on meta, the estimate's :func:`vramguard.estimate.meta.forced_decisions`
    takes ``torch.autocast`` to its target's. Without mixed precision: ``q.model(**batch)`` unchanged."""
    forward = q.model if forward is None else forward
    dtype = AUTOCAST_DTYPES.get(q.config.mixed_precision)
    if dtype is None:
        return forward(**batch)
    from accelerate.utils.operations import convert_to_fp32

    with torch.autocast(device_type=q.device.type, dtype=dtype):
        out = forward(**batch)
    return convert_to_fp32(out)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """accelerate's ``Accelerator.no_sync``, which transformers' Trainer enters itself for every micro-batch of
    a step but the last (its training loop, unless accelerate's ``sync_each_batch`` is set, which is not priced):
    FSDP2's ``set_requires_gradient_sync(False)`` (each rank keeps its unsharded gradients until the last
    micro-batch reduces them), FSDP1's and DDP's ``no_sync()``; nothing for a model on one device. ``model`` is
    the FSDP root (FSDP2 shards the PEFT model in place, FSDP1 wraps it), so the attributes tell the engines
    apart as accelerate's ``is_fsdp2`` does."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with getattr(model, "no_sync", contextlib.nullcontext)():
            yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    q: QLoRAModel,
    optimizer: torch.optim.Optimizer,
    tracker: MemoryTracker,
    step: int,
    ledger: SavedTensorLedger | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    engine: Any = None,
    repeats: Repeats | None = None,
) -> StepResult:
    """Run one step inside ``tracker``; with ``ledger``, the forward pass (the first micro-batch's) is also
    itemised. When the tracker records events (:attr:`MemoryTracker.events`), every forward runs under a ledger
    whose saved storages, like the gradients and the optimizer's state, label their allocations.

    With ``gradient_accumulation_steps`` k > 1 (Trainer's gradient accumulation) the step is k micro-batches,
    made before the step as Trainer fetches them, each a forward and a backward (autograd adds each one's
    gradients into those the earlier ones left), then one optimizer step; a phase's peak is the highest of its k
    calls. Trainer's normalisation of the loss over the micro-batches scales values and changes no byte, so it
    is not applied.

    ``loss_fn`` maps the model output to the loss (default: the model's own ``loss``). ``engine``: a DeepSpeed
    engine wrapping ``q.model``: the step runs through it as DeepSpeed's users run it (``engine(**batch)``,
    ``engine.backward(loss)``, ``engine.step()``, which also zeroes the gradients); ``optimizer`` is its
    optimizer. Its micro-batches run as accelerate's DeepSpeed wrapper runs Trainer's: each backward told
    whether it is the accumulation boundary (``set_gradient_accumulation_boundary``), ``engine.step()`` once,
    after the last (the engine's configuration names the micro-batches: :func:`vramguard.workload.zero3.ds_config`).

    ``repeats`` (:class:`Repeats`): with more than two micro-batches, only the first and the last run; the
    ones between are priced from the last. Their batches are still made (Trainer holds them all through the
    step).
    """
    forward = engine if engine is not None else q.model
    micro_batches = q.config.gradient_accumulation_steps
    device = q.device
    # a step's micro-batches, all made before it starts, as Trainer fetches them (get_batch_samples)
    batches = [q.batch(step * micro_batches + micro) for micro in range(micro_batches)]
    start = tracker.current()
    step_stats = {name: FrameStats(name) for name in PHASES}
    events = tracker.events
    after_forward = 0  # the highest reading after a micro-batch's forward
    values: list[float] = []
    between = micro_batches - 2 if repeats is not None and micro_batches > 2 else 0
    for micro, batch in enumerate(batches):
        if between and 0 < micro < micro_batches - 1:
            continue  # priced from the last (below)
        if between and micro == micro_batches - 1:
            repeats.begin()  # type: ignore[union-attr]
        calls: dict[str, FrameStats] = {}
        saved = ledger if micro == 0 else None
        if saved is None and events is not None:  # what this forward keeps for backward, for the events' labels
            saved = SavedTensorLedger(q.model)
        # every micro-batch but the last under accelerate's no_sync, as Trainer runs them (a no-op on one device);
        # DeepSpeed's engine accumulates by itself (below), for which accelerate's no_sync does nothing either
        last = micro == micro_batches - 1
        accumulating = no_sync(q.model) if engine is None and not last else contextlib.nullcontext()
        with accumulating:
            with tracker.phase("forward") as calls["forward"]:
                if saved is not None:
                    with saved:
                        out = forward_as_trainer(q, batch, forward)
                        loss = loss_fn(out) if loss_fn else out.loss
                        saved.add_roots(loss)
                    if events is not None:
                        events.label_saved(saved.report.records)
                else:
                    out = forward_as_trainer(q, batch, forward)
                    loss = loss_fn(out) if loss_fn else out.loss
                _sync(device)
            after_forward = max(after_forward, tracker.current())
            del out
            with tracker.phase("backward") as calls["backward"]:
                if engine is not None:  # as accelerate's DeepSpeed wrapper runs Trainer's micro-batches
                    engine.set_gradient_accumulation_boundary(is_boundary=last)
                    engine.backward(loss)
                else:
                    loss.backward()
                _sync(device)
        if events is not None:
            events.label_tensors((p.grad for p in q.trainable_parameters() if p.grad is not None), GRADIENTS)
        for name, call in calls.items():
            for _ in range(1 + (between if micro == micro_batches - 1 else 0)):
                step_stats[name].merge(call)
        if between and micro == micro_batches - 1:
            repeats.repeat(between)  # type: ignore[union-attr]
        if not last:  # the last micro-batch's loss is read after the optimizer step
            if not loss.is_meta:
                values.append(float(loss.detach().float().item()))
            del loss
    with tracker.phase("optimizer") as call:
        if engine is not None:
            engine.step()
        else:
            optimizer.step()
        if events is not None:
            events.label_tensors(optimizer_state(optimizer), OPTIMIZER)
        if engine is None:
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
    step_stats["optimizer"].merge(call)
    if not loss.is_meta:  # meta: shapes, no values
        values.append(float(loss.detach().float().item()))
    del loss
    return StepResult(
        step=step,
        loss=sum(values) / len(values) if values else None,
        start_bytes=start,
        after_forward_bytes=after_forward,
        retained_bytes=tracker.current(),
        peak_bytes={name: stats.peak_bytes for name, stats in step_stats.items()},
    )


def run_steps(
    q: QLoRAModel,
    steps: int,
    tracker: MemoryTracker,
    optimizer: torch.optim.Optimizer | None = None,
    ledger_step: int | None = 0,
    on_step: Callable[[StepResult], None] | None = None,
    engine: Any = None,
    repeats: Repeats | None = None,
) -> tuple[list[StepResult], LedgerReport | None]:
    """``steps`` training steps; the ledger itemises the forward of step ``ledger_step``; ``engine``: a
    DeepSpeed engine to run them through; ``repeats``: each step's middle micro-batches priced from its last
    (:func:`train_step`)."""
    optimizer = optimizer or make_optimizer(q)
    results: list[StepResult] = []
    report: LedgerReport | None = None
    for step in range(steps):
        ledger = SavedTensorLedger(q.model) if step == ledger_step else None
        results.append(train_step(q, optimizer, tracker, step, ledger=ledger, engine=engine, repeats=repeats))
        if ledger is not None:
            report = ledger.report
        if on_step is not None:
            on_step(results[-1])
    return results, report
