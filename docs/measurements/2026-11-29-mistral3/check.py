"""Checks of the committed runs (run.sh writes them, then runs this):

1. the independent count of the audited step: tiny Mistral 3 built as `vramguard audit` builds it
   (transformers' from_pretrained with a BitsAndBytesConfig, PEFT), its batch of the processor's rows
   (batch 2, seq 128), and the saved bytes of its first forward counted by tests/saved_count.py (torch's
   saved_tensors_hooks and a walk of the autograd graph, no vramguard code) equal the audit's saved bytes;
2. the estimate's JSON (meta, CPU kernels) equals the audit's: totals, phase peaks, each step's peaks and
   retained bytes, the layers and every record (but its device: meta, not cpu), growth.

Run from the repository root, in a venv with torchvision:
    PYTHONPATH=src:tests python docs/measurements/2026-11-29-mistral3/check.py
"""

import json
import sys
from pathlib import Path

from saved_count import independent_saved_bytes

from vramguard.workload.models import QLoRAConfig
from vramguard.workload.vision import build_vision_qlora

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[2] / "fixtures" / "configs" / "vlm" / "tiny-mistral3.json"



def figures(doc: dict) -> dict:
    """What the audit measures and the estimate must give to the byte."""
    return {
        "totals": doc["totals"],
        "phases": {k: v["peak_bytes"] for k, v in doc["phases"].items()},
        "steps": [{k: v for k, v in s.items() if k != "loss"} for s in doc["steps"]],
        "layers": doc["layers"],
        "records": [{k: v for k, v in r.items() if k != "device"} for r in doc["records"]],
        "leak_bytes": doc["leak_bytes"],
    }


for size in ((56, 56), (112, 112)):
    name = f"{size[0]}x{size[1]}"
    q = build_vision_qlora(QLoRAConfig(model=str(MODEL), seq_len=128, batch=2), size)
    independent = independent_saved_bytes(q.q.model, q.q.batch())
    audit = json.loads((HERE / f"audit-{name}.json").read_text())
    estimate = json.loads((HERE / f"estimate-{name}.json").read_text())
    audited = audit["totals"]["saved_bytes"]
    same = figures(audit) == figures(estimate)
    counts = f"independent count {independent:,} B, vramguard audit {audited:,} B"
    print(f"{name}: {counts}, equal: {independent == audited}")
    compared = "totals, phase and step peaks, layers, records"
    print(f"{name}: estimate --target cpu equals the audit ({compared}): {same}")
    if independent != audited or not same:
        sys.exit(1)
