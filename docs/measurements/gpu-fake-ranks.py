"""Rank 0 of an FSDP + QLoRA step on real CUDA tensors, in one process under torch's fake process group (issue 26,
item 2): what ``vramguard estimate --world-size N --sharding S`` prices on meta, measured by the allocator.

The model is built the FSDP + QLoRA recipe's way on the GPU (``build_qlora(sharded=True)``), sharded by the
real engine over a one-dimensional CUDA mesh of N ranks (the fake group answers every collective at once and
moves nothing; every buffer FSDP allocates, the all-gathered layers included, is real), and trained for
``--steps`` steps of vramguard's loop by :func:`vramguard.step.rank.measure_rank`, the function the
audit's ranks and the estimate's meta ranks run. The allocator's peak statistics are reset after the build,
so ``max_memory_allocated`` covers the sharding and the steps. Writes one JSON document.

usage: python docs/measurements/gpu-fake-ranks.py OUT.json MODEL N fsdp2|fsdp1 [--seq-len 2048] [--batch 1]
       [--lora-rank 16] [--gradient-accumulation-steps 1] [--steps 2] [--device cuda|cpu]
       (cpu: a dry run of the script)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from vramguard.estimate.distributed import fake_process_group
from vramguard.step.rank import measure_rank, rank_expectation
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.sharding import ShardingConfig


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    out, model, world, engine = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    device = _arg("--device", "cuda")
    config = QLoRAConfig(
        model=model,
        seq_len=int(_arg("--seq-len", "2048")),
        batch=int(_arg("--batch", "1")),
        lora_rank=int(_arg("--lora-rank", "16")),
        gradient_accumulation_steps=int(_arg("--gradient-accumulation-steps", "1")),
        gradient_checkpointing=True,
        device=device,
    )
    sharding = ShardingConfig(world_size=world, sharding=engine)
    t0 = time.perf_counter()
    q = build_qlora(config, sharded=True)
    expected = rank_expectation(q, config)
    built_s = time.perf_counter() - t0
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        built_allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with fake_process_group(0, world):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world,))
        report, row = measure_rank(
            q, config, sharding, mesh, 0, int(_arg("--steps", "2")), 3, expected, device
        )
    doc = {
        "case": {"model": model, "world_size": world, "sharding": engine, **dataclasses.asdict(config)},
        "row": dataclasses.asdict(row),
        "report": report.to_dict(),
        "built_s": built_s,
        "run_s": time.perf_counter() - t0 - built_s,
    }
    if cuda:
        torch.cuda.synchronize()
        doc["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "allocated_after_build": built_allocated,
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "memory_allocated_end": torch.cuda.memory_allocated(),
            "torch": torch.__version__,
        }
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    print(out, json.dumps(doc.get("cuda", {})), "row allocator peak", row.allocator_peak_bytes)


if __name__ == "__main__":
    main()
