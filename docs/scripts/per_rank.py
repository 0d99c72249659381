"""The per-rank table of docs/distributed.md: FSDP2 + QLoRA estimates of 7B, 8B and 70B shapes at N = 1, 2, 4, 8.

Each row is ``vramguard estimate --world-size N --sharding fsdp2`` (rank 0, the largest shard; target cuda,
so the CUDA context and allocator allowances are in the total) on the meta device under torch's fake
process group. Writes each run's JSON under ``OUT`` (gzipped: the records repeat per layer) and prints the Markdown table
(docs/distributed.md holds it). Re-run with::

    python docs/scripts/per_rank.py docs/measurements/2026-11-24-per-rank
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

from vramguard.atomic import write_bytes_atomic
from vramguard.estimate.distributed import run_distributed_estimate
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.sharding import ShardingConfig

MODELS = {"7B": "mistral-7b-v0.3", "8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}
WORLD_SIZES = (1, 2, 4, 8)
SETTINGS = {"seq_len": 2048, "batch": 1, "lora_rank": 16, "gradient_checkpointing": True}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    head = (
        "| shape | N | packed 4-bit (shard) | unquantized (shard) | quant_state (replicated) | "
        "LoRA + grads + AdamW | saved | step peak | allocator peak | total (H100) | wall |"
    )
    lines = [head, "|" + "---|" * 11]
    for label, model in MODELS.items():
        for n in WORLD_SIZES:
            t0 = time.perf_counter()
            report = run_distributed_estimate(
                QLoRAConfig(model=model, **SETTINGS), ShardingConfig(n, "fsdp2"), target="cuda", ranks=[0]
            )
            wall = time.perf_counter() - t0
            doc = report.to_dict()
            text = json.dumps(doc, separators=(",", ":")).encode()
            write_bytes_atomic(out / f"{model}-fsdp2-n{n}.json.gz", gzip.compress(text, mtime=0))
            row = report.distributed.per_rank[0]
            t = row.terms
            lines.append(
                f"| {label} (`{model}`) | {n} | {format_bytes(t['packed_4bit_bytes'])} | "
                f"{format_bytes(t['unquantized_bytes'])} | {format_bytes(t['quant_state_bytes'])} | "
                f"{format_bytes(row.lora_training_bytes)} | {format_bytes(row.saved_bytes)} | "
                f"{format_bytes(row.step_peak_bytes)} ({row.peak_phase}) | "
                f"{format_bytes(row.allocator_peak_bytes)} | {format_bytes(row.total_bytes)} | {wall:.0f} s |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
