"""The per-rank table of docs/distributed.md: FSDP2 + QLoRA estimates of 7B, 8B and 70B shapes at N = 1, 2, 4, 8.

Each row is ``vramguard estimate --world-size N --sharding fsdp2`` (rank 0, the largest shard; target cuda,
so the CUDA context and allocator allowances are in the total) on the meta device under torch's fake
process group. ``main`` runs them and writes each run's JSON under ``OUT`` (gzipped: the records repeat per
layer); :func:`render` makes the Markdown table from those files alone, which is what docs/distributed.md
holds between its ``per-rank table`` markers (``tests/test_docs_tables.py`` checks it). Re-run with::

    python docs/scripts/per_rank.py docs/measurements/2026-11-24-per-rank    # the runs, then the table
    python docs/scripts/per_rank.py docs/measurements/2026-11-24-per-rank --render-only
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

from vramguard.units import format_bytes

MODELS = {"7B": "mistral-7b-v0.3", "8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}
WORLD_SIZES = (1, 2, 4, 8)
SETTINGS = {"seq_len": 2048, "batch": 1, "lora_rank": 16, "gradient_checkpointing": True}
HEAD = (
    "| shape | N | packed 4-bit (shard) | unquantized (shard) | quant_state (replicated) | "
    "LoRA + grads + AdamW | saved | step peak | allocator peak | total (H100) |"
)


def path_of(out: Path, model: str, n: int) -> Path:
    return out / f"{model}-fsdp2-n{n}.json.gz"


def row_line(label: str, model: str, n: int, doc: dict[str, Any]) -> str:
    """One table row from one run's ``--json`` document (its ``distributed`` section's rank 0)."""
    row = doc["distributed"]["per_rank"][0]
    t = row["terms"]
    cells = [
        f"{label} (`{model}`)",
        str(n),
        format_bytes(t["packed_4bit_bytes"]),
        format_bytes(t["unquantized_bytes"]),
        format_bytes(t["quant_state_bytes"]),
        format_bytes(row["lora_training_bytes"]),
        format_bytes(row["saved_bytes"]),
        f"{format_bytes(row['step_peak_bytes'])} ({row['peak_phase']})",
        format_bytes(row["allocator_peak_bytes"]),
        format_bytes(row["total_bytes"]),
    ]
    return "| " + " | ".join(cells) + " |"


def render(out: Path) -> str:
    """The Markdown table from the runs' files under ``out``."""
    lines = [HEAD, "|" + "---|" * 10]
    for label, model in MODELS.items():
        for n in WORLD_SIZES:
            doc = json.loads(gzip.decompress(path_of(out, model, n).read_bytes()))
            lines.append(row_line(label, model, n, doc))
    return "\n".join(lines)


def terms_table(out: Path, model: str = MODELS["70B"], n: int = 2) -> str:
    """One run's rank 0, term by term (docs/distributed.md's "A 70B shape at N = 2"), from its file alone."""
    doc = json.loads(gzip.decompress(path_of(out, model, n).read_bytes()))
    row = doc["distributed"]["per_rank"][0]
    t = row["terms"]
    rows = [
        ("packed 4-bit weights (shard)", t["packed_4bit_bytes"]),
        ("unquantized weights (shard)", t["unquantized_bytes"]),
        ("quant_state (replicated)", t["quant_state_bytes"]),
        ("LoRA shard + grads + AdamW", row["lora_training_bytes"]),
        ("saved activations (ledger: layer inputs under checkpointing, logits)", row["saved_bytes"]),
        (
            "all-gathered weights backward uses (ledger, not saved; of them held from forward to backward: "
            f"{format_bytes(row['gathered_held_bytes'])})",
            row["gathered_weight_bytes"],
        ),
        (f"{row['peak_phase']} peak (tracker)", row["step_peak_bytes"]),
        ("allocator peak", row["allocator_peak_bytes"]),
        ("total with the H100 overheads (CUDA context, cuBLAS, fragmentation allowance)", row["total_bytes"]),
    ]
    lines = ["| term | bytes |", "|---|---:|"]
    lines += [f"| {name} | {format_bytes(value)} |" for name, value in rows]
    return "\n".join(lines)


def run(out: Path) -> None:
    """Every row's estimate, each written to its file as it finishes."""
    from vramguard.atomic import write_bytes_atomic
    from vramguard.estimate.distributed import run_distributed_estimate
    from vramguard.workload.models import QLoRAConfig
    from vramguard.workload.sharding import ShardingConfig

    out.mkdir(parents=True, exist_ok=True)
    for label, model in MODELS.items():
        for n in WORLD_SIZES:
            report = run_distributed_estimate(
                QLoRAConfig(model=model, **SETTINGS), ShardingConfig(n, "fsdp2"), target="cuda", ranks=[0]
            )
            doc = report.to_dict()
            text = json.dumps(doc, separators=(",", ":")).encode()
            write_bytes_atomic(path_of(out, model, n), gzip.compress(text, mtime=0))
            print(row_line(label, model, n, doc), flush=True)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if "--render-only" not in sys.argv[2:]:
        run(target)
    print(render(target))
    print()
    print(terms_table(target))
