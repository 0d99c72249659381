"""``vramguard estimate --trainer sft|trainer``: the step of the real TRL ``SFTTrainer`` / transformers ``Trainer``
on the meta device.

The trainer is the one the audit runs on a device (:mod:`vramguard.integrations.trainer_step`): its own
``__init__`` (for SFTTrainer: PEFT's wrapping, input gradients, the bf16 cast of a quantized model's adapters, no
k-bit preparation), its own dataset preparation and collator, ``compute_loss`` (SFTTrainer's fused chunked
log-prob loss), ``create_optimizer``, scheduler and gradient clipping, over the 4-bit model built on meta
(:func:`vramguard.estimate.meta.build_meta`) and the loop's token rows. Three things are placed, not imitated:

* the run's device is ``meta``: ``TrainingArguments.device`` (where ``Trainer`` puts its loss accumulator and
  inputs), the 4-bit model's device map (as ``from_pretrained(device_map=...)`` records it: nobody moves it) and
  the device accelerate's data loader sends batches to; the collator's batches are put there as it returns
  them (on the CPU the loader's copy is no copy: each batch lives once, and its prefetched next one as well),
  and the device of the autocast accelerate wraps the forward in with mixed precision (so it is the target's:
  CUDA's state and policy for ``--target cuda``, where accelerate on a host without a GPU would enter the CPU's,
  which casts no meta tensor);
* ``.item()`` and ``bool()`` of a meta scalar (the metrics SFTTrainer logs, Trainer's loss logging) are answered
  with 1 (no value exists on meta; what they decide is logging, outside the step's tensors): the Meta kernel of
  ``_local_scalar_dense`` over the step (:mod:`vramguard.estimate.meta_kernels`), torch's own after it;
* a bitsandbytes 8-bit optimizer's quantization maps are moved to meta before the step for the ``cpu`` target
  (as :func:`vramguard.estimate.run.make_estimate_optimizer`), where the CPU run needs no copy.

:class:`vramguard.integrations.transformers.VramGuardCallback` measures it as it measures the audit, counting
every device's storages (the meta step's and the host's: Adam's step counters), so with ``--target cpu`` the
phase peaks and saved bytes equal ``vramguard audit --trainer`` to the byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vramguard.errors import UsageError
from vramguard.estimate.ghosts import ghost_layers
from vramguard.estimate.kernels import cuda_kernel_temporaries
from vramguard.estimate.meta import META, _deepcopy_on_meta, build_meta
from vramguard.estimate.meta_kernels import ITEMS_ANSWERED, meta_kernels
from vramguard.estimate.no_init import values_not_drawn
from vramguard.integrations.trainer_step import (
    fails_as_the_users_run,
    make_trainer,
    trainer_arguments,
    trainer_prepares,
)
from vramguard.integrations.transformers import VramGuardCallback
from vramguard.measure.tracker import StorageTracker
from vramguard.step.patching import patch_all, patched
from vramguard.step.report import AuditReport
from vramguard.step.request import StepRequest
from vramguard.workload.models import QLoRAConfig, QLoRAModel
from vramguard.workload.routing import eager_top_k
from vramguard.workload.training import Repeats
from vramguard.workload.vision_sft import trainer_refusal, with_tower_note


class NeedsLoop(UsageError):
    """What the trainer's step on meta does not run yet (``what``): one line (exit 2) with the workaround when
    the trainer was asked for by name; where it was the default, vramguard's loop runs instead and says so."""

    def __init__(self, trainer: str, what: str, workaround: str = "estimate it with --trainer loop") -> None:
        super().__init__(f"--trainer {trainer} on meta does not run {what} yet: {workaround}")
        self.what = what


def refuse_unpriced(config: QLoRAConfig, trainer: str) -> None:
    """One line (exit 2) for what the trainer's step on meta does not run yet, with the workaround."""
    not_yet = {
        "use_liger_kernel": config.use_liger_kernel,
        "activation offloading": config.offload_activations,
        f"method {config.method}": config.method != "qlora",
    }
    for what, asked in not_yet.items():
        if asked:
            raise NeedsLoop(trainer, what, "estimate it with --trainer loop (vramguard's loop, which prices it)")


class _MetaCallback(VramGuardCallback):
    """The audit's callback, counting every device's storages (meta and the host), CUDA's kernel temporaries
    for the ``cuda`` target."""

    def __init__(self, target: str) -> None:
        super().__init__(table=False)
        self.target = target

    def _source_for(self, device: Any) -> Any:
        source = StorageTracker(None)
        source.device = META
        if self.target == "cuda":
            source.kernel_temporaries = cuda_kernel_temporaries
        return source


def _on_meta(collate: Any, values: Any = None) -> Any:
    """The trainer's collator, its tensors put on meta as it returns them (shape and dtype kept). With
    ``values`` (a vision-language model's :class:`~vramguard.estimate.vision.ImageValues`) the collator runs
    with every mode off (its host tensors are the values: no tracker counts them) and each tensor it returns
    is given to meta with its value (``image_grid_thw``, the image tokens' positions: what the vision code
    reads)."""

    def collate_on_meta(examples: Any) -> Any:
        if values is None:
            batch = collate(examples)
        else:
            with _disable_current_modes():
                batch = collate(examples)
        made: dict[int, torch.Tensor] = {}  # one meta tensor per host tensor (cu_seq_lens_q is _k)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                batch[key] = made.setdefault(id(value), _meta_of(value, values))
        return batch

    return collate_on_meta


def _meta_of(host: torch.Tensor, values: Any) -> torch.Tensor:
    """``host``'s meta tensor: with ``values``, one that carries ``host`` as its value."""
    if values is not None:
        return values.give(host)  # type: ignore[no-any-return]
    return torch.empty(host.shape, dtype=host.dtype, device=META)


def _loader_on_meta(runner: Any) -> None:
    """The trainer's data loader (accelerate's, which sends each batch to its device as it yields it) sends its
    batches to meta: ``get_train_dataloader`` is the trainer's own, its loader's ``device`` is meta."""
    original = runner.get_train_dataloader

    def get_train_dataloader() -> Any:
        loader = original()
        loader.device = torch.device(META)
        return loader

    runner.get_train_dataloader = get_train_dataloader


def _maps_on_meta(optimizer: Any) -> None:
    """A bitsandbytes 8-bit optimizer's quantization maps moved to meta (the ``cpu`` target; see the module)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    maps = getattr(inner, "name2qmap", None)
    for key in list(maps or {}):
        maps[key] = maps[key].to(META)


@contextlib.contextmanager
def _device_is_meta(args: Any) -> Iterator[None]:
    """``args.device`` answers meta (the cached ``_setup_devices``): where Trainer places the model and batches."""
    args.__dict__["_setup_devices"] = torch.device(META)
    yield


def trainer_on_meta(q: QLoRAModel, trainer: str, target: str, steps: int, output_dir: str) -> tuple[Any, Any]:
    """(the trainer, its callback) of ``q`` (built on meta) for ``steps`` steps, ready to ``train()``."""
    config = q.config
    micro_batches = steps * config.gradient_accumulation_steps
    args = trainer_arguments(config, steps, trainer, output_dir, True, False)
    callback = _MetaCallback(target)
    base = q.model.get_base_model() if hasattr(q.model, "get_base_model") else q.model
    base.hf_device_map = {"": META}  # what from_pretrained(device_map={"": device}) records: no move to a device
    # PEFT's LoRA, made by the trainer on the host and moved to meta: no values to keep
    with _device_is_meta(args), _deepcopy_on_meta(), values_not_drawn(meta_only=False):
        runner = make_trainer(q, trainer, args, micro_batches, [callback])
    _all_on_meta(runner.model)  # what stayed on the host would hold values never drawn
    runner.data_collator = _on_meta(runner.data_collator, getattr(q, "image_values", None))
    _loader_on_meta(runner)
    runner.create_optimizer()  # the trainer's own; train() keeps it
    if target == "cpu":
        _maps_on_meta(runner.optimizer)
    return runner, callback


def _all_on_meta(model: torch.nn.Module) -> None:
    """Every parameter and buffer of the trainer's model is on meta (the trainer's setup draws no values: one left
    on the host would hold ``torch.empty``'s garbage), else an internal error naming it."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type != META:
            raise RuntimeError(f"{name} is on {t.device.type} after the trainer's setup on meta, its values not drawn")


@contextlib.contextmanager
def _autocast_asked_as(target: str) -> Iterator[None]:
    """``torch.is_autocast_enabled("meta")`` and ``torch.get_autocast_dtype("meta")`` (TRL's chunked log-prob loss
    asks them of its input's device) answer for ``target``, whose autocast the meta step runs
    (:func:`vramguard.estimate.meta.target_autocast`); torch has no autocast for meta and raises."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_autocast_enabled(*args: Any) -> bool:
        return enabled(*(target if a == META else a for a in args))

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        return dtype(target if device_type == META else device_type)

    with contextlib.ExitStack() as stack:
        patch_all(
            stack,
            [(torch, "is_autocast_enabled", is_autocast_enabled), (torch, "get_autocast_dtype", get_autocast_dtype)],
        )
        yield


@contextlib.contextmanager
def _accelerate_autocast_on_meta() -> Iterator[None]:
    """accelerate's mixed-precision autocast (``Accelerator.prepare`` wraps the model's forward in it) on the
    run's device, meta, as it is on the user's accelerator's device: accelerate asks its state's device (the
    host's here, the GPU in the user's run), and an autocast on the host's device type casts no meta tensor.
    Its own dtype, ``enabled`` and ``cache_enabled`` are kept; on meta it is the target's autocast
    (:func:`vramguard.estimate.meta.target_autocast`)."""
    from accelerate import accelerator

    original = accelerator.get_mixed_precision_context_manager

    def get_mixed_precision_context_manager(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        if not isinstance(made, torch.amp.autocast_mode.autocast):
            return made  # no native amp: a null context
        kept = {"dtype": made.fast_dtype, "enabled": made._enabled, "cache_enabled": made._cache_enabled}
        return torch.autocast(META, **kept)

    with patched(accelerator, "get_mixed_precision_context_manager", get_mixed_precision_context_manager):
        yield


class _PhaseCalls:
    """The callback's per-step phase aggregates (``_calls``) as a counter (``counts``/``add``: calls and deltas)
    for :class:`~vramguard.workload.training.Repeats`."""

    def __init__(self, callback: VramGuardCallback) -> None:
        self.callback = callback

    def counts(self) -> dict[str, int]:
        calls = self.callback._calls
        return {
            **{f"{n} calls": s.calls for n, s in calls.items()},
            **{f"{n} delta": s.delta_bytes for n, s in calls.items()},
        }

    def add(self, more: dict[str, int]) -> None:
        for key, n in more.items():
            name, what = key.rsplit(" ", 1)
            stats = self.callback._calls[name]
            if what == "calls":
                stats.calls += n
            else:
                stats.delta_bytes += n


class _PricedMicroBatches:
    """The trainer's ``training_step`` (one micro-batch's forward and backward) with a step's micro-batches 2..N-1
    priced from its last, as the loop's (:class:`~vramguard.workload.training.Repeats`): the trainer's loop still
    fetches every batch and runs its own bookkeeping for each (outside the callback's phases); the skipped calls
    return the loss the last run one returned. The repeats' sums: the callback's tracker, its per-step phases and
    the counters of the step's contexts (the decisions ``taken``, autocast's)."""

    def __init__(self, runner: Any, callback: VramGuardCallback, counters: list[Any], micro_batches: int) -> None:
        self.original = runner.training_step
        self.callback, self.counters, self.n = callback, counters, micro_batches
        self.calls = 0
        self.loss: Any = None
        self.repeats: Repeats | None = None

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        micro = self.calls % self.n
        self.calls += 1
        if 0 < micro < self.n - 1:
            return self.loss  # priced from the last (below)
        if micro == self.n - 1:
            assert self.callback._tracker is not None
            self.repeats = Repeats(self.callback._tracker, [*self.counters, _PhaseCalls(self.callback)])
            self.repeats.begin()
        self.loss = None
        self.loss = self.original(model, inputs, num_items_in_batch)
        if self.repeats is not None:
            self.repeats.repeat(self.n - 2)
            self.repeats = None
        return self.loss


def priced_micro_batches(runner: Any, callback: VramGuardCallback, counters: list[Any]) -> None:
    """Install :class:`_PricedMicroBatches` on ``runner`` where a step has more than two micro-batches (unless
    :data:`vramguard.estimate.run.ALL_MICRO_BATCHES` is set); ``counters``: what the step's contexts yielded that
    counts (``counts``/``add``: the decisions, autocast's)."""
    from vramguard.estimate.run import ALL_MICRO_BATCHES

    n = runner.args.gradient_accumulation_steps
    if n > 2 and os.environ.get(ALL_MICRO_BATCHES, "") in ("", "0"):
        runner.training_step = _PricedMicroBatches(runner, callback, counters, n)


def run_trainer_step(config: QLoRAConfig, trainer: str, steps: int, target: str) -> tuple[Any, QLoRAModel, float]:
    """``steps`` steps of ``trainer`` on meta for ``target``: (the callback's report, the model, seconds)."""
    from vramguard.estimate.run import max_positions, meta_step_contexts
    from vramguard.estimate.techniques import used_by

    refuse_unpriced(config, trainer)
    spec = config.spec
    refuse_vision(config, trainer)
    limit = max_positions(spec)
    if limit is not None and config.seq_len > limit:  # the trainer's rows are real host lists: not made
        raise NeedsLoop(trainer, f"a seq-len beyond {spec.name}'s {limit:,} positions")
    t0 = time.perf_counter()
    q = build_meta(config, spec, prepared=not trainer_prepares(trainer))
    if eager_top_k(q.model) is not None:
        raise NeedsLoop(trainer, "a mixture of experts' forced eager routing")
    values = getattr(q, "image_values", None)  # a vision-language batch's (estimate.vision)
    with tempfile.TemporaryDirectory(prefix="vramguard-trainer-") as tmp:
        runner, callback = trainer_on_meta(q, trainer, target, steps, tmp)
        q = dataclasses.replace(q, model=runner.model)
        request = StepRequest(config, target=target, steps=steps)  # the techniques' contexts take it
        on_step = meta_step_contexts(q, request, used_by(config))  # the decisions, autocast, flash-attn, the rows
        asked_as, as_users = _autocast_asked_as(target), fails_as_the_users_run(q, trainer)
        # .item() of a meta scalar: 1 (see the module); a vision-language batch's valued one is answered first
        # by its values' mode (a dispatch mode runs before the Meta kernel)
        answers = meta_kernels(ITEMS_ANSWERED)
        with on_step as (taken, seen), image_values_step(values), asked_as, _accelerate_autocast_on_meta():
            with answers, as_users:
                counters = [c for c in (taken, *seen.values()) if hasattr(c, "counts")]
                priced_micro_batches(runner, callback, counters)
                with ghost_layers(q, lambda: callback._tracker, [taken, *seen.values()]):
                    runner.train()
    assert callback.report is not None
    return callback.report, with_tower_note(q), time.perf_counter() - t0


def refuse_vision(config: QLoRAConfig, trainer: str) -> None:
    """A vision-language model's step the trainer's step on meta does not run yet
    (:func:`vramguard.workload.vision_sft.trainer_refusal` names what): :class:`NeedsLoop`."""
    what = trainer_refusal(config, trainer)
    if what is not None:
        raise NeedsLoop(trainer, what, "estimate it with --trainer loop (vramguard's loop, which prices it)")


def image_values_step(values: Any) -> contextlib.AbstractContextManager[Any]:
    """The trainer's step under a vision-language batch's values (:func:`vramguard.estimate.vision.
    values_on_meta`, where its collated batches get them); nothing for a text model."""
    if values is None:
        return contextlib.nullcontext()
    from vramguard.estimate.vision import values_on_meta

    return values_on_meta(values)


def trainer_label(trainer: str) -> str:
    """``trl sft 1.16`` / ``transformers 5.23 Trainer``: the trainer and the version installed."""
    from importlib.metadata import version

    if trainer == "sft":
        return f"trl sft {_short(version('trl'))}"
    return f"transformers {_short(version('transformers'))} Trainer"


def _short(v: str) -> str:
    return ".".join(v.split(".")[:2])


def run_trainer_estimate(
    config: QLoRAConfig, trainer: str, steps: int = 2, target: str = "cuda", gpu: Any = None
) -> AuditReport:
    """The estimate of ``trainer``'s own step ("sft" or "trainer") for ``config`` on meta: the callback's report
    with the device's figures (:func:`vramguard.estimate.run.device_estimate`; ``gpu``: the card whose context
    allowance the total takes) and the estimate's line."""
    from vramguard.estimate.run import device_estimate, headline
    from vramguard.step import verdict as checks
    from vramguard.step.refusals import refuse_fp16_on_cpu
    from vramguard.step.report import Finding

    if target not in ("cuda", "cpu"):
        raise UsageError(f"target must be one of cuda, cpu, got {target!r}")
    config = config.resolved()
    config.validate()
    refuse_fp16_on_cpu(config, target)  # as the loop's estimate and accelerate for Trainer
    report, q, elapsed = run_trainer_step(config, trainer, steps, target)
    estimate = device_estimate(report, q, config, target, 0, gpu)
    line = headline(estimate, config, False, 0, gpu=gpu)
    note = Finding(
        checks.META_RUN,
        f"estimated on the meta device through {trainer_label(trainer)}'s own step (its model preparation, "
        "collator, compute_loss and optimizer): shapes and dtypes are real, values are not; with --device cpu "
        f"it equals `vramguard audit --trainer {trainer}` to the byte",
    )
    build = checks.notes(checks.BUILD, q.notes)
    findings = [*build, *report.verdict.findings, note]
    verdict = checks.verdict(findings, len(report.steps), headline=line)
    trainer_config = dict(report.config)
    # the model as given (--model's path), as the loop reports it
    merged = {**config.to_dict(step_options=True), **trainer_config, "model": config.model_ref}
    return dataclasses.replace(
        report,
        config=merged,
        architecture={**report.architecture, "attn_implementation": q.attn_implementation},
        verdict=verdict,
        estimate=estimate,
        # meta holds no values: the loss logged is .item()'s answer (1), not a loss
        steps=[dataclasses.replace(s, loss=None) for s in report.steps],
        device=META,
        elapsed_s=elapsed,
    )
