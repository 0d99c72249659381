"""The tables of this folder's README: each case measured on the H100 against `vramguard estimate --target cuda`.

Measured: the audit's CUDA phase peaks (absolute allocator readings, weights and cuBLAS's workspaces in:
``max_memory_allocated`` of the steps) and reserved peaks; for a rank, the row ``gpu-fake-ranks.py`` wrote
(rank 0 under the fake process group). Estimated: the allocator peak of the meta run plus cuBLAS's 64 MiB
(``CUBLAS_WORKSPACE_BYTES``: both are in ``max_memory_allocated``), and the total with its allowances against
the reserved bytes. Reads the JSON files here only.

usage: python table.py   (from this folder)
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RUNS = ("run1-suite-probe-ranks-configs", "run2-suite-moe-validation-snapshots")
CUBLAS = 64 << 20
GIB = 1 << 30


def measured_run(name: str) -> tuple[dict[str, Any] | None, str]:
    """The latest run's document of ``name`` (run 2 holds the re-runs) and the run's folder."""
    for folder in reversed(RUNS):
        for path in (HERE / folder / f"{name}.json", HERE / folder / f"{name}.json.gz"):
            if path.exists():
                raw = path.read_bytes()
                return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw), folder
    return None, ""


def estimate(name: str) -> dict[str, Any]:
    for path in (HERE / "estimates" / f"{name}.json", HERE / "estimates" / f"{name}.json.gz"):
        if path.exists():
            raw = path.read_bytes()
            return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    raise SystemExit(f"no estimate for {name}")


def pct(a: int, b: int) -> str:
    return f"{(a - b) / b * 100:+.2f} %"


def head(*cells: str) -> None:
    """A table's header row and its alignment row (the first column left, the others right)."""
    print("| " + " | ".join(cells) + " |")
    print("|---|" + "---:|" * (len(cells) - 1))


def measured(kind: str, names: list[str], columns: int) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(name, document, run folder) of each measured case; a row saying "not measured" for the others."""
    for name in names:
        doc, folder = measured_run(f"{kind}-{name}")
        if doc is None:
            print(f"| {name} | not measured |" + " |" * (columns - 2))
            continue
        yield name, doc, folder


def audits(names: list[str]) -> None:
    head(
        "case",
        "measured `max_memory_allocated`",
        "estimate: allocator peak + cuBLAS",
        "error",
        "measured reserved",
        "estimate total − context",
        "error",
        "reserved − allocated: measured / allowance",
    )
    for name, doc, folder in measured("audit", names, 8):
        peak = max(p["peak_bytes"] for p in doc["phases"].values())
        reserved = max(p.get("reserved_peak_bytes") or 0 for p in doc["phases"].values())
        est = estimate(f"audit-{name}")["estimate"]
        alloc = est["allocator_peak_bytes"] + CUBLAS
        context = next(o["bytes"] for o in est["overheads"] if "context" in o["name"].lower())
        total = est["total_bytes"] - context
        allowance = next(o["bytes"] for o in est["overheads"] if "fragmentation" in o["name"].lower())
        share = (
            f"{(reserved - peak) / peak * 100:.1f} % / {allowance / est['allocator_peak_bytes'] * 100:.0f} %"
        )
        print(
            f"| [{name}]({folder}/audit-{name}.txt) | {peak:,} | {alloc:,} | {pct(alloc, peak)} | {reserved:,} | "
            f"{total:,} | {pct(total, reserved)} | {share} |"
        )


def ranks(names: list[str]) -> None:
    head(
        "case",
        "measured rank 0 peak",
        "estimate: allocator peak + cuBLAS",
        "error",
        "weights (shard)",
        "gathered weights",
    )
    for name, doc, folder in measured("rank", names, 6):
        row = doc["row"]
        est = estimate(f"rank-{name}")["distributed"]["per_rank"][0]
        alloc = est["allocator_peak_bytes"] + CUBLAS
        same = "" if est["weights_bytes"] == row["weights_bytes"] else f" (estimate {est['weights_bytes']:,})"
        print(
            f"| [{name}]({folder}/rank-{name}.txt) | {row['step_peak_bytes']:,} | {alloc:,} | "
            f"{pct(alloc, row['step_peak_bytes'])} | {row['weights_bytes']:,}{same} | {row['gathered_weight_bytes']:,} |"
        )


def gaps() -> None:
    """The three peaks of 2026-11-22 that were 8-11 % low: the H100's highest point (the op probe's, equal to
    that day's ``max_memory_allocated``), the estimate then (that day's table) and now."""
    before = {"llama-1b-shape": 2_320_900_684, "tiny-gemma2": 166_812_910, "tiny-gemma3": 134_046_638}
    probes = {
        "llama-1b-shape": ("ops-llama-1b-s1024-b2-ckpt.txt", "batch 2 x 1,024, checkpointing"),
        "tiny-gemma2": ("ops-tiny-gemma2-s640-b2.txt", "batch 2 x 640, eager"),
        "tiny-gemma3": ("ops-tiny-gemma3-s640-b2.txt", "batch 2 x 640, sliding window"),
    }
    print(
        "| case | H100 highest point (op) | hidden in that op | estimate before | error | estimate now | error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model, (probe, what) in probes.items():
        lines = (HERE / RUNS[0] / probe).read_text().splitlines()
        line = next(x for x in lines if x.startswith("ops probed"))
        measured = int(line.split("highest point ")[1].split(" B")[0].replace(",", ""))
        op = line.rsplit(" ", 1)[1]
        hidden = (
            next(x for x in lines if x.startswith("at the highest point")).split("hidden ")[1].split(" (")[0]
        )
        now = estimate(f"gap-{model}")["estimate"]["allocator_peak_bytes"] + CUBLAS
        print(
            f"| [{model}, {what}]({RUNS[0]}/{probe}) | {measured:,} (`{op}`) | {hidden} | {before[model]:,} | "
            f"{pct(before[model], measured)} | {now:,} | {pct(now, measured)} |"
        )


if __name__ == "__main__":
    print("### The peaks that were low on 2026-11-22\n")
    gaps()
    print("\n### Cases the rule was not derived on\n")
    audits(
        [
            "llama-1b-s2048-b1-ckpt",
            "tiny-llama-eager-s512-b2",
            "tiny-qwen3-s512-b4",
            "tiny-gemma2-s1024-b1-ckpt",
        ]
    )
    print("\n### Per rank (fake process group, rank 0)\n")
    ranks(
        [f"llama-3.1-8b-{e}-n{n}" for e in ("fsdp2", "fsdp1") for n in (2, 4, 8)]
        + [f"mistral-7b-v0.3-fsdp2-n{n}" for n in (2, 4, 8)]
        + ["mistral-7b-v0.3-fsdp1-n2"]
    )
    print("\n### Configured runs\n")
    audits(
        [
            "plain-1b",
            "packing-padding-free-1b",
            "liger-1b",
            "dora-1b",
            "paged-adamw-8bit-1b",
            "moe-tiny-mixtral",
            "moe-tiny-qwen3-moe",
            "moe-tiny-olmoe",
            "olmoe-1b-7b-shape-s1024-b1",
        ]
    )
