"""A vision-language QLoRA step on the meta device, the image inputs' values carried beside their meta tensors.

The vision code reads values off its inputs: Qwen's towers loop over ``image_grid_thw.tolist()`` for rotary
positions, window indices and cumulative sequence lengths (``cu_seqlens``), split attention by them, and
``get_rope_index`` walks ``input_ids`` for the image tokens' 3-D positions; Qwen3-VL's deepstack and Idefics3
index with boolean masks made from the rows; every family checks that its image tokens match its features
(``.item()``). On meta none of that has a value. As the mixture-of-experts routing does
(:class:`vramguard.estimate.meta._RoutedValues`), every input of the batch is a meta tensor whose host value
(the processor's row) rides beside it (:class:`ImageValues`): an op whose meta inputs all have values runs on
meta (the storage the tracker counts) and on the host values (its output's value); ``tolist()`` and
``torch.tensor(..., device=meta)``, which never reach a dispatch mode, answer from the values
(:func:`values_on_meta`, which also keeps a value on the host copy activation offloading's emulation makes);
a boolean index with a value into a tensor without one (deepstack's
``hidden_states[visual_pos_masks]``) runs with the mask's true positions, its output's shape as on a device.
The host values are made with every mode off: no tracker counts them.

What autograd keeps is decided above the dispatch modes, so the saved tensors are the real run's; with the CPU
target the step's phase peaks, saved bytes and retained bytes equal ``vramguard audit``'s to the byte
(``tests/test_vision.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vramguard.errors import UsageError
from vramguard.estimate.meta import META, TARGETS, _quantize_on_meta, _RoutedValues, forced_decisions
from vramguard.estimate.no_init import values_not_drawn
from vramguard.measure.ledger import LedgerReport
from vramguard.measure.tracker import MemoryTracker, StorageTracker
from vramguard.step.patching import patch_all
from vramguard.workload.training import StepResult, run_steps
from vramguard.workload.vision import (
    STACKS,
    VisionQLoRAModel,
    apply_tower_checkpointing,
    image_text_model,
    saved_by_stack,
    vision_setup,
)

_INDEX_OPS = ("index.Tensor", "index_put_.default", "index_put.default")


class ImageValues(_RoutedValues):
    """:class:`~vramguard.estimate.meta._RoutedValues` for a whole vision-language batch: int and bool tensors
    made from nothing during the step get host values too (the experts' rule, held open for the whole step); a
    valued tensor copied to meta (``.to(device=meta)``) keeps its value; a boolean mask with a value indexing a
    tensor without one is replaced by its true positions (what the kernel computes from it), so the output has
    the device's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == META:
            metas = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == META]
            if metas and all(a in self.values for a in metas):  # a valued tensor moved to meta
                host_args = [
                    self.values[a] if isinstance(a, torch.Tensor) and a in self.values else a for a in args
                ]
                with _disable_current_modes():
                    host = func(*host_args, **{**kwargs, "device": torch.device("cpu")})
                out = func(*args, **kwargs)
                self.values[out] = host
                return out
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except (NotImplementedError, RuntimeError):
            if func.__name__ not in _INDEX_OPS:
                raise
            indices: list[Any] = []
            for i in args[1]:
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool and i in self.values:
                    indices.extend(self.give(h) for h in self.values[i].nonzero().unbind(1))
                else:
                    indices.append(i)
            self.answered += 1
            return super().__torch_dispatch__(func, types, (args[0], indices, *args[2:]), kwargs)

    def host(self, value: Any) -> Any:
        """``value`` with every valued meta tensor (in lists and tuples) replaced by its value."""
        if isinstance(value, torch.Tensor) and value.device.type == META:
            if value not in self.values:
                raise RuntimeError("a meta tensor without a value where a value is read")
            return self.values[value]
        if isinstance(value, (list, tuple)):
            return type(value)(self.host(v) for v in value)
        return value


@contextlib.contextmanager
def values_on_meta(values: ImageValues) -> Iterator[ImageValues]:
    """Within the block ``values`` is the innermost dispatch mode, and the two ways of reading values that
    dispatch no op answer from it: ``Tensor.tolist()`` of a valued meta tensor, and ``torch.tensor(data,
    device=meta)`` (made on the host from ``data``'s values, with every mode off, then given as a valued meta
    tensor)."""
    tolist = torch.Tensor.tolist
    tensor = torch.tensor

    def valued_tolist(self: torch.Tensor) -> Any:
        if self.device.type == META and self in values.values:
            values.answered += 1
            return values.values[self].tolist()
        return tolist(self)

    def valued_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is None or torch.device(device).type != META:
            return tensor(data, *args, device=device, **kwargs)
        with _disable_current_modes():
            host = tensor(values.host(data), *args, **kwargs)
        return values.give(host)

    from vramguard.estimate.offload import OffloadActivations

    pack = OffloadActivations._pack

    def valued_pack(self: OffloadActivations, saved: torch.Tensor) -> Any:
        # the emulated host copy keeps the value of what it copies (a boolean mask the backward indexes with)
        packed = pack(self, saved)
        if saved in values.values:
            values.values[packed[1].tensor] = values.values[saved]
        return packed

    patches = [
        (torch.Tensor, "tolist", valued_tolist),
        (torch, "tensor", valued_tensor),
        (OffloadActivations, "_pack", valued_pack),
    ]
    with contextlib.ExitStack() as stack:
        patch_all(stack, patches)
        with values:
            yield values


def build_vision_meta(
    config: Any,
    image_size: tuple[int, int] | None = None,
    images_per_row: int | None = None,
    spec: Any = None,
    method: str = "qlora",
    device: str = META,
) -> tuple[VisionQLoRAModel, ImageValues]:
    """The model :func:`vramguard.workload.vision.build_vision_qlora` builds, on meta, as
    :func:`vramguard.estimate.meta.build_meta` builds a text model (``_from_config`` on meta at the compute dtype,
    transformers' own bitsandbytes quantizer, each weight quantized on meta, PEFT unchanged), and the values its
    batch carries: every tensor of the processor's rows a meta tensor with its row as value. ``method`` ``lora``:
    the base left in the compute dtype (no quantizer, no k-bit preparation: transformers' own checkpointing when
    asked), LoRA as PEFT puts it; ``device`` ``cpu`` builds that model with random weights and real rows on the
    host, the reference the tests hold the meta run against (as ``build_meta(device="cpu")`` for a text model)."""
    refuse_quantizer_options(config, method)
    setup = vision_setup(config, image_size, images_per_row, spec)
    return vision_meta_of(setup, config, method, device)


def vision_meta_of(
    setup: Any, config: Any, method: str = "qlora", device: str = META, prepared: bool = True
) -> tuple[VisionQLoRAModel, ImageValues]:
    """:func:`build_vision_meta` of a resolved ``setup`` (:func:`vramguard.workload.vision.vision_setup`).
    ``prepared`` False (``qlora``): the 4-bit model as ``from_pretrained`` loads it, without k-bit preparation and
    LoRA, for TRL's SFTTrainer, which does its own (as ``build_meta(prepared=False)`` for a text model)."""
    from transformers.utils import logging as hf_logging

    from vramguard.workload.models import with_lora

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _vision_base(setup, config, method, device, prepared)
        if prepared:
            apply_tower_checkpointing(model, setup.family, setup.choices)
            # on meta PEFT makes LoRA on the host and moves it to meta: nothing to draw
            with values_not_drawn(meta_only=False) if device == META else contextlib.nullcontext():
                model = with_lora(model, config, setup.choices)
    model.train()
    model.config.use_cache = False
    values = ImageValues()
    inputs = dict(setup.rows.inputs)
    if device == META:
        inputs = {k: values.give(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    run_config = dataclasses.replace(config, device=device)  # (not validated: validate() allows cpu or cuda)
    q = image_text_model(setup, model, run_config, inputs, prepared)
    built = VisionQLoRAModel(
        q=q,
        family=setup.family,
        rows=setup.rows,
        image_size=setup.image_size,
        images_per_row=setup.images_per_row,
    )
    return built, values


def refuse_quantizer_options(config: Any, method: str) -> None:
    """The bitsandbytes options of the tower (``--vision-tower unquantized``, ``--llm-int8-skip-modules``) given
    with a method that quantizes nothing: one line."""
    if method == "qlora":
        return
    given = [
        flag
        for flag, asked in (
            ("--vision-tower unquantized", config.vision_tower == "unquantized"),
            ("--llm-int8-skip-modules", bool(config.llm_int8_skip_modules)),
        )
        if asked
    ]
    if given:
        raise UsageError(
            f"{' and '.join(given)}: what bitsandbytes quantizes, but --method {method} quantizes nothing"
        )


def _vision_base(setup: Any, config: Any, method: str, device: str, prepared: bool = True) -> torch.nn.Module:
    """The base model of ``setup`` on ``device`` before LoRA: ``_from_config`` at the compute dtype; for ``qlora``
    swapped by transformers' own bitsandbytes quantizer, each weight quantized on meta, and PEFT's k-bit
    preparation (``prepared``; without it as ``from_pretrained`` loads it); for ``lora`` as it is, with
    transformers' gradient checkpointing when asked (what
    :func:`vramguard.estimate.meta.build_meta` does for a text model's ``lora``)."""
    if method == "qlora" and device != META:  # the real device's 4-bit model is workload.vision's build
        raise ValueError("build a vision-language QLoRA model on a real device with vramguard.workload.vision")
    from transformers.quantizers import AutoHfQuantizer

    from vramguard.workload.models import (
        BUILD_ERRORS,
        bnb_4bit_config,
        build_error,
        parse_dtype,
        prepare_for_training,
    )

    compute_dtype = parse_dtype(config.compute_dtype)
    try:
        with torch.device(device):
            model = setup.model_class._from_config(
                setup.hf_config, dtype=compute_dtype, attn_implementation=setup.attn
            )
    except (*BUILD_ERRORS, RuntimeError) as exc:
        raise UsageError(f"transformers cannot build {setup.name}: {build_error(exc)}") from None
    if method == "lora":
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    quantizer = AutoHfQuantizer.from_config(
        bnb_4bit_config(config, skip_modules=setup.choices.skip_modules), pre_quantized=False
    )
    quantizer.preprocess_model(model, device_map={"": META}, dtype=compute_dtype)
    _quantize_on_meta(model, compute_dtype)
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return prepare_for_training(model, config) if prepared else model


@dataclass
class VisionStep:
    """A measured (or meta-run) vision-language step: per-step results, the first forward's ledger, its saved
    bytes per stack, the image tokens of a row and the seconds it took."""

    results: list[StepResult]
    ledger: LedgerReport
    by_stack: dict[str, int]
    image_tokens: int
    seconds: float

    @property
    def step_peak_bytes(self) -> int:
        """The highest phase peak of any step."""
        return max(max(r.peak_bytes.values()) for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON."""
        return {
            "image_tokens": self.image_tokens,
            "saved_bytes": self.ledger.saved_bytes,
            "saved_by_stack": self.by_stack,
            "step_peak_bytes": self.step_peak_bytes,
            "steps": [r.to_dict() for r in self.results],
            "seconds": round(self.seconds, 3),
        }


def estimate_vision_step(
    config: Any,
    image_size: tuple[int, int],
    images_per_row: int = 1,
    steps: int = 2,
    target: str = "cpu",
) -> VisionStep:
    """``steps`` QLoRA steps of ``config``'s vision-language model on meta, under the tracker (the ledger on the
    first), with ``target``'s kernel choices (:func:`vramguard.estimate.meta.forced_decisions`) and the batch's
    values carried (:class:`ImageValues`). torch's AdamW (the audit's loop). With ``target="cpu"`` the figures are
    the CPU audit's (:func:`audit_vision_step`)."""
    from vramguard.estimate.run import make_estimate_optimizer

    if target not in TARGETS:
        raise UsageError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    t0 = time.perf_counter()
    built, values = build_vision_meta(config, image_size, images_per_row)
    q = built.q
    optimizer = make_estimate_optimizer(q, "adamw", target)
    source = StorageTracker(None)
    source.device = META
    if target == "cuda":
        from vramguard.estimate.kernels import cuda_kernel_temporaries

        source.kernel_temporaries = cuda_kernel_temporaries
    with (
        forced_decisions(target),
        values_on_meta(values),
        MemoryTracker(META, model=q.model, source=source) as tracker,
    ):
        results, ledger = run_steps(q, steps, tracker, optimizer=optimizer, ledger_step=0)
    return _vision_step(results, ledger, built, t0)


def audit_vision_step(
    config: Any,
    image_size: tuple[int, int],
    images_per_row: int = 1,
    steps: int = 2,
) -> VisionStep:
    """``steps`` real QLoRA steps of ``config``'s vision-language model (:func:`vramguard.workload.vision.
    build_vision_qlora`, on ``config.device``) under the live tracker, the ledger on the first: what ``vramguard
    audit`` measures for a text model, with torch's AdamW."""
    from vramguard.workload.training import make_optimizer
    from vramguard.workload.vision import build_vision_qlora

    t0 = time.perf_counter()
    built = build_vision_qlora(config, image_size, images_per_row)
    with MemoryTracker(config.device, model=built.q.model) as tracker:
        results, ledger = run_steps(built.q, steps, tracker, optimizer=make_optimizer(built.q), ledger_step=0)
    return _vision_step(results, ledger, built, t0)


def _vision_step(results: Any, ledger: Any, built: Any, t0: float) -> VisionStep:
    """The :class:`VisionStep` of a run's step results and first-step ledger (on meta or on a device)."""
    assert ledger is not None
    return VisionStep(
        results=results,
        ledger=ledger,
        by_stack=saved_by_stack(ledger.records, built.family),
        image_tokens=built.rows.image_tokens,
        seconds=time.perf_counter() - t0,
    )


__all__ = [
    "STACKS",
    "ImageValues",
    "VisionStep",
    "audit_vision_step",
    "build_vision_meta",
    "estimate_vision_step",
    "values_on_meta",
    "vision_meta_of",
]
