"""Which CUDA blocks are still allocated at the end of an audit's steps, grouped by the Python frames that
allocated them, for the HF blog's LLaMA-13B rows (docs/measurements/2026-11-27-h200-blog13b/): the audit's
retained bytes there were 28-125 MB above the estimate's (weights + LoRA + AdamW state + cuBLAS), where the
headline shapes agree to 0.013 %. CUDA memory history is recorded from before the build, so what the build left
allocated shows too. usage: python docs/measurements/gpu-retained-13b.py [vramguard audit options]
"""

from __future__ import annotations

import collections
import pathlib
import sys

import torch

import vramguard.audit.run as audit_run
from vramguard.cli import main

original = audit_run.run_steps


def where(frames: list[dict]) -> str:
    keep = [f for f in frames if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    return " < ".join(f"{pathlib.Path(f['filename']).name}:{f['line']} {f['name']}" for f in keep[:5]) or "?"


def run_steps(*args, **kwargs):
    out = original(*args, **kwargs)
    if not torch.cuda.is_available():
        return out
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                groups[where(b.get("frames") or [])].append(b.get("requested_size") or b["size"])
    total = sum(sum(v) for v in groups.values())
    print(f"== blocks allocated after the steps: {total:,} B requested (memory_allocated "
          f"{torch.cuda.memory_allocated():,} B)", file=sys.stderr)
    for k, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:40]:
        print(f"  {sum(sizes):>14,} B in {len(sizes):>5} blocks (largest {max(sizes):,})  {k}", file=sys.stderr)
    return out


audit_run.run_steps = run_steps
if torch.cuda.is_available():
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
sys.exit(main(["audit", *sys.argv[1:]]))
