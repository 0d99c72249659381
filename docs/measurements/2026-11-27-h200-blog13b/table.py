"""The table of this folder's README: the Hugging Face 4-bit blog's LLaMA-13B rows run for real on an H200
(``vramguard audit --device cuda --config``) against ``vramguard estimate --config --target cuda`` of the same
flags, and what each run would need on the blog's 15 GiB T4.

Measured: an audit's CUDA phase peaks (absolute ``max_memory_allocated`` readings: weights and cuBLAS's workspace
in) and reserved peaks. Estimated: the meta run's allocator peak plus cuBLAS's 64 MiB, and the total less the CUDA
context (what the allocator reserves, fragmentation allowance included). Reads the JSON files of this folder only.

usage: python table.py   (from this folder)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CUBLAS = 64 << 20
GIB = 1 << 30
CASES = {  # audit name: (what the row changes, the estimate's file)
    "gc-s1024-qv": ("GC, seq 1024, q_proj + v_proj (the row that disagrees)", "gc-s1024-qv"),
    "gc-s1024-all-linear": ("GC, seq 1024, all-linear", "gc-s1024-all-linear"),
    "gc-s1024-nq-qv": ("GC, seq 1024, nested quant., q_proj + v_proj", "gc-s1024-nq-qv"),
    "gc-s1024-nq-all-linear": ("GC, seq 1024, nested quant., all-linear", "gc-s1024-nq-all-linear"),
    "gc-s512-qv": ("GC, seq 512, q_proj + v_proj", "gc-s512-qv"),
    "gc-s1024-qv-sft": ("GC, seq 1024, q_proj + v_proj, TRL's SFTTrainer", "gc-s1024-qv"),
}


def audit(name: str) -> dict[str, Any]:
    path = next(HERE.glob(f"run*/audit-{name}.json"))
    return json.loads(path.read_text())


def main() -> None:
    print(
        "| case | measured `max_memory_allocated` | estimate: allocator peak + cuBLAS | error "
        "| measured reserved | estimate total − context | error | measured reserved, GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (what, est_name) in CASES.items():
        doc = audit(name)
        peak = max(p["peak_bytes"] for p in doc["phases"].values())
        reserved = max(p.get("reserved_peak_bytes") or 0 for p in doc["phases"].values())
        est = json.loads((HERE / "estimates" / f"audit-{est_name}.json").read_text())["estimate"]
        context = next(o["bytes"] for o in est["overheads"] if "context" in o["name"].lower())
        allocator = est["allocator_peak_bytes"] + CUBLAS
        total = est["total_bytes"] - context
        print(
            f"| {what} | {peak:,} | {allocator:,} | {(allocator - peak) / peak * 100:+.2f} % | {reserved:,} "
            f"| {total:,} | {(total - reserved) / reserved * 100:+.2f} % | {reserved / GIB:.2f} |"
        )


if __name__ == "__main__":
    main()
