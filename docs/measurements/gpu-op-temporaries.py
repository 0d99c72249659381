"""Which ops allocate on CUDA more than their outputs (issue 26, item 1): the step's peak op and its temporaries.

A dispatch-level tracker (vramguard's meta run) sees each op's outputs, not the blocks a kernel allocates and
frees inside itself. This runs one QLoRA step on CUDA under a dispatch mode that reads the allocator around
every op: ``before`` and ``after`` (``memory_allocated``) and the highest point inside it (the peak statistic,
reset before the op). ``hidden = peak - max(before, after)``: bytes the op held only while it ran. It prints
the op where the step's highest point fell, with its hidden bytes, and the ops with the most hidden bytes.
Step 0 runs first without the mode (cuBLAS workspaces, optimizer state), step 2 after it without the mode,
to show that the probed step peaks where an unprobed one does.

usage: python docs/measurements/gpu-op-temporaries.py MODEL SEQ BATCH [--gradient-checkpointing]
       [--attn-implementation eager|sdpa] [--device cpu]   (cpu: a dry run of the script, nothing measured)
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramguard.measure.tracker import MemoryTracker
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.training import make_optimizer, train_step

MIB = 1 << 20


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _shapes(obj: Any) -> list[tuple[str, tuple[int, ...]]]:
    items = obj if isinstance(obj, (tuple, list)) else [obj]
    return [
        (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in items if isinstance(t, torch.Tensor)
    ]


class OpTemporaries(TorchDispatchMode):
    """Reads the CUDA allocator around every op (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self.main = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        peak = torch.cuda.max_memory_allocated()
        after = torch.cuda.memory_allocated()
        self.rows.append(
            {
                "i": len(self.rows),
                "op": str(func),
                "thread": "main" if threading.get_ident() == self.main else "autograd",
                "before": before,
                "after": after,
                "peak": peak,
                "hidden": peak - max(before, after),
                "out": _shapes(out),
                "in": _shapes(list(args))[:3],
            }
        )
        return out


def main() -> None:
    model, seq, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = _arg("--device", "cuda")
    config = QLoRAConfig(
        model=model,
        seq_len=seq,
        batch=batch,
        device=device,
        gradient_checkpointing="--gradient-checkpointing" in sys.argv,
        attn_implementation=_arg("--attn-implementation", "sdpa"),
    )
    print(config)
    q = build_qlora(config)
    opt = make_optimizer(q)
    if device == "cpu":  # dry run: the script's own code paths, no allocator to read
        torch.cuda.memory_allocated = lambda: 0  # type: ignore[assignment]
        torch.cuda.max_memory_allocated = lambda: 0  # type: ignore[assignment]
        torch.cuda.reset_peak_memory_stats = lambda: None  # type: ignore[assignment]
    with MemoryTracker(device) as tracker:
        train_step(q, opt, tracker, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        probe = OpTemporaries()
        with probe:
            train_step(q, opt, tracker, 1)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train_step(q, opt, tracker, 2)
        if device == "cuda":
            torch.cuda.synchronize()
        unprobed = torch.cuda.max_memory_allocated()
    rows = probe.rows
    top = max(rows, key=lambda r: r["peak"])
    print(f"ops probed: {len(rows)}; step 1's highest point {top['peak']:,} B at op #{top['i']} {top['op']}")
    print(
        f"step 2 without the probe: max_memory_allocated {unprobed:,} B (allocated at its start {base:,} B)"
    )
    print(f"at the highest point: hidden {top['hidden']:,} B ({top['hidden'] / MIB:.2f} MiB) inside that op;")
    print(f"  its outputs {top['out']}, inputs {top['in']}, thread {top['thread']}")
    print("the 12 ops before it and the 3 after (i, op, thread, before, after, peak, hidden MiB, outputs):")
    for r in rows[max(0, top["i"] - 12) : top["i"] + 4]:
        print(
            f"  #{r['i']} {r['op']} {r['thread']} {r['before']:,} {r['after']:,} {r['peak']:,} "
            f"{r['hidden'] / MIB:.2f} {r['out']}"
        )
    by_op: dict[str, list[int]] = collections.defaultdict(list)
    for r in rows:
        if r["hidden"] > 0:
            by_op[r["op"]].append(r["hidden"])
    print("ops with hidden bytes (op: calls, max, sum), largest first:")
    for op, hs in sorted(by_op.items(), key=lambda kv: -max(kv[1]))[:20]:
        print(f"  {op}: {len(hs)} calls, max {max(hs):,} B, sum {sum(hs):,} B")
    print("the 15 single calls with the most hidden bytes:")
    for r in sorted(rows, key=lambda r: -r["hidden"])[:15]:
        print(f"  #{r['i']} {r['op']} {r['thread']} hidden {r['hidden']:,} B out {r['out']} in {r['in']}")


if __name__ == "__main__":
    main()
