"""Lint a sharded QLoRA configuration before it fails: the error FSDP will raise, or the bytes a setting costs
per rank, one line each (``audit`` and ``estimate`` with ``--world-size`` / ``--sharding``).

The run vramguard measures is the FSDP + QLoRA recipe (:mod:`vramguard.workload.sharding`). The user's own
run may differ from it in four settings (:class:`FsdpSettings`): the 4-bit weights' storage dtype
(``bnb_4bit_quant_storage``), FSDP1's ``use_orig_params``, FSDP1's wrap policy, and PEFT's
``prepare_model_for_kbit_training``. (Trainer's mixed precision makes accelerate upcast FSDP1's trainable flat
parameters that are not fp32: a LoRA unit is fp32 already, and a unit that mixes LoRA with the base weights
fails FSDP1's dtype check first, so it costs nothing in the configurations linted here.)

Nothing here is a formula of the configuration: the user's model is *built* (on the meta device, by the real
``BitsAndBytesConfig`` with the user's storage and the real ``prepare_model_for_kbit_training``,
:func:`user_model`), and what FSDP1 will refuse is found by torch's own checks run on that model's parameters
(``_validate_frozen_params``, ``FlatParamHandle._validate_tensors_to_flatten``, with the wrap units torch
computes from the wrap policy), so the message is torch's. Bytes are that model's parameters against the
recipe model's, sharded the way the engine shards them (FSDP2: each parameter's dim 0 as ``torch.chunk``;
FSDP1: each unit's flat parameter in ``N`` equal shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.step.report import Finding
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig, parse_dtype
from vramguard.workload.sharding import ShardingConfig, decoder_layers

LINT = "fsdp-lint"
"""The kind of a lint finding (a note: the measured run is the recipe's; the line says what the user's
settings would change)."""

QUANT_STORAGES: tuple[str, ...] = ("bf16", "fp16", "fp32", "uint8")
WRAPS: tuple[str, ...] = ("peft", "layer")
"""FSDP1 wrap policies: ``peft`` (PEFT's ``fsdp_auto_wrap_policy``: every LoRA leaf its own unit, each decoder
layer one; what Trainer installs for a PEFT model) and ``layer`` (accelerate's ``TRANSFORMER_BASED_WRAP``
alone: each decoder layer one unit, its LoRA adapters inside it)."""

UINT8_FSDP2_ISSUE = "https://github.com/huggingface/accelerate/issues/3983"


@dataclass(frozen=True)
class FsdpSettings:
    """The user's settings the recipe fixes: ``quant_storage`` ("" for the compute dtype, the recipe's),
    ``use_orig_params`` and ``wrap`` (FSDP1), ``prepare_kbit`` (PEFT's ``prepare_model_for_kbit_training``
    run before sharding: the recipe skips it)."""

    quant_storage: str = ""
    use_orig_params: bool = False
    wrap: str = "peft"
    prepare_kbit: bool = False

    def validate(self) -> None:
        """UsageError (one line) on a storage dtype or wrap policy that does not exist."""
        if self.quant_storage not in ("", *QUANT_STORAGES):
            raise UsageError(
                f"quant storage must be one of {', '.join(QUANT_STORAGES)}, got {self.quant_storage!r}"
            )
        if self.wrap not in WRAPS:
            raise UsageError(f"fsdp wrap must be one of {', '.join(WRAPS)}, got {self.wrap!r}")

    def storage_dtype(self, config: QLoRAConfig) -> torch.dtype:
        """The dtype the packed 4-bit weights are stored in."""
        if self.quant_storage == "uint8":
            return torch.uint8
        return parse_dtype(self.quant_storage or config.compute_dtype)


@contextlib.contextmanager
def users_choices(config: QLoRAConfig, settings: FsdpSettings) -> Iterator[None]:
    """Within the block vramguard's builds of the recipe (``build_meta`` and ``build_qlora`` with ``sharded``)
    load the 4-bit weights with the user's storage dtype (the real ``BitsAndBytesConfig``) and, with
    ``prepare_kbit``, run PEFT's real ``prepare_model_for_kbit_training`` where the recipe skips it."""
    from vramguard.estimate import meta
    from vramguard.workload import models

    original_bnb, original_prepare = models.bnb_4bit_config, models.prepare_for_training
    storage = settings.storage_dtype(config)

    def bnb(c: QLoRAConfig, sharded: bool = False) -> Any:
        b = original_bnb(c, sharded=sharded)
        b.bnb_4bit_quant_storage = storage
        return b

    def prepare(model: Any, c: QLoRAConfig, sharded: bool = False) -> Any:
        return original_prepare(model, c, sharded=sharded and not settings.prepare_kbit)

    saved = [(m, m.bnb_4bit_config, m.prepare_for_training) for m in (meta, models)]
    for m in (meta, models):
        m.bnb_4bit_config, m.prepare_for_training = bnb, prepare
    try:
        yield
    finally:
        for m, b, pr in saved:
            m.bnb_4bit_config, m.prepare_for_training = b, pr


def user_model(config: QLoRAConfig, settings: FsdpSettings) -> torch.nn.Module:
    """The model the user's settings build, on the meta device (the real libraries' build, the settings
    swapped in)."""
    from vramguard.estimate.meta import build_meta

    with users_choices(config, settings):
        return build_meta(config, sharded=True).model


def recipe_model(config: QLoRAConfig) -> torch.nn.Module:
    """The recipe's model on the meta device (what the run measures)."""
    from vramguard.estimate.meta import build_meta

    return build_meta(config, sharded=True).model


def _chunk_rows(d: int, world: int) -> int:
    """Rows of dim 0 rank 0 holds when FSDP2 shards ``d`` rows over ``world`` ranks (``torch.chunk``)."""
    return min(d, math.ceil(d / world))


def fsdp2_rank_bytes(model: torch.nn.Module, world: int, ignored: set[int] | None = None) -> int:
    """Bytes of ``model``'s parameters on rank 0 once ``fully_shard`` has sharded them over ``world`` ranks
    (each on dim 0); parameters in ``ignored`` (ids) stay whole on every rank."""
    total = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = p.numel() * p.element_size()
        if (ignored and id(p) in ignored) or p.dim() == 0 or p.shape[0] == 0:
            total += nbytes
        else:
            total += _chunk_rows(int(p.shape[0]), world) * (nbytes // int(p.shape[0]))
    return total


def _is_4bit(p: torch.Tensor) -> bool:
    return type(p).__name__ == "Params4bit"


def wrapped_modules(model: torch.nn.Module, wrap: str) -> set[torch.nn.Module]:
    """The modules FSDP1's auto wrap makes units of under ``wrap`` (:data:`WRAPS`), the root excluded: the wrap
    policy's own answer for each module."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if wrap == "peft":
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        classes = {type(m) for m in decoder_layers(model)}
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
    return {m for m in model.modules() if policy(module=m, recurse=False, nonwrapped_numel=0)}


def fsdp1_units(model: torch.nn.Module, wrap: str) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """FSDP1's units for ``wrap`` (:data:`WRAPS`), in the order FSDP1 builds them (post-order, the root last),
    each with the parameters its flat parameter takes, in the order FSDP1 flattens them (the unit's
    ``parameters()`` less those of the units inside it)."""
    from torch.distributed.fsdp._wrap_utils import _get_post_order_named_modules

    to_wrap = wrapped_modules(model, wrap)
    to_wrap.add(model)
    taken: set[int] = set()
    units = []
    for name, module in _get_post_order_named_modules(model):
        if module in to_wrap:
            params = [p for p in module.parameters() if id(p) not in taken]
            taken |= {id(p) for p in params}
            if params:
                units.append((name or "(root)", params))
    return units


def fsdp1_error(model: torch.nn.Module, wrap: str, use_orig_params: bool) -> str | None:
    """The ValueError FSDP1 raises wrapping ``model`` with the callable wrap policy accelerate and Trainer
    pass (its first line, and the unit), from torch's own check of each unit's parameters, or None."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    handle = types.SimpleNamespace(_use_orig_params=use_orig_params)
    for name, params in fsdp1_units(model, wrap):
        try:
            FlatParamHandle._validate_tensors_to_flatten(handle, params)  # type: ignore[arg-type]
        except ValueError as exc:
            return f"{str(exc).splitlines()[0].strip()} (unit {name})"
    return None


def fsdp1_mixed_grad_bytes(model: torch.nn.Module, wrap: str, world: int) -> tuple[int, int, int]:
    """With ``use_orig_params=True``, a unit that holds frozen and trainable parameters has one flat gradient
    for all of them: the frozen parameters' gradients (zeros) are the cost. (bytes per rank kept as the
    sharded gradient, the largest unit's unsharded frozen gradient before reduce-scatter, how many units mix)."""
    sharded = transient = mixed = 0
    for _, params in fsdp1_units(model, wrap):
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        if not trainable or not frozen:
            continue
        mixed += 1
        size = trainable[0].element_size()
        numel = sum(p.numel() for p in frozen)
        sharded += math.ceil(numel / world) * size
        transient = max(transient, numel * size)
    return sharded, transient, mixed


def lint(config: QLoRAConfig, sharding: ShardingConfig, settings: FsdpSettings) -> list[Finding]:
    """The lint findings of running ``config`` sharded by ``sharding`` with the user's ``settings``; empty for
    the recipe's own settings. Each is one line: the error the engine will raise, or the bytes per rank."""
    settings.validate()
    world = sharding.world_size
    compute = parse_dtype(config.compute_dtype)
    storage = settings.storage_dtype(config)
    recipe_settings = settings == FsdpSettings(wrap=settings.wrap) or settings == FsdpSettings(
        quant_storage=config.compute_dtype, wrap=settings.wrap
    )
    findings: list[Finding] = []
    if sharding.sharding == "fsdp1":
        if recipe_settings and settings.wrap == "peft":
            return findings
        model = user_model(config, settings)
        error = fsdp1_error(model, settings.wrap, settings.use_orig_params)
        if error is not None:
            findings.append(
                Finding(
                    LINT, f"lint: fsdp1 with {_describe(config, settings)} will raise ValueError: {error}"
                )
            )
            return findings
        if settings.use_orig_params:
            sharded, transient, mixed = fsdp1_mixed_grad_bytes(model, settings.wrap, world)
            if mixed:
                findings.append(
                    Finding(
                        LINT,
                        f"lint: fsdp1 use_orig_params with the {settings.wrap} wrap: {mixed} units hold frozen and "
                        f"trainable parameters in one flat parameter, whose gradient covers the frozen ones too: "
                        f"+{format_bytes(sharded)} of gradients per rank (and {format_bytes(transient)} unsharded "
                        "before reduce-scatter); wrap the LoRA leaves apart (PEFT's fsdp_auto_wrap_policy)",
                        bytes=sharded,
                    )
                )
        return findings
    if sharding.sharding != "fsdp2":
        return findings
    if recipe_settings:
        return findings
    model = user_model(config, settings)
    recipe = recipe_model(config)
    base = fsdp2_rank_bytes(recipe, world)
    if not storage.is_floating_point:
        packed = {id(p) for p in model.parameters() if _is_4bit(p) and not p.is_floating_point()}
        left_out = fsdp2_rank_bytes(model, world, ignored=packed) - fsdp2_rank_bytes(model, world)
        whole = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in packed)
        findings.append(
            Finding(
                LINT,
                f"lint: fsdp2 with bnb_4bit_quant_storage {_dtype_name(storage)}: accelerate {_accelerate_version()} leaves "
                f"integer 4-bit weights out of fully_shard (ignored_params), so every rank holds all {format_bytes(whole)} of them: "
                f"+{format_bytes(left_out)} per rank at {world} ranks (torch's fully_shard alone crashed or trained "
                f"with NaN on older releases, {UINT8_FSDP2_ISSUE}); set bnb_4bit_quant_storage to "
                f"{_dtype_name(compute)}",
                bytes=left_out,
            )
        )
    extra = fsdp2_rank_bytes(model, world) - base
    if settings.prepare_kbit and extra > 0:  # an fp32 model has nothing to upcast
        upcast = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if not _is_4bit(p)
            and not p.requires_grad
            and p.dtype == torch.float32
            and compute != torch.float32
        )
        findings.append(
            Finding(
                LINT,
                f"lint: fsdp2 after prepare_model_for_kbit_training: norms, embeddings and lm_head upcast to fp32 "
                f"({format_bytes(upcast)} in all): +{format_bytes(extra)} of weights per rank at {world} ranks, "
                "and the activations after each fp32 norm are fp32 (not priced here); the recipe skips it",
                bytes=extra,
            )
        )
    return findings


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "uint8"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def _describe(config: QLoRAConfig, settings: FsdpSettings) -> str:
    parts = [
        f"bnb_4bit_quant_storage {_dtype_name(settings.storage_dtype(config))}",
        f"the {settings.wrap} wrap",
    ]
    parts.append(f"use_orig_params={settings.use_orig_params}")
    if settings.prepare_kbit:
        parts.append("prepare_model_for_kbit_training")
    return ", ".join(parts)


def with_lint(report: Any, findings: list[Finding]) -> Any:
    """``report`` with the lint findings among its verdict's notes."""
    if not findings:
        return report
    verdict = dataclasses.replace(report.verdict, findings=[*report.verdict.findings, *findings])
    return dataclasses.replace(report, verdict=verdict)
