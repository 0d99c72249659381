"""The tables of this folder's README: the H200's figures against `vramguard estimate --target cuda`, against the
H100's of the same cases (2026-11-22, 2026-11-25), and the rise that gradient accumulation measured.

Measured: an audit's CUDA phase peaks (absolute allocator readings: ``max_memory_allocated`` of the steps, weights
and cuBLAS's workspaces in) and reserved peaks; for a rank, the row ``gpu-fake-ranks.py`` wrote (rank 0 under the
fake process group). Estimated: the meta run's allocator peak plus cuBLAS's 64 MiB (both are in
``max_memory_allocated``). Reads the JSON files of this folder and of the two H100 folders only.

usage: python table.py   (from this folder)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RUNS = ("run1-suite-accumulation-headline-ranks", "run2-accumulation-tests-before-the-fix")
CUBLAS = 64 << 20
H100 = {  # the same case measured on the H100: (folder, file)
    "audit-llama-1b-s1024-b2": ("2026-11-22-h100/run3-audits-after-the-attention-fix", "audit-llama-1b-s1024-b2"),
    "audit-llama-3.1-8b-s1024-b1": ("2026-11-22-h100/run3-audits-after-the-attention-fix", "audit-llama-8b-s1024-b1"),
    "audit-plain-1b": ("2026-11-25-h100/run1-suite-probe-ranks-configs", "audit-plain-1b"),
    "rank-llama-3.1-8b-fsdp2-n2-ga1": ("2026-11-25-h100/run1-suite-probe-ranks-configs", "rank-llama-3.1-8b-fsdp2-n2"),
    "rank-llama-3.1-8b-fsdp1-n2-ga1": ("2026-11-25-h100/run1-suite-probe-ranks-configs", "rank-llama-3.1-8b-fsdp1-n2"),
}


def load(path: Path) -> dict[str, Any]:
    """A JSON document, or its ``.json.gz`` beside it (the large ones are kept compressed)."""
    packed = path.with_name(path.name + ".gz")
    return json.loads(gzip.decompress(packed.read_bytes()) if packed.exists() else path.read_text())


def run_of(name: str) -> str:
    """The folder of the run that measured ``name`` (run 2 measured the FSDP1 baseline beside its tests)."""
    return next(run for run in RUNS if any((HERE / run).glob(f"{name}.json*")))


def measured(name: str) -> dict[str, Any]:
    return load(HERE / run_of(name) / f"{name}.json")


def peak(doc: dict[str, Any]) -> int:
    """A document's measured highest point: a rank's step peak, or an audit's highest phase peak."""
    if "row" in doc:
        return doc["row"]["step_peak_bytes"]
    return max(p["peak_bytes"] for p in doc["phases"].values())


def reserved(doc: dict[str, Any]) -> int | None:
    if "row" in doc:
        return None  # the script builds the whole model on the GPU first: its reserved bytes are the build's
    return max(p.get("reserved_peak_bytes") or 0 for p in doc["phases"].values())


def estimated(name: str) -> tuple[int, int | None]:
    """The estimate's allocator peak plus cuBLAS, and (an audit's) total less the CUDA context: what the
    allocator reserves, fragmentation allowance included."""
    doc = load(HERE / "estimates" / f"{name}.json")
    if name.startswith("rank-"):
        return doc["distributed"]["per_rank"][0]["allocator_peak_bytes"] + CUBLAS, None
    est = doc["estimate"]
    context = next(o["bytes"] for o in est["overheads"] if "context" in o["name"].lower())
    return est["allocator_peak_bytes"] + CUBLAS, est["total_bytes"] - context


def pct(a: int, b: int) -> str:
    return f"{(a - b) / b * 100:+.2f} %"


def against_the_estimate(names: list[str]) -> None:
    print(
        "| case | H200 measured peak | H100, same case | estimate: allocator peak + cuBLAS | error "
        "| H200 reserved | estimate total − context | error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        doc = measured(name)
        highest = peak(doc)
        if name in H100:
            folder, file = H100[name]
            other = peak(load(HERE.parent / folder / f"{file}.json"))
            h100 = "the same bytes" if other == highest else f"{other:,}"
        else:
            h100 = "not measured"
        est, total = estimated(name)
        res = reserved(doc)
        held = "- | - | -" if res is None or total is None else f"{res:,} | {total:,} | {pct(total, res)}"
        print(f"| [{name}]({run_of(name)}/{name}.txt) | {highest:,} | {h100} | {est:,} | {pct(est, highest)} | {held} |")


def accumulation(pairs: list[tuple[str, str, str]]) -> None:
    """What a second micro-batch added to each phase's peak, measured and estimated, beside what it should add:
    the gradient of every trainable parameter (held from the first micro-batch on) and the later rows."""
    print("| case | phase | measured rise | estimated rise |")
    print("|---|---|---:|---:|")
    for what, one, two in pairs:
        a, b = measured(one), measured(two)
        phases = (lambda d: d["row"]["phases"]) if "row" in a else (lambda d: {k: v["peak_bytes"] for k, v in d["phases"].items()})
        pa, pb = phases(a), phases(b)
        ea, eb = (HERE / "estimates" / f"{one}.json"), (HERE / "estimates" / f"{two}.json")
        for phase in pa:
            if ea.exists() and eb.exists():
                key = "per_rank" if one.startswith("rank-") else None
                ga = load(ea)["distributed"]["per_rank"][0]["phases"] if key else {k: v["peak_bytes"] for k, v in load(ea)["phases"].items()}
                gb = load(eb)["distributed"]["per_rank"][0]["phases"] if key else {k: v["peak_bytes"] for k, v in load(eb)["phases"].items()}
                est = f"{gb[phase] - ga[phase]:+,}"
            else:
                est = "not estimated (Trainer)"
            print(f"| {what} | {phase} | {pb[phase] - pa[phase]:+,} | {est} |")


if __name__ == "__main__":
    print("### Estimate against the H200\n")
    against_the_estimate(
        [
            "audit-llama-1b-s1024-b2",
            "audit-llama-3.1-8b-s1024-b1",
            "audit-plain-1b",
            "audit-accum-1b",
            "audit-accum-packing-paged-1b",
            "rank-llama-3.1-8b-fsdp2-n2-ga1",
            "rank-llama-3.1-8b-fsdp2-n2-ga2",
            "rank-llama-3.1-8b-fsdp1-n2-ga1",
            "rank-llama-3.1-8b-fsdp1-n2-ga2",
        ]
    )
    print("\n### What a second micro-batch adds\n")
    accumulation(
        [
            ("Trainer, tiny-llama, batch 2 x 128", "audit-trainer-tiny-llama-ga1", "audit-trainer-tiny-llama-ga2"),
            ("vramguard's loop, 1B shape, batch 2 x 1,024", "audit-plain-1b", "audit-accum-1b"),
            ("FSDP2 rank 0 of 2, 8B shape, batch 1 x 2,048", "rank-llama-3.1-8b-fsdp2-n2-ga1", "rank-llama-3.1-8b-fsdp2-n2-ga2"),
            ("FSDP1 rank 0 of 2, 8B shape, batch 1 x 2,048", "rank-llama-3.1-8b-fsdp1-n2-ga1", "rank-llama-3.1-8b-fsdp1-n2-ga2"),
        ]
    )
