"""What is live on CUDA at a QLoRA step's peak, with the allocation's Python frames (issue 15): where the
H100's max_memory_allocated exceeds vramguard estimate's meta peak, name the tensors.

usage: python docs/measurements/gpu-peak.py MODEL SEQ BATCH [--gradient-checkpointing] [--lora-dropout P]
"""

from __future__ import annotations

import sys

import torch

from vramguard.measure.tracker import MemoryTracker
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.training import make_optimizer, train_step

model, seq, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ckpt = "--gradient-checkpointing" in sys.argv
dropout = float(sys.argv[sys.argv.index("--lora-dropout") + 1]) if "--lora-dropout" in sys.argv else 0.0
q = build_qlora(
    QLoRAConfig(
        model=model,
        seq_len=seq,
        batch=batch,
        device="cuda",
        gradient_checkpointing=ckpt,
        lora_dropout=dropout,
    )
)
opt = make_optimizer(q)
with MemoryTracker("cuda") as tracker:
    train_step(q, opt, tracker, 0)  # step 0: the workspaces, the optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    train_step(q, opt, tracker, 1)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
print(model, seq, batch, "ckpt" if ckpt else "", "max_memory_allocated", torch.cuda.max_memory_allocated())
# replay step 1's events: the live set at its highest point
live: dict[int, dict] = {}
base = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
events = snap["device_traces"][0]
for ev in events:  # undo step 1 to get what was live before it
    if ev["action"] == "alloc":
        base -= ev["size"]
    elif ev["action"] == "free_completed":
        base += ev["size"]
total, peak, at_peak, peak_ev = base, base, {}, None
for ev in events:
    if ev["action"] == "alloc":
        live[ev["addr"]] = ev
        total += ev["size"]
        if total > peak:
            peak, at_peak, peak_ev = total, dict(live), ev
    elif ev["action"] == "free_completed":  # blocks from before step 1 count down too
        live.pop(ev["addr"], None)
        total -= ev["size"]
print("peak", peak, "of which step-1 allocations live", sum(e["size"] for e in at_peak.values()))


def where(ev: dict) -> str:
    frames = [f for f in ev.get("frames", []) if f["filename"].endswith(".py")]
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames[:6])


print("allocation that made the peak:", peak_ev["size"] if peak_ev else None, where(peak_ev or {}))
for ev in sorted(at_peak.values(), key=lambda e: -e["size"])[:14]:
    print(f"  {ev['size']:>12,}  {where(ev)}")
