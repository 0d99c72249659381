"""vramguard's ``--snapshot`` of ``vramguard audit --device cuda`` against PyTorch's own snapshot of the same process
(``../gpu-snapshot-pair.py`` wrote both): each replayed to its highest point within the steps, and the largest
blocks live there side by side.

PyTorch's trace starts before the model is built; the steps' window in it begins at the first allocation from
which the sizes of vramguard's first 12 allocations follow in order (its trace holds the sizes asked for, as vramguard's), and
runs to the trace's end. vramguard's clock is its own, so the two are aligned by sizes, not by time.

usage: python compare_snapshots.py SNAPSHOT_DIR NAME...
"""

from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any]:
    return pickle.loads(gzip.decompress(path.read_bytes()))


def _preexisting(snap: dict[str, Any]) -> dict[int, dict[str, Any]]:
    events = snap["device_traces"][0]
    born = {e["addr"] for e in events if e["action"] == "alloc"}
    live: dict[int, dict[str, Any]] = {}
    for seg in snap.get("segments", []):
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated" and addr not in born:
                live[addr] = {"size": b["size"], "category": "before the trace"}
            addr += b["size"]
    for e in events:  # freed in the trace, allocated before it
        if e["action"] == "free_completed" and e["addr"] not in born:
            live.setdefault(e["addr"], {"size": e["size"], "category": "before the trace"})
    return live


def peak(snap: dict[str, Any], start: int = 0) -> tuple[int, int, list[dict[str, Any]]]:
    """(bytes, event index, blocks live) at the trace's highest point at or after event ``start``."""
    events = snap["device_traces"][0]
    live = _preexisting(snap)
    total = sum(b["size"] for b in live.values())
    best, at, blocks = (total, -1, dict(live)) if start == 0 else (-1, -1, {})
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if i >= start and total > best:
            best, at, blocks = total, i, dict(live)
    return best, at, sorted(blocks.values(), key=lambda b: -b["size"])


def window_start(ours: dict[str, Any], theirs: dict[str, Any], k: int = 12) -> int:
    want = [e["size"] for e in ours["device_traces"][0] if e["action"] == "alloc"][:k]
    events = theirs["device_traces"][0]
    allocs = [(i, e["size"]) for i, e in enumerate(events) if e["action"] == "alloc"]
    for j in range(len(allocs)):
        if allocs[j][1] != want[0]:
            continue
        it = iter(s for _, s in allocs[j : j + 3 * k])
        if all(any(s == w for s in it) for w in want):
            return allocs[j][0]
    raise SystemExit("the steps' first allocations were not found in PyTorch's trace")


def main() -> None:
    root = Path(sys.argv[1])
    for name in sys.argv[2:]:
        ours = _load(root / f"{name}-vramguard.pickle.gz")
        theirs = _load(root / f"{name}-torch.pickle.gz")
        start = window_start(ours, theirs)
        p_ours, _, b_ours = peak(ours)
        p_theirs, at, b_theirs = peak(theirs, start)
        print(f"## {name}")
        print(
            f"vramguard --snapshot peak {p_ours:,} B; PyTorch's peak in the steps {p_theirs:,} B (event {at}, "
            f"window from event {start} of {len(theirs['device_traces'][0])}); difference {p_theirs - p_ours:,} B"
        )
        print(
            "largest blocks live at each peak (vramguard: category; PyTorch: size only, its frames are C++):"
        )
        for i in range(12):
            a = b_ours[i] if i < len(b_ours) else {"size": 0}
            b = b_theirs[i] if i < len(b_theirs) else {"size": 0}
            print(f"  {a['size']:>14,} {a.get('category')!s:<18} | {b['size']:>14,}")


if __name__ == "__main__":
    main()
