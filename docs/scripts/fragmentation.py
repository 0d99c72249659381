"""The fragmentation figures of ``vramguard estimate --target cuda``, derived from the committed H100 measurements.

Every step measured on the H100 (docs/measurements/2026-11-22-h100/ and 2026-11-22-h100-offload/): the GPU
benchmark matrix (pytest-benchmark JSON) and every ``vramguard audit --device cuda`` JSON. For each, what the
caching allocator held beyond what was allocated::

    gap   = max_memory_reserved - max_memory_allocated          (reserved never shrinks inside a step)
    peak  = max_memory_allocated - 64 MiB                       (cuBLAS's two workspaces: the estimate adds
                                                                 them apart, its allocator peak has none)
    share = gap / peak                                          (what the estimate multiplies its peak by)

The estimate's figures are taken from the steps whose peak is at least 1 GiB, three kinds apart (without
gradient checkpointing, with it, with activations offloaded to the host): the median share is the expected
figure (the one in the total), the smallest and the largest (rounded outwards to a whole percent) the low
and high bounds.
Below 1 GiB the allocator's fixed granularity (2 MiB segments for blocks up to 1 MiB, 20 MiB segments for
requests of 1-10 MiB, blocks rounded to 512 B and large ones to 2 MiB) is a large part of a gap of a few MiB
to tens of MiB; those steps are listed, not used. ``tests/test_fragmentation.py`` holds
``vramguard.estimate.run``'s constants and docs/estimate.md's table to what this script derives.

    PYTHONPATH=src python docs/scripts/fragmentation.py            # print the table and the figures
    PYTHONPATH=src python docs/scripts/fragmentation.py --page docs/estimate.md   # write both tables there

The second table sets the audited steps' max reserved against their committed meta estimates (allocator peak
+ cuBLAS + the allowance at low / expected / high, from ``vramguard.estimate.run.overheads``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimates import replace_between

ROOT = Path(__file__).resolve().parents[2]
MEASUREMENTS = ROOT / "docs" / "measurements"
MiB = 1 << 20
GiB = 1 << 30
CUBLAS = 64 * MiB
MIN_PEAK = 1 * GiB

BENCH = [  # run 1 measured the same matrix; its memory figures equal run 2's to the byte (compare.txt)
    "2026-11-22-h100/run2-grad-fixes-benchmarks-again-diagnosis/gpu-bench.json",
]
AUDIT_FOLDERS = [  # in the order they ran: a later audit of the same name replaces an earlier one
    "2026-11-22-h100/run3-audits-after-the-attention-fix",
    "2026-11-22-h100/run5-audits-ckpt-dropout-gemma",
    "2026-11-22-h100/run7-gpu-suite-after-merge-trainer-audits",
    "2026-11-22-h100-offload/run8-audits-and-gpu-suite-final",
]


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    checkpointing: bool
    offload: bool
    allocated: int  # max_memory_allocated of the step
    reserved: int  # max_memory_reserved of the step

    @property
    def gap(self) -> int:
        return self.reserved - self.allocated

    @property
    def peak(self) -> int:
        return self.allocated - CUBLAS

    @property
    def share(self) -> float:
        return self.gap / self.peak

    @property
    def used(self) -> bool:
        return self.peak >= MIN_PEAK


@dataclass(frozen=True)
class Figures:
    """One mode's figures: shares of the allocator peak, from ``cases`` measured steps."""

    expected: float
    low: float
    high: float
    cases: int


def link(folder: str) -> str:
    """A run's folder as a link from docs/estimate.md, named by its day's folder and run number."""
    day, run = folder.split("/")
    return f"[{day.removeprefix('2026-11-22-')} {run.split('-')[0]}](measurements/{folder}/)"


def cases(root: Path = MEASUREMENTS) -> list[Case]:
    """Every distinct measured step, benchmarks first, then the audits by name."""
    out: list[Case] = []
    for rel in BENCH:
        for b in json.loads((root / rel).read_text())["benchmarks"]:
            v = b["extra_info"]["vramguard"]
            p = v["params"]
            ckpt = "ckpt" if p["gradient_checkpointing"] else "nockpt"
            name = f"bench {p['model']}-s{p['seq_len']}-{ckpt}-r{p['lora_rank']}, batch {p['batch']}"
            out.append(
                Case(
                    name,
                    link(rel.rsplit("/", 1)[0]),
                    bool(p["gradient_checkpointing"]),
                    False,
                    max(ph["peak_allocated"] for ph in v["phases"].values()),
                    max(ph["peak_reserved"] for ph in v["phases"].values()),
                )
            )
    audits: dict[str, Case] = {}
    for rel in AUDIT_FOLDERS:
        for path in sorted((root / rel).glob("audit-*.json")):
            doc = json.loads(path.read_text())
            phases = doc["phases"].values()
            audits[path.stem] = Case(
                path.stem,
                link(rel),
                bool(doc["config"]["gradient_checkpointing"]),
                path.stem.endswith("-offload"),
                max(ph["peak_bytes"] for ph in phases),
                max(ph["reserved_peak_bytes"] for ph in phases),
            )
    return out + list(audits.values())


def figures(all_cases: list[Case], checkpointing: bool = False, offloading: bool = False) -> Figures:
    """The figures of the used steps of one kind: offloaded ones (all measured without checkpointing), else
    those with or without checkpointing."""
    shares = [
        c.share
        for c in all_cases
        if c.used and c.offload == offloading and (offloading or c.checkpointing == checkpointing)
    ]
    return Figures(
        expected=round(statistics.median(shares), 2),
        low=math.floor(min(shares) * 100) / 100,
        high=math.ceil(max(shares) * 100) / 100,
        cases=len(shares),
    )


def render(all_cases: list[Case]) -> str:
    lines = [
        (
            "| step measured on the H100 | checkpointing / offloading | max allocated | max reserved | "
            "reserved − allocated | share of the allocator peak (allocated − 64 MiB) | used | run |"
        ),
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for c in sorted(all_cases, key=lambda c: (not c.used, c.offload, c.checkpointing, c.peak)):
        kind = "offloaded" if c.offload else "on" if c.checkpointing else "off"
        lines.append(
            f"| {c.name} | {kind} | {c.allocated / GiB:.2f} GiB | "
            f"{c.reserved / GiB:.2f} GiB | {c.gap / MiB:,.1f} MiB | {c.share * 100:.1f} % | "
            f"{'yes' if c.used else 'no: under 1 GiB'} | {c.source} |"
        )
    lines.append("")
    for mode, ckpt, off in (
        ("without gradient checkpointing", False, False),
        ("with gradient checkpointing", True, False),
        ("with activation offloading", False, True),
    ):
        f = figures(all_cases, ckpt, off)
        lines.append(
            f"* {mode}: {f.cases} steps; expected (the median) {f.expected * 100:.0f} %, low {f.low * 100:.0f} %, "
            f"high {f.high * 100:.0f} %"
        )
    return "\n".join(lines)


ESTIMATES = {  # the committed meta estimates of audited steps (docs/measurements/2026-11-22-h100/estimates/)
    "estimate-llama-1b-shape-s1024-b2.json": "audit-llama-1b-s1024-b2",
    "estimate-llama-1b-shape-s1024-b2-dropout.json": "audit-llama-1b-s1024-b2-dropout",
    "estimate-llama-3.1-8b-s1024-b1.json": "audit-llama-8b-s1024-b1",
    "estimate-llama-1b-shape-s1024-b2-ckpt.json": "audit-llama-1b-s1024-b2-ckpt",
    "estimate-tiny-gemma2-s640-b2.json": "audit-tiny-gemma2-s640",
    "estimate-tiny-gemma3-s640-b2.json": "audit-tiny-gemma3-s640",
}


def against_estimates(all_cases: list[Case], root: Path = MEASUREMENTS) -> str:
    """The audited steps' max reserved against their committed estimates' allocator peak + cuBLAS + the
    fragmentation allowance (vramguard's own ``overheads``) at low / expected / high."""
    from vramguard.estimate.run import CUBLAS_WORKSPACE_BYTES, overheads

    by_name = {c.name: c for c in all_cases}
    lines = [
        (
            "| audited step | max reserved, H100 | estimate: allocator peak + cuBLAS | + allowance low / expected / "
            "high | difference at low / expected / high |"
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for file, audit in ESTIMATES.items():
        est = json.loads((root / "2026-11-22-h100" / "estimates" / file).read_text())
        peak = est["estimate"]["allocator_peak_bytes"]
        a = next(
            o for o in overheads(peak, est["config"]["gradient_checkpointing"]) if o.low_bytes is not None
        )
        base = peak + CUBLAS_WORKSPACE_BYTES
        reserved = by_name[audit].reserved
        totals = [base + b for b in (a.low_bytes, a.bytes, a.high_bytes)]
        lines.append(
            f"| {audit} | {reserved / GiB:.3f} GiB | {base / GiB:.3f} GiB | "
            + " / ".join(f"{t / GiB:.3f}" for t in totals)
            + " GiB | "
            + " / ".join(f"{(t / reserved - 1) * 100:+.1f} %" for t in totals)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", type=Path, help="write the table between the page's fragmentation markers")
    args = p.parse_args(argv)
    all_cases = cases()
    table, check = render(all_cases), against_estimates(all_cases)
    if args.page:
        replace_between(args.page, "fragmentation table", table)
        replace_between(args.page, "fragmentation against the estimates", check)
    else:
        print(table + "\n\n" + check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
