"""``vramguard audit --world-size N --sharding fsdp2|fsdp1``: the step on N real processes, measured per rank.

Each rank is a process of its own, forked by one launcher (``python -m vramguard.audit.launch ranks SPEC``,
:mod:`vramguard.audit.launch`) that imported the model stack once; the rank (:func:`run_rank`) builds the
model the FSDP + QLoRA recipe's way (:mod:`vramguard.workload.sharding`), joins the others through
``torch.distributed`` (gloo on the host, rendezvous through a file store in a temporary folder: no port
to pick), lets the real engine shard it and runs vramguard's loop under the *same* ledger and tracker as
the single-device audit (:func:`measure_rank`, shared with the estimate's fake process group). Each rank
writes its report (the audit's document) atomically; the parent reads them and puts rank 0's report with
a ``distributed`` section (:class:`~vramguard.step.report.DistributedSection`) in front of the user.

The launcher runs under :func:`vramguard.bisect.procgroup.run_in_group`: the ranks share its process group,
which is killed whole when vramguard ends (SIGKILL included), when the run times out, or when one rank fails
(the launcher kills the group rather than leave the others waiting in a collective).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from vramguard.atomic import write_text_atomic
from vramguard.audit.run import check_fits
from vramguard.errors import RunKilled, UsageError
from vramguard.estimate.techniques import used_by
from vramguard.step.rank import measure_rank, merged, rank_expectation
from vramguard.step.report import AuditReport, RankRow
from vramguard.step.request import StepRequest, audit_request
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.sharding import ShardingConfig, check_adapters, cpu_mesh

DEFAULT_TIMEOUT_S = 900.0
"""The whole distributed run (build, N ranks, steps) is killed after this long."""

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank waiting this long in a collective fails (its peer died): gloo's own timeout."""


# -- the real processes --------------------------------------------------------------------------------


REFUSED = "refused.txt"
"""The file in a run's folder where a rank whose build refuses its setting (a :class:`UsageError`: PEFT's,
transformers', the engine's) writes why; the parent raises it as one line (exit 2)."""


SHARDED_OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-fused")
"""torch's AdamW, its default implementation or fused: what the estimate's ``--world-size`` prices, and all that
FSDP2's ranks can step: bitsandbytes' 8-bit optimizers fail on its DTensor parameters ("optimizer_update_32bit
does not have a sharding strategy registered"). FSDP1's flat parameters and ZeRO-3's partitions run them too."""


def run_distributed_audit(
    request: StepRequest | QLoRAConfig,
    sharding: ShardingConfig,
    top: int = 3,
    timeout: float = DEFAULT_TIMEOUT_S,
    before_ranks: Callable[[], object] | None = None,
    **options: Any,
) -> AuditReport:
    """Launch ``sharding.world_size`` ranks of the request's step (its ``steps`` on its config's device; a config
    with ``options``, ``steps`` 3 unless given, is made into the request first: :meth:`StepRequest.on_device`)
    on this host and return the merged report.

    CPU only (gloo): one process per rank needs one device per rank, and NCCL ranks on GPUs are not wired
    here yet. A rank that fails, or a run past ``timeout``, is one line (:class:`UsageError` for what the
    user can change, :class:`RunKilled` for a rank ended from outside, RuntimeError otherwise), with nothing
    left running. ``before_ranks``: a slower refusal of the caller's, made after those that need no build and
    before any rank starts (the command's build of the ranks' model on meta,
    :func:`vramguard.estimate.distributed.sharded_build`)."""
    from vramguard.bisect.procgroup import run_with_tail

    sharding.validate()
    request = audit_request(request, options, steps=3)
    config = request.config
    if torch.device(config.device).type != "cpu":
        raise UsageError("--world-size runs its ranks on the host (gloo): use --device cpu")
    if sharding.sharding == "fsdp2" and config.optimizer not in SHARDED_OPTIMIZERS:
        raise UsageError(
            f"--sharding fsdp2 steps torch's AdamW ({' or '.join(SHARDED_OPTIMIZERS)}), not {config.optimizer}: "
            "bitsandbytes' 8-bit optimizers have no rule for FSDP2's DTensor parameters (fsdp1 and zero3 run them)"
        )
    if sharding.sharding == "zero3":
        from vramguard.workload.zero3 import check_config

        check_config(config)
    check_fits(config)
    _check_host_fits(config, sharding.world_size)
    if before_ranks is not None:
        before_ranks()
    with tempfile.TemporaryDirectory(prefix="vramguard-ranks-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "config": dataclasses.asdict(dataclasses.replace(config, model=config.model_ref)),
                    "sharding": sharding.to_dict(),
                    "steps": request.steps,
                    "top": top,
                    "folder": tmp,
                }
            )
        )
        cmd = [sys.executable, "-m", "vramguard.audit.launch", "ranks", str(spec)]
        code, tail = run_with_tail(cmd, _child_env(), timeout)
        if code != 0 and (Path(tmp) / REFUSED).exists():
            raise UsageError((Path(tmp) / REFUSED).read_text())
        if code != 0:
            _raise_failed(code, tail, sharding.world_size)
        reports = [
            AuditReport.from_dict(json.loads((Path(tmp) / f"rank{r}.json").read_text()))
            for r in range(sharding.world_size)
        ]
        rows = [
            RankRow(**json.loads((Path(tmp) / f"rank{r}.row.json").read_text()))
            for r in range(sharding.world_size)
        ]
    return merged(reports, rows, sharding, _engine_line(sharding))


def _raise_failed(code: int | None, tail: list[str], world: int) -> NoReturn:
    """Why the ranks' launcher ended with ``code`` (None: past the run's time), from the end of its output
    (``tail``): :class:`RunKilled` where a rank, or the launcher itself, was ended by one of
    :data:`~vramguard.audit.launch.EXTERNAL_SIGNALS` (the out-of-memory killer's SIGKILL when the host runs
    out of memory: one line, exit 3, no bug claimed); RuntimeError (an internal error) where a rank failed on
    its own, crashed, or the run timed out. The launcher's note (:data:`~vramguard.audit.launch.NOTE`) names
    the rank and how it ended; the launcher's own ``code`` is -9 whatever the rank did (it kills its
    group)."""
    from vramguard.audit.launch import EXTERNAL_SIGNALS, NOTED

    # what the ranks printed last, not the launcher's note of the failure
    lines = [line.strip() for line in tail]
    noted = [m for m in (NOTED.search(line) for line in lines) if m]
    said = [kept for kept in (NOTED.sub("", line).strip() for line in lines) if kept]
    last = said[-1] if said else "no output"
    if noted:
        rank, code = f"rank {noted[-1]['rank']} of {world}", int(noted[-1]["code"])
    else:  # the launcher never saw a rank fail: it was ended itself
        rank = "the ranks' launcher"
    if code is not None and code < 0:
        try:
            sig: signal.Signals | None = signal.Signals(-code)
            name = sig.name
        except ValueError:
            sig, name = None, f"signal {-code}"
        if sig in EXTERNAL_SIGNALS:
            hint = ""
            if sig == signal.SIGKILL:
                hint = " (on Linux, the out-of-memory killer's signal: `dmesg` names what it killed)"
            printed = f"; the last line printed: {last}" if said else ""
            raise RunKilled(f"{rank} was killed by {name} before the run finished{hint}{printed}")
        raise RuntimeError(f"{rank} crashed with {name}: {last}")
    why = "timed out" if code is None else f"exited with {code}"
    raise RuntimeError(f"the {world} ranks {why}: {last}")


def _engine_line(sharding: ShardingConfig) -> str:
    """What ran, for the report: the processes and the backend (and DeepSpeed's version for ZeRO-3)."""
    line = f"{sharding.world_size} processes, torch.distributed gloo"
    if sharding.sharding == "zero3":
        from vramguard.workload.zero3 import version

        line = f"DeepSpeed {version()} ZeRO-3 engine, {line}"
    return line


def _check_host_fits(config: QLoRAConfig, world_size: int) -> None:
    """Each rank builds the whole model once in fp32 on the host before sharding it (random weights through
    ``from_pretrained``): N times the single build must fit the RAM available."""
    import psutil

    from vramguard.model.analytic import planned_expectation
    from vramguard.units import format_bytes

    plan = planned_expectation(config, config.spec)
    need = world_size * 4 * (plan.quantized_params + plan.other_params)
    room = int(psutil.virtual_memory().available)
    if need > room:
        raise UsageError(
            f"{world_size} ranks each build {config.model} in fp32 on the host ({format_bytes(need)} in all) but "
            f"only {format_bytes(room)} of RAM is available; use a smaller preset or estimate it"
        )


def _child_env() -> dict[str, str]:
    """The launcher's and ranks' environment: this one, with vramguard importable the way it is here, gloo on
    loopback, and no GPU. The ranks run on the host, forked from a launcher that imported what they import:
    bitsandbytes starts CUDA at import where it sees a GPU (a forked child cannot use the CUDA its parent
    started), and DeepSpeed picks its accelerator at import (the CPU's, as each rank sets it)."""
    from vramguard.workload.zero3 import ACCELERATOR

    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(ACCELERATOR)
    return env


def preload(spec: dict[str, Any]) -> None:
    """Import, in the launcher, what each rank of ``spec`` would import while it builds and shards (the
    model's transformers modules, bitsandbytes through transformers' quantizer, PEFT, the engine; DeepSpeed
    for ZeRO-3), so that every rank forked after it starts with them (about 5 CPU seconds a rank). Imports and
    a config object only: no torch operation may run here (an OpenMP pool started before the fork hangs the
    ranks' first parallel region)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.integrations.bitsandbytes  # noqa: F401

    from vramguard.workload.models import resolve_attention

    config = QLoRAConfig(**spec["config"])
    try:
        resolve_attention(config, config.spec)  # imports the model's transformers modules
    except UsageError:  # each rank says it in one line
        pass
    if spec["sharding"]["sharding"] == "zero3":
        import vramguard.audit.zero3  # noqa: F401

        try:
            import deepspeed  # noqa: F401
        except ImportError:  # each rank says why in one line (vramguard.workload.zero3)
            pass


def run_rank(spec_path: str, rank: int) -> int:
    """One rank: build (before joining: transformers writes the random checkpoint only outside a process
    group's non-zero ranks), join through the file store, shard, measure, write the report and row."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    request = StepRequest.on_device(QLoRAConfig(**spec["config"]), steps=int(spec["steps"]))
    config = request.config
    sharding = ShardingConfig(**spec["sharding"])
    folder = Path(spec["folder"])
    world = sharding.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        if sharding.sharding == "zero3":
            from vramguard.audit.zero3 import build_zero3_rank

            q, ds = build_zero3_rank(request, rank, world)
        else:
            q = build_qlora(config, sharded=True)
            check_adapters(q.model, sharding)
    except UsageError as exc:  # what PEFT, transformers or the engine refuse: the parent says it in one line
        write_text_atomic(folder / REFUSED, str(exc))
        return 2
    expected = rank_expectation(q, config)
    store = dist.FileStore(str(folder / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        top = int(spec["top"])
        if sharding.sharding == "zero3":
            from vramguard.audit.zero3 import measure_zero3_rank

            report, row = measure_zero3_rank(q, request, ds, rank, top, expected)
        else:
            mesh = cpu_mesh(world)
            report, row = measure_rank(q, request, sharding, mesh, rank, top, expected, techniques=used_by(config))
        write_text_atomic(folder / f"rank{rank}.json", json.dumps(report.to_dict()))
        write_text_atomic(folder / f"rank{rank}.row.json", json.dumps(dataclasses.asdict(row)))
        dist.barrier()  # gloo's teardown aborts now and then when a peer is already gone
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    """``rank SPEC R``: one rank in a process of its own (:mod:`vramguard.audit.launch` forks them instead);
    anything else exits 2."""
    if len(argv) == 3 and argv[0] == "rank":
        return run_rank(argv[1], int(argv[2]))
    print("usage: python -m vramguard.audit.distributed rank SPEC RANK", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
