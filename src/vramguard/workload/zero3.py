"""DeepSpeed ZeRO-3 + QLoRA through DeepSpeed's own engine (``--sharding zero3``).

What a ZeRO-3 QLoRA user runs (PEFT's "DeepSpeed with QLoRA" guide, the HF Trainer with a ZeRO-3 config):
a DeepSpeed configuration is alive while the model is loaded (transformers' ``HfDeepSpeedConfig``, which the
Trainer's arguments create), so ``from_pretrained`` takes no ``device_map``; bitsandbytes stores the packed
4-bit weights in the compute dtype (``bnb_4bit_quant_storage``, as for FSDP) and a 4-bit model is loaded
whole (transformers' ZeRO-3 ``zero.Init`` is for unquantized models); PEFT adds LoRA; then
``deepspeed.initialize`` with the client's torch AdamW partitions every parameter over the ranks.

What DeepSpeed keeps, per rank (:func:`zero3_terms`, read off the engine after ``initialize``):

* each parameter's partition (``param.ds_tensor``): the packed 4-bit weights, the unquantized weights and
  the LoRA weights, in the compute dtype (``bf16.enabled`` casts the fp32 LoRA adapters), 1/N of each
  parameter padded to a multiple of N; ``param.data`` is an empty tensor between uses;
* the whole parameter as well for *persistent* parameters (fewer elements than
  ``stage3_param_persistence_threshold``): never released after a forward, so replicated;
* the fp32 master copy of the trainable partitions (``fp32_partitioned_groups_flat``), the gradient
  partitions in the compute dtype (``grad_partitions_flat_buffer``, allocated once), the reduce bucket
  (``reduce_bucket_size`` elements), and AdamW's state on the fp32 partitions (made at the first step);
* bitsandbytes' ``quant_state`` whole: a plain attribute of the weight, no parameter, so ZeRO-3 partitions
  none of it (replicated, like under FSDP).

During forward and backward each module's parameters are all-gathered into new tensors before it runs
(with the next ones prefetched up to ``stage3_prefetch_bucket_size`` elements) and released after: those are
inside the tracker's phase peaks.

DeepSpeed runs on the host through its CPU accelerator (``DS_ACCELERATOR=cpu``), whose communication backend
is gloo when Intel's oneCCL bindings are not installed. It is an optional dependency: the ``distributed``
extra. Without it ``--sharding zero3`` is refused in one line (:func:`missing`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch

EXTRA = "distributed"
"""The extra that installs DeepSpeed (``pip install -c constraints.txt -e ".[distributed]"``)."""


def _deepspeed() -> Any:
    """The ``deepspeed`` module; where it is not installed, the one-line refusal (:func:`missing`)."""
    try:
        import deepspeed
    except ImportError as exc:
        from vramguard.errors import UsageError

        raise UsageError(missing() or f"DeepSpeed does not import: {exc}") from None
    return deepspeed


def missing() -> str | None:
    """Why ``--sharding zero3`` cannot run here (one line), or None when DeepSpeed is installed. Looks for
    the package without importing it (importing DeepSpeed probes the accelerators)."""
    if importlib.util.find_spec("deepspeed") is None:
        return (
            "--sharding zero3 runs DeepSpeed's own engine and DeepSpeed is not installed: "
            f'pip install -c constraints.txt -e ".[{EXTRA}]" (it is neither simulated nor imitated)'
        )
    return None


def check_config(config: Any) -> None:
    """UsageError (one line) for a step DeepSpeed cannot run on the host: fp16, which its CPU accelerator
    refuses at ``initialize`` ("Type fp16 is not supported on your device.", DeepSpeed 0.19.8)."""
    from vramguard.errors import UsageError
    from vramguard.workload.models import parse_dtype

    if parse_dtype(config.compute_dtype) == torch.float16:
        raise UsageError(
            "--sharding zero3 --compute-dtype fp16: DeepSpeed's CPU accelerator refuses fp16 (\"Type fp16 is not "
            'supported on your device."); use bf16 or fp32'
        )


def ds_config(config: Any, hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed configuration of ``config``'s step: ZeRO stage 3, this rank's micro-batch, the compute
    dtype's mixed precision (bf16 or fp16; fp32 neither), the client's torch AdamW (DeepSpeed's own CPU Adam
    is a C++ op to compile; the Trainer also passes its torch optimizer when the configuration names none),
    and the three sizes the Trainer fills for ``"auto"`` from the model's hidden size h
    (``transformers.integrations.deepspeed``): reduce bucket h^2, prefetch bucket 0.9 h^2, persistence
    threshold 10 h. Everything else is DeepSpeed's default (``overlap_comm`` on for stage 3)."""
    from vramguard.workload.models import parse_dtype

    dtype = parse_dtype(config.compute_dtype)
    return {
        "train_micro_batch_size_per_gpu": int(config.batch),
        "gradient_accumulation_steps": int(config.gradient_accumulation_steps),
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        },
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


ACCELERATOR: dict[str, str] = {"DS_ACCELERATOR": "cpu"}
"""DeepSpeed's accelerator for ranks on the host, which it picks when it is imported."""


def rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """What DeepSpeed reads from the environment of a rank: its CPU accelerator, and the ranks that
    ``deepspeed.zero`` takes from the launcher's variables (``LOCAL_RANK`` names the device)."""
    return {
        **ACCELERATOR,
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


@contextlib.contextmanager
def hf_deepspeed(ds: dict[str, Any]) -> Iterator[None]:
    """transformers sees a ZeRO-3 configuration within the block (``HfDeepSpeedConfig``, as the Trainer's
    arguments make one): ``from_pretrained`` loads the way it does for a ZeRO-3 run."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds)
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()


def initialize(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds: dict[str, Any]
) -> tuple[Any, Any]:
    """``deepspeed.initialize`` of ``model`` with the client ``optimizer``: the engine and its ZeRO-3
    optimizer. The default process group must exist (gloo); DeepSpeed joins it."""
    deepspeed = _deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, zero_optimizer


def version() -> str:
    """DeepSpeed's version (its distribution's metadata: no import)."""
    from importlib.metadata import version as dist_version

    return dist_version("deepspeed")


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _optimizer_attr(zero_optimizer: Any, name: str) -> Any:
    """A ZeRO-3 optimizer attribute (None where this DeepSpeed release has none)."""
    return getattr(zero_optimizer, name, None)


def _inner_state_bytes(zero_optimizer: Any) -> int:
    """Bytes of the client optimizer's state that the ZeRO-3 optimizer wraps (AdamW's moments on the fp32
    master partitions and its step counters; 0 before the first step)."""
    inner = getattr(zero_optimizer, "optimizer", None)
    return sum(
        _nbytes(t)
        for s in getattr(inner, "state", {}).values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )


def _master_bytes(zero_optimizer: Any) -> int:
    """Bytes of the fp32 master partitions of the trainable parameters."""
    return sum(_nbytes(t) for t in _optimizer_attr(zero_optimizer, "fp32_partitioned_groups_flat") or ())


def zero3_terms(model: torch.nn.Module, zero_optimizer: Any) -> dict[str, int]:
    """This rank's resident bytes under ZeRO-3, by term, read off the partitioned ``model`` and the engine's
    ZeRO-3 optimizer (see the module's docstring). The keys of
    :class:`vramguard.workload.sharding.RankTerms` (partitions: packed 4-bit, unquantized, trainable;
    replicated: quant_state, buffers) and ZeRO-3's own: ``persistent_bytes`` (whole parameters kept beside
    their partition; ``persistent_trainable_bytes`` of them LoRA's), ``fp32_master_bytes``, ``grad_partition_bytes``, ``reduce_bucket_bytes``,
    ``optimizer_state_bytes`` (0 before the first step), ``persistent_params``, ``partitioned_params``."""
    import bitsandbytes as bnb

    from vramguard.measure.storage import storage_key, storage_nbytes, tensors_in

    packed = unquantized = trainable = persistent = persistent_trainable = buffers = 0
    n_persistent = n_partitioned = 0
    quantized: list[torch.nn.Module] = []
    for module in model.modules():
        is_4bit = isinstance(module, bnb.nn.Linear4bit)
        if is_4bit:
            quantized.append(module)
        for name, p in module._parameters.items():
            if p is None or not hasattr(p, "ds_tensor"):
                continue
            part = _nbytes(p.ds_tensor)
            if getattr(p, "ds_persist", False):
                n_persistent += 1
                persistent += _nbytes(p.data)
                persistent_trainable += _nbytes(p.data) if p.requires_grad else 0
            else:
                n_partitioned += 1
            if p.requires_grad:
                trainable += part
            elif is_4bit and name == "weight":
                packed += part
            else:
                unquantized += part
        for b in module._buffers.values():
            if b is not None:
                buffers += _nbytes(b)
    seen: set[int] = set()
    quant_state = 0
    for m in quantized:
        for state in (getattr(m, "quant_state", None), getattr(m.weight, "quant_state", None)):
            for _, t in tensors_in(state) if state is not None else ():
                if storage_key(t) not in seen:
                    seen.add(storage_key(t))
                    quant_state += storage_nbytes(t)
    state = _inner_state_bytes(zero_optimizer)
    return {
        "packed_4bit_bytes": packed,
        "unquantized_bytes": unquantized,
        "trainable_bytes": trainable,
        "quant_state_bytes": quant_state,
        "buffer_bytes": buffers,
        "persistent_bytes": persistent,
        "persistent_trainable_bytes": persistent_trainable,
        "fp32_master_bytes": _master_bytes(zero_optimizer),
        "grad_partition_bytes": _nbytes(_optimizer_attr(zero_optimizer, "grad_partitions_flat_buffer")),
        "reduce_bucket_bytes": sum(
            _nbytes(getattr(bucket, "buffer", None))
            for bucket in (getattr(zero_optimizer, "ipg_buckets", None) or {}).values()
        ),
        "optimizer_state_bytes": state,
        "persistent_params": n_persistent,
        "partitioned_params": n_partitioned,
    }


def zero3_transient(model: torch.nn.Module, ds: dict[str, Any], compute_dtype: torch.dtype) -> dict[str, int]:
    """The transient buffers of a ZeRO-3 step, named, each the largest of its kind (inside the measured step
    peak, not added to it): ``all_gathered_unit`` (the largest module's own parameters gathered whole:
    ZeRO-3 gathers per module), ``prefetch_bucket`` (the elements it may gather ahead, in bytes of the
    compute dtype), ``dequantized_weight``, ``reduce_scatter_input`` (the reduce bucket) and ``units`` (the
    modules with parameters)."""
    import bitsandbytes as bnb

    element = torch.empty((), dtype=compute_dtype).element_size()
    zero = ds["zero_optimization"]
    units = gathered = dequantized = 0
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None and hasattr(p, "ds_numel")]
        if params:
            units += 1
            gathered = max(gathered, sum(int(p.ds_numel) * p.element_size() for p in params))
        if isinstance(module, bnb.nn.Linear4bit):
            dequantized = max(dequantized, module.in_features * module.out_features * element)
    return {
        "all_gathered_unit": gathered,
        "prefetch_bucket": int(zero["stage3_prefetch_bucket_size"]) * element,
        "dequantized_weight": dequantized,
        "reduce_scatter_input": int(zero["reduce_bucket_size"]) * element,
        "units": units,
    }


def lora_training_bytes(trainable: Any, zero_optimizer: Any) -> int:
    """LoRA's training bytes on this rank under ZeRO-3: the trainable partitions (and the whole tensor of a
    persistent one) in the compute dtype, the gradient partitions, the fp32 master partitions and AdamW's
    state on them (:func:`zero3_terms`)."""
    params = list(trainable)
    own = sum(
        _nbytes(p.ds_tensor) + (_nbytes(p.data) if getattr(p, "ds_persist", False) else 0) for p in params
    )
    state = _inner_state_bytes(zero_optimizer)
    master = _master_bytes(zero_optimizer)
    grads = _nbytes(_optimizer_attr(zero_optimizer, "grad_partitions_flat_buffer"))
    return own + grads + master + state


def is_zero3_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-3 optimizer (it keeps fp32 master partitions)."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat")
