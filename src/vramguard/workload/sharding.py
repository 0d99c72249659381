"""A QLoRA model sharded across ranks by a real engine: the FSDP + QLoRA recipe, FSDP2 and FSDP1.

What a user runs when one GPU is not enough is the FSDP + QLoRA recipe (Answer.AI's, and PEFT's
"QLoRA with FSDP" guide): bitsandbytes stores the packed 4-bit weights in the model's dtype
(``bnb_4bit_quant_storage`` = the compute dtype), so that a wrap unit holds one dtype and FSDP can
flatten or all-gather it with the norms beside it; the model is loaded in that dtype, and
``prepare_model_for_kbit_training`` is *not* run (TRL skips it for a sharded QLoRA model: its fp32
upcast of the norms and embeddings would mix dtypes in a unit: "Must flatten tensors with uniform
dtype"). LoRA adapters are PEFT's (fp32, PEFT's ``autocast_adapter_dtype``).

The engines are torch's own, unchanged:

* ``fsdp2``: ``fully_shard`` on every decoder layer (the model's ``_no_split_modules``, what accelerate's
  transformer-based wrap picks), then on the root; each parameter is a ``DTensor`` sharded on dim 0.
* ``fsdp1``: ``FullyShardedDataParallel`` with PEFT's ``fsdp_auto_wrap_policy`` (each LoRA leaf its own
  unit, each decoder layer one) and ``use_orig_params=False``, which that policy exists for: a flat
  parameter must be all frozen or all trainable.

bitsandbytes' quantization state (absmax, the nested statistics, the code tables) hangs off the module
and the weight as plain attributes, neither parameter nor buffer: no engine shards it, every rank keeps
all of it (:func:`rank_terms` names it as replicated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.measure.storage import local_tensor, storage_key, storage_nbytes, tensors_in

SHARDINGS: tuple[str, ...] = ("fsdp2", "fsdp1", "zero3")
"""The engines ``--sharding`` names. ``zero3`` is DeepSpeed's own engine (:mod:`vramguard.workload.zero3`),
an optional dependency: refused with the reason where it is not installed (:func:`ShardingConfig.validate`)."""


@dataclass(frozen=True)
class ShardingConfig:
    """How the step is spread over ranks: ``world_size`` processes, sharded by ``sharding``
    (:data:`SHARDINGS`), with ``cpu_offload`` of the sharded parameters (FSDP's CPU offload)."""

    world_size: int = 2
    sharding: str = "fsdp2"
    cpu_offload: bool = False

    def validate(self) -> None:
        """UsageError (one line) on a world size below 1, an unknown engine, or one that cannot run here."""
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise UsageError(f"world size must be a positive integer, got {self.world_size!r}")
        if self.sharding not in SHARDINGS:
            raise UsageError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.sharding == "zero3":
            from vramguard.workload.zero3 import missing

            why = missing()
            if why is not None:
                raise UsageError(why)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as the JSON document's ``distributed`` section records it."""
        return dataclasses.asdict(self)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: modules whose class is in its ``_no_split_modules`` (what accelerate's
    transformer-based wrap policy and PEFT's wrap both take as the unit)."""
    names = set(_no_split_modules(model))
    return [m for m in model.modules() if type(m).__name__ in names]


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return list(names)
    raise UsageError(
        f"{type(model).__name__} names no decoder layer class (_no_split_modules): cannot wrap it"
    )


def cpu_mesh(world_size: int) -> Any:
    """The one-dimensional device mesh FSDP2 shards over, on the host (given explicitly: on a machine
    without GPUs torch would otherwise look for one)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def check_adapters(model: torch.nn.Module, sharding: ShardingConfig) -> None:
    """Refuse, in one line, what the engine cannot shard of ``model``'s LoRA: FSDP1 with LoRA on parameters
    (PEFT's ``ParamWrapper``: ``target_parameters``, or ``all-linear`` on a mixture of experts' fused stacks and
    its router). PEFT's delta of a wrapped parameter fails at the first forward, in the real ranks as on meta,
    whichever ``use_orig_params``: with False each parameter is a view of its flat parameter ("Output 0 of View
    is a view and its base ... has been modified inplace"); with True PEFT reads the LoRA weights, sharded in
    their own unit, outside it ("inconsistent tensor size")."""
    if sharding.sharding != "fsdp1":
        return
    from vramguard.workload.models import lora_targets

    _, wrapped = lora_targets(model)
    if wrapped:
        raise UsageError(
            f"--sharding fsdp1 with LoRA on parameters ({', '.join(sorted(wrapped))}: PEFT's ParamWrapper, from "
            "target_parameters or all-linear on fused expert stacks) fails at the first forward: PEFT's delta of "
            "a wrapped parameter cannot be made from FSDP1's flat parameters (either use_orig_params); use "
            "--sharding fsdp2, or LoRA on modules only (--target-modules naming them)"
        )


def apply_sharding(model: torch.nn.Module, sharding: ShardingConfig, mesh: Any) -> torch.nn.Module:
    """Shard ``model`` with the real engine ``sharding`` names over ``mesh`` (the default process group's
    ranks); returns the module to train (FSDP1 wraps it, FSDP2 changes it in place)."""
    sharding.validate()
    if sharding.sharding == "zero3":
        raise ValueError("ZeRO-3 shards inside deepspeed.initialize: vramguard.workload.zero3.initialize")
    if sharding.sharding == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        policy = CPUOffloadPolicy(pin_memory=False) if sharding.cpu_offload else OffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        return model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    return FullyShardedDataParallel(
        model,
        process_group=mesh.get_group(),
        auto_wrap_policy=fsdp_auto_wrap_policy(model),
        use_orig_params=False,
        cpu_offload=CPUOffload(offload_params=sharding.cpu_offload),
        device_id=_host_device(model),
        sync_module_states=False,
        limit_all_gathers=True,
    )


def _host_device(model: torch.nn.Module) -> torch.device | None:
    """FSDP1's ``device_id`` for a model on the host or on meta (the estimate's; see
    :func:`vramguard.estimate.distributed.meta_fsdp`); ``None`` on an accelerator, where FSDP1 takes it."""
    device = next(model.parameters()).device
    return device if device.type in ("cpu", "meta") else None


@dataclass
class RankTerms:
    """One rank's resident bytes, by what the engine does with them.

    Sharded (each rank holds its shard): ``packed_4bit_bytes`` (the quantized weights, stored in the model
    dtype), ``unquantized_bytes`` (embeddings, norms, ``lm_head``), ``trainable_bytes`` (the LoRA shards;
    their gradients and optimizer state are :func:`vramguard.step.assemble.lora_training_bytes`).
    Replicated (every rank holds all of it): ``quant_state_bytes`` (absmax, nested statistics, code
    tables: plain attributes, no engine shards them) and ``buffer_bytes`` (rotary frequencies)."""

    packed_4bit_bytes: int
    unquantized_bytes: int
    trainable_bytes: int
    quant_state_bytes: int
    buffer_bytes: int

    def to_dict(self) -> dict[str, int]:
        """The terms as JSON (bytes)."""
        return dataclasses.asdict(self)


def rank_terms(model: torch.nn.Module) -> RankTerms:
    """The resident bytes of ``model`` on this rank, by term, each storage once. FSDP1's flat parameters
    are split by the original parameters' shares of the local shard; FSDP2's ``DTensor`` shards count
    their local tensor."""
    import bitsandbytes as bnb

    quantized_ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            quantized_ids.add(id(m))
    seen: set[int] = set()
    packed = unquantized = trainable = buffers = 0
    flat_done: set[int] = set()
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            key = storage_key(p)
            if key in seen:
                continue
            seen.add(key)
            if hasattr(p, "_shard_param_infos"):  # FSDP1's FlatParameter: split by its original parameters
                if id(p) in flat_done:
                    continue
                flat_done.add(id(p))
                q = _flat_quantized_bytes(p)
                if p.requires_grad:
                    trainable += storage_nbytes(p)
                else:
                    packed += q
                    unquantized += storage_nbytes(p) - q
                continue
            nbytes = storage_nbytes(p)
            if p.requires_grad:
                trainable += nbytes
            elif id(module) in quantized_ids and name == "weight":
                packed += nbytes
            else:
                unquantized += nbytes
        for b in module._buffers.values():
            if b is not None and storage_key(b) not in seen:
                seen.add(storage_key(b))
                buffers += storage_nbytes(b)
    quant_state = 0
    for m in model.modules():
        if id(m) not in quantized_ids:
            continue
        states = [getattr(m, "quant_state", None), getattr(m.weight, "quant_state", None)]
        for state in states:
            if state is None:
                continue
            for _, t in tensors_in(state):
                key = storage_key(t)
                if key not in seen:
                    seen.add(key)
                    quant_state += storage_nbytes(t)
    return RankTerms(packed, unquantized, trainable, quant_state, buffers)


def _flat_quantized_bytes(flat: Any) -> int:
    """Bytes of packed 4-bit weights in an FSDP1 flat parameter's local shard (the rest is unquantized
    weights and the shard's padding)."""
    infos = flat._shard_param_infos
    fqns = flat._fqns
    size = flat.element_size()
    quantized = 0
    for fqn, info in zip(fqns, infos, strict=True):
        if info.in_shard and fqn.endswith("weight") and _is_4bit_weight(flat, fqn):
            quantized += int(info.numel_in_shard) * size
    return quantized


def _is_4bit_weight(flat: Any, fqn: str) -> bool:
    for info, name in zip(flat._param_infos, flat._fqns, strict=True):
        if name == fqn:
            return type(info.module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4")
    return False


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of ``p`` (the local shard of a ``DTensor``)."""
    return local_tensor(p).numel()


def _units(model: torch.nn.Module) -> list[list[tuple[int, int, bool]]]:
    """Each FSDP unit's parameters as (unsharded bytes, element size, trainable), the padding the engine
    all-gathers included: FSDP2's ``FSDPParam`` (padded on dim 0 to a multiple of the world size), FSDP1's
    flat parameters (padded to a multiple of the world size)."""
    units: list[list[tuple[int, int, bool]]] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if callable(get_state):  # FSDP2
            group = getattr(get_state(), "_fsdp_param_group", None)
            if group is None:
                continue
            unit = []
            for fp in group.fsdp_params:
                size = fp.sharded_param.element_size()
                nbytes = fp.padded_sharded_param_size.numel() * fp.mesh_info.shard_mesh_size * size
                unit.append((nbytes, size, bool(fp.sharded_param.requires_grad)))
            units.append(unit)
    for p in model.parameters():  # FSDP1
        padded = getattr(p, "_padded_unsharded_size", None)
        if padded is not None:
            units.append([(int(padded.numel()) * p.element_size(), p.element_size(), bool(p.requires_grad))])
    return units


def transient_terms(model: torch.nn.Module, compute_dtype: torch.dtype) -> dict[str, int]:
    """The transient buffers of a sharded step, named, each the largest of its kind (what the step peak,
    measured, contains; they are not added to it):

    * ``all_gathered_unit``: the largest unit's parameters all-gathered (unsharded, padding included);
      FSDP1 with ``limit_all_gathers`` and FSDP2 on the host hold at most one more (the next, prefetched) on
      an accelerator;
    * ``dequantized_weight``: bitsandbytes dequantizes one 4-bit weight at a time to the compute dtype;
    * ``reduce_scatter_input``: the largest unit's unsharded gradients (its trainable parameters: LoRA);
    * ``units``: how many units the engine all-gathers one by one (a count, not bytes)."""
    import bitsandbytes as bnb

    units = _units(model)
    gathered = max((sum(b for b, _, _ in u) for u in units), default=0)
    grads = max((sum(b for b, _, t in u if t) for u in units), default=0)
    element = torch.empty((), dtype=compute_dtype).element_size()
    dequantized = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            dequantized = max(dequantized, m.in_features * m.out_features * element)
    return {
        "all_gathered_unit": gathered,
        "dequantized_weight": dequantized,
        "reduce_scatter_input": grads,
        "units": len(units),
    }
