"""Which device blocks a Trainer step leaves allocated with activation offloading and not without (issue 13):
the same tiny QLoRA Trainer run (tests/test_integrations.py's helpers) plain, with save_on_cpu(pin_memory=True),
and as SFTTrainer with and without TRL's activation_offloading; CUDA memory history recorded through each
train(); afterwards every block still allocated that train() made, grouped by the Python frames that
allocated it. usage: python docs/measurements/gpu-retained-diff.py
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from test_integrations import CONFIG, _sft, _trainer

from vramguard.integrations.transformers import VramGuardCallback
from vramguard.workload.models import build_qlora

tmp = pathlib.Path(tempfile.mkdtemp())
config = dataclasses.replace(CONFIG, device="cuda")


def where(frames: list[dict]) -> str:
    keep = [f for f in frames if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    return " < ".join(f"{pathlib.Path(f['filename']).name}:{f['line']} {f['name']}" for f in keep[:4]) or "?"


def run(label: str, make, wrap) -> None:
    cb = VramGuardCallback(table=False)
    trainer = make(cb)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    with wrap():
        trainer.train()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("frames"):
                groups[where(b["frames"])].append(b["size"])
    before = torch.cuda.memory_allocated()
    torch.empty(1, device="cuda")  # a malloc processes the completed events of record_stream'ed blocks
    pending = before - torch.cuda.memory_allocated()
    steps = cb.report.steps
    print(f"   blocks freed but waiting for a stream event after train(): {pending} B")
    print(
        f"== {label}: retained per step {[s.retained_bytes for s in steps]}, start of step 1 {cb.steps[0].start}"
    )
    for k, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(sizes):>10} B in {len(sizes):>3} blocks  {k}")
    del cb, trainer
    import gc

    gc.collect()


over = {"use_cpu": False}
run(
    "trainer plain",
    lambda cb: _trainer(build_qlora(config), cb, tmp, steps=3, **over),
    contextlib.nullcontext,
)
run(
    "trainer save_on_cpu",
    lambda cb: _trainer(build_qlora(config), cb, tmp, steps=3, **over),
    lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
)
run(
    "trainer plain again",
    lambda cb: _trainer(build_qlora(config), cb, tmp, steps=3, **over),
    contextlib.nullcontext,
)
for offload in (False, True):
    run(
        f"sft activation_offloading={offload}",
        lambda cb, offload=offload: _sft(
            build_qlora(config), cb, tmp, steps=3, activation_offloading=offload, **over
        ),
        contextlib.nullcontext,
    )
