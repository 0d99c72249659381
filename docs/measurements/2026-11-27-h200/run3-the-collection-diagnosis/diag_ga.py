"""Run 3's probe (issue 26, 2026-11-27): in one process on CUDA, vramguard's loop audit of tiny-llama (batch 1 x 32)
with 1 and 2 micro-batches in several orders, a garbage collection before each; prints the allocator's bytes before
and after each audit and its phase peaks (absolute, and above the phase's start)."""
import gc, torch
from vramguard.audit.run import run_audit
from vramguard.workload.models import QLoRAConfig
def show(tag, k):
    gc.collect(); torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    r = run_audit(QLoRAConfig(seq_len=32, batch=1, device="cuda", gradient_accumulation_steps=k), steps=2)
    gc.collect(); torch.cuda.synchronize()
    print(tag, "k", k, "before", before, "after", torch.cuda.memory_allocated(),
          {n: (p.peak_bytes, getattr(p, "peak_above_start", None)) for n, p in r.phases.items()}, flush=True)
for i, k in enumerate([1, 2, 1, 2, 2, 1]):
    show(i, k)
