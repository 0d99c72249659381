"""vramguard's memory snapshot of a step on CUDA next to PyTorch's own of the same step (issue 26, item 4).

``vramguard audit --device cuda --snapshot`` runs once, in this process, under the CUDA caching allocator's own
history (``torch.cuda.memory._record_memory_history``), so the same steps are recorded twice: by vramguard's
storage tracker (the ops' storages, with categories and module frames) and by the allocator. Both are written as snapshot pickles (gzipped), and
each is replayed here to its highest point: the bytes live there and the largest blocks live there.

usage: python docs/measurements/gpu-snapshot-pair.py OUTDIR MODEL SEQ BATCH [--steps 2]
       [--gradient-checkpointing] [--device cpu]   (cpu: a dry run: only vramguard's snapshot)
"""

from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from vramguard.cli import main as cli_main


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def replay(snap: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """The highest point of ``snap``'s trace of device 0 (blocks alive at the end and not allocated in the
    trace count from the start): bytes live, the event index, and the ``top`` largest live blocks with their
    first frames and category."""
    events = snap["device_traces"][0]
    allocated_in_trace = {e["addr"] for e in events if e["action"] == "alloc"}
    live: dict[int, dict[str, Any]] = {}
    for seg in snap.get("segments", []):
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated" and addr not in allocated_in_trace:
                live[addr] = {
                    "size": b["size"],
                    "frames": b.get("frames", []),
                    "category": "before the trace",
                }
            addr += b["size"]
    # blocks freed in the trace but allocated before it
    for e in events:
        if e["action"] == "free_completed" and e["addr"] not in allocated_in_trace:
            live.setdefault(
                e["addr"], {"size": e["size"], "frames": e.get("frames", []), "category": "before"}
            )
    total = sum(b["size"] for b in live.values())
    peak, at, at_peak = total, -1, dict(live)
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at, at_peak = total, i, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    blocks = sorted(at_peak.values(), key=lambda b: -b["size"])[:top]
    return {
        "peak_bytes": peak,
        "event": at,
        "events": len(events),
        "largest": [
            {
                "size": b["size"],
                "category": b.get("category"),
                "frames": [
                    f"{f.get('filename', '')}:{f.get('line', '')}:{f.get('name', '')}"
                    for f in b.get("frames", [])[:4]
                ],
            }
            for b in blocks
        ],
    }


def main() -> None:
    out, model, seq, batch = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    device = _arg("--device", "cuda")
    out.mkdir(parents=True, exist_ok=True)
    ckpt = "--gradient-checkpointing" in sys.argv
    name = f"{model}-s{seq}-b{batch}{'-ckpt' if ckpt else ''}"
    ours_path = out / f"{name}-vramguard.pickle"
    argv = ["audit", "--model", model, "--seq-len", str(seq), "--batch", str(batch), "--device", device]
    argv += ["--steps", _arg("--steps", "2"), "--quiet", "--snapshot", str(ours_path)]
    argv += ["--json", str(out / f"{name}-audit.json"), *(["--gradient-checkpointing"] if ckpt else [])]
    cuda = device == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    rc = cli_main(argv)  # vramguard audit --snapshot, as a user runs it, under PyTorch's own recorder
    print("vramguard audit rc", rc)
    summary = {"vramguard": replay(pickle.loads(ours_path.read_bytes()))}
    (out / f"{name}-vramguard.pickle.gz").write_bytes(gzip.compress(ours_path.read_bytes()))
    ours_path.unlink()
    if cuda:
        torch.cuda.synchronize()
        theirs = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        (out / f"{name}-torch.pickle.gz").write_bytes(gzip.compress(pickle.dumps(theirs, protocol=4)))
        summary["torch"] = replay(theirs)
        summary["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    for who in ("vramguard", "torch"):
        if who in summary:
            r = summary[who]
            print(f"{name} {who}: peak {r['peak_bytes']:,} B at event {r['event']} of {r['events']}")
            for b in r["largest"]:
                print(f"   {b['size']:>14,} {b['category']} {' < '.join(b['frames'][:2])}")
    print(f"{name} max_memory_allocated {summary.get('max_memory_allocated')}")


if __name__ == "__main__":
    main()
