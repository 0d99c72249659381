"""``vramguard estimate --world-size N --sharding fsdp2|fsdp1``: one rank of a sharded step, on the meta device.

The real engine runs in this one process: torch's fake process group (``FakeStore``, the ``fake`` backend,
world size N, this process playing rank r) answers every collective at once without moving data, and FSDP2's
``fully_shard`` shards the meta-built model of the FSDP + QLoRA recipe over a ``meta`` device mesh. Each
rank's shards, all-gather buffers, reduce-scatter buffers, gradients and optimizer state get their real
shapes and dtypes; the step runs under the audit's ledger and tracker (:func:`vramguard.step.rank.
measure_rank`, shared with the real ranks), so on CPU kernels (``--target cpu``) it equals
``audit --world-size N`` rank by rank.

FSDP2 never expected to *train* on meta; :func:`meta_fsdp` lets it, changing three things and no
sharding: the check that refuses meta parameters at lazy init (``_validate_no_meta_params``) is skipped;
the device of a ``meta`` mesh is ``meta`` (FSDP2 asks a device module for an index); and the device module
of ``meta`` is the CPU's (``torch.cpu``: streams and events that do nothing, one device), where torch has
none. FSDP1 (``FullyShardedDataParallel``, ``device_id=meta``) gets the same device module (its current
device being ``meta``) and is not asked to materialise a module whose parameters are on meta (it would
``to_empty`` and re-initialise them, which the real run, whose weights are loaded, never does); and its
two storage-identity tests (``_same_storage``, and the catch-all reshard's "already resharded?") compare
storages rather than ``data_ptr()``, which is 0 for every meta tensor (without that, every unit stays
unsharded after backward on meta). Its flat parameters, their shards and its unsharded buffers are then
made by its own code on meta.

Ranks whose shards have the same shapes (all but a last, shorter one, typically) run once; their rows say
which rank they copy (``same_as``).

Eager experts (a loop over the experts hit, which meta cannot draw): each rank routes its own batch, so each
runs its step once per forced routing (:data:`~vramguard.workload.routing.ROUTINGS`, as the one-device estimate
does) and reports the highest, its ``routing:`` line naming all (:func:`vramguard.estimate.run.with_bounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.estimate.meta import build_meta
from vramguard.estimate.run import highest_routing, meta_source, meta_step_contexts, overheads, with_bounds
from vramguard.estimate.techniques import liger, offloading, used_by
from vramguard.measure.storage import local_tensor, storage_key
from vramguard.step.rank import measure_rank, merged, rank_expectation
from vramguard.step.report import AuditReport, RankRow
from vramguard.step.patching import patch_all
from vramguard.step.request import META, StepRequest
from vramguard.step.technique import Technique, bounding_requests
from vramguard.workload.models import QLoRAConfig, QLoRAModel
from vramguard.workload.routing import eager_top_k
from vramguard.workload.sharding import ShardingConfig, check_adapters


@contextlib.contextmanager
def meta_fsdp() -> Iterator[None]:
    """Within the block FSDP2 and FSDP1 train on meta (see the module's docstring for what changes)."""
    import torch.distributed.fsdp._common_utils as fsdp1_common
    import torch.distributed.fsdp._flat_param as fsdp1_flat
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    import torch.distributed.fsdp._fully_shard._fully_shard as fully
    import torch.distributed.fsdp._init_utils as fsdp1_init
    import torch.distributed.fsdp._runtime_utils as fsdp1_runtime
    from torch.distributed import device_mesh

    original_handle = device_mesh._get_device_handle
    original_device = fully._get_device_from_mesh
    handle_class = fsdp1_common._FSDPDeviceHandle
    original_from_device = handle_class.__dict__["from_device"]
    original_same_storage = fsdp1_flat._same_storage
    original_catch_all = fsdp1_runtime._catch_all_reshard

    def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.device.type == META and b.device.type == META:
            return storage_key(local_tensor(a)) == storage_key(local_tensor(b))
        return original_same_storage(a, b)

    def catch_all_reshard(state: Any) -> None:
        handle = state._handle
        if handle is None or handle.flat_param.device.type != META:
            return original_catch_all(state)
        flat = handle.flat_param
        if storage_key(flat) == storage_key(flat._local_shard) and not handle._skipped_use_sharded_views:
            return None  # already resharded
        fsdp1_runtime._reshard(state, handle, fsdp1_runtime._should_free_in_backward(state, handle))
        return None

    def fsdp1_handle(cls: Any, device: torch.device) -> Any:
        if device.type == META:
            return cls(device, backend=_MetaDeviceModule())
        return original_from_device.__func__(cls, device)

    def handle(device_type: str = "cuda") -> Any:
        return torch.cpu if device_type == META else original_handle(device_type)

    def device_of(mesh: Any) -> torch.device:
        return torch.device(META) if mesh.device_type == META else original_device(mesh)

    modules = (device_mesh, collectives, fsdp_init, param_group, fsdp_state)
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        patch_all(
            stack,
            [
                *((m, "_get_device_handle", handle) for m in modules),
                (fully, "_get_device_from_mesh", device_of),
                (param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None),
                (handle_class, "from_device", classmethod(fsdp1_handle)),
                (fsdp1_init, "_need_to_materialize_module", lambda *args, **kwargs: (False, False)),
                (fsdp1_flat, "_same_storage", same_storage),
                (fsdp1_runtime, "_catch_all_reshard", catch_all_reshard),
            ],
        )
        # FSDP1 warns that device_id meta has no index (a meta run's artefact: a user's rank names its GPU)
        warnings.filterwarnings("ignore", message=r"FSDP got the argument `device_id` meta", category=UserWarning)
        yield


class _MetaDeviceModule:
    """FSDP1's device module for ``meta``: the CPU's (streams and events that do nothing), whose current
    device is ``meta``, so that FSDP1's compute device is where the parameters are."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def current_device(self) -> str:
        return META


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group, this process being ``rank`` of ``world_size``
    (collectives return at once and move nothing); destroyed on the way out. Refused when a process group
    is already initialised here (a real run's)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UsageError("a process group is already initialised in this process: cannot estimate here")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_signature(shapes: list[torch.Size], rank: int, world_size: int) -> tuple[int, ...]:
    """The dim-0 length of each parameter's shard on ``rank`` (FSDP2 splits dim 0 as ``torch.chunk`` does):
    two ranks with the same signature run the same step."""
    rows = []
    for shape in shapes:
        d = int(shape[0]) if len(shape) else 1
        chunk = math.ceil(d / world_size)
        rows.append(max(0, min(chunk, d - rank * chunk)))
    return tuple(rows)


def sharded_build(config: QLoRAConfig, sharding: ShardingConfig) -> QLoRAModel:
    """``config``'s model as each FSDP rank builds it (``build_qlora(sharded=True)``), on meta: what that
    build refuses (PEFT, transformers) or the engine cannot shard (:func:`~vramguard.workload.sharding.
    check_adapters`) raises here, in a second, where each of ``audit --world-size``'s ranks would load the
    model to say it."""
    if sharding.sharding not in ("fsdp2", "fsdp1"):
        raise ValueError(f"FSDP ranks' build, not {sharding.sharding}'s (DeepSpeed's is inside its engine)")
    built = build_meta(config, sharded=True)
    check_adapters(built.model, sharding)
    return built


def run_distributed_estimate(
    config: QLoRAConfig,
    sharding: ShardingConfig,
    steps: int = 2,
    top: int = 3,
    target: str = "cuda",
    ranks: list[int] | None = None,
) -> AuditReport:
    """Every rank of ``config``'s step sharded by ``sharding`` (FSDP2 or FSDP1), each on meta under the fake
    process group; ranks with the same shard shapes run once. ``ranks``: only these (rank 0's report leads)."""
    if sharding.sharding == "zero3":
        raise UsageError(
            "estimate --sharding zero3: DeepSpeed's engine is not run on the meta device (see docs/distributed.md); "
            "measure it with audit --world-size N --sharding zero3"
        )
    sharding.validate()
    if sharding.sharding not in ("fsdp2", "fsdp1"):
        raise UsageError(
            f"estimate --sharding {sharding.sharding}: only fsdp2 and fsdp1 run on the meta device; "
            "measure it with audit --world-size"
        )
    request = StepRequest(config, target=target, steps=steps)  # validated once; its model resolved
    config = request.config
    world = sharding.world_size
    wanted = list(range(world)) if ranks is None else sorted(set(ranks))
    if not wanted or wanted[0] < 0 or wanted[-1] >= world:
        raise UsageError(f"ranks must be in 0..{world - 1}, got {ranks!r}")
    built = sharded_build(config, sharding)
    # eager experts: a loop over the experts hit, which meta cannot draw; each rank runs every forced routing
    bounds = bounding_requests(used_by(config), request, built)
    top_k = eager_top_k(built.model)
    shapes = [p.shape for p in built.model.parameters()]
    done: dict[tuple[int, ...], tuple[int, AuditReport, RankRow]] = {}
    reports: list[AuditReport] = []
    rows: list[RankRow] = []
    for rank in wanted:
        # FSDP1 splits each unit's flat parameter, not each parameter: every rank runs
        signature = shard_signature(shapes, rank, world) if sharding.sharding == "fsdp2" else (rank,)
        if signature in done:
            first, report, row = done[signature]
            reports.append(report)
            rows.append(dataclasses.replace(row, rank=rank, same_as=first))
            continue
        if not bounds:
            report, row = _one_rank(request, sharding, rank, top)
        else:  # the rank's report and row are the highest routing's, its routing: line names all
            runs = {kind: _one_rank(forced, sharding, rank, top) for kind, forced in bounds.items()}
            high = highest_routing({kind: r for kind, (r, _) in runs.items()})
            forced_by = f"a meta run of rank {rank}'s step"  # the report shows rank 0's line
            report = with_bounds({kind: r for kind, (r, _) in runs.items()}, high, top_k, forced_by)
            row = runs[high][1]
        done[signature] = (rank, report, row)
        reports.append(report)
        rows.append(row)
    report = merged(reports, rows, sharding, f"fake process group, world size {world}, meta device")
    return report


NOT_ON_RANKS: tuple[str, ...] = (liger.TECHNIQUE.name, offloading.TECHNIQUE.name)
"""Techniques a rank's step does not run: priced on one device (``vramguard estimate --world-size`` refuses
them)."""


def rank_techniques(config: QLoRAConfig) -> list[Technique]:
    """The registry's techniques ``config`` uses that a rank's step runs (autocast, the attention kernel, the
    rows' answer, the routing: as on one device), in the registry's order."""
    return [t for t in used_by(config) if t.name not in NOT_ON_RANKS]


def _one_rank(
    request: StepRequest, sharding: ShardingConfig, rank: int, top: int
) -> tuple[AuditReport, RankRow]:
    """``rank``'s report and row of ``request``'s step; the request's ``routing``: the experts' routing forced
    (each rank routes its own batch)."""
    from torch.distributed.device_mesh import init_device_mesh

    config, target = request.config, request.target

    q = build_meta(config, sharded=True)
    expected = rank_expectation(q, config)
    source = meta_source(META, target)
    techniques = rank_techniques(config)
    on_step = meta_step_contexts(q, request, techniques)  # outside the tracker, which measure_rank enters
    with fake_process_group(rank, sharding.world_size), meta_fsdp(), on_step:
        mesh = init_device_mesh(META, (sharding.world_size,))
        report, row = measure_rank(
            q, request, sharding, mesh, rank, top, expected, source=source, meta_run=True, techniques=techniques
        )
    extra = overheads(row.allocator_peak_bytes, checkpointing=config.gradient_checkpointing, target=target)
    row = dataclasses.replace(row, total_bytes=row.allocator_peak_bytes + sum(o.bytes for o in extra))
    return dataclasses.replace(report, device=META), row
