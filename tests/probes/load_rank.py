"""One rank loading the FSDP + QLoRA recipe's 4-bit model with ``from_pretrained`` inside a 2-rank gloo group, with
accelerate's FSDP environment (``ACCELERATE_USE_FSDP``) and ``FSDP_CPU_RAM_EFFICIENT_LOADING`` on or off, as
Trainer sets them (tests/test_integrations_distributed.py). Prints one JSON line: the host bytes the storage
tracker saw at the peak of the load and after it. Arguments: RANK FOLDER EFFICIENT(0|1); rank 0 writes the random
checkpoint to FOLDER/ckpt before the group forms."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from vramguard.measure.tracker import StorageTracker
from vramguard.workload.models import (
    ModelSpec,
    QLoRAConfig,
    bnb_4bit_config,
    parse_dtype,
    resolve_attention,
)


def main(rank: int, folder: str, efficient: bool) -> None:
    config = QLoRAConfig()
    hf_config, model_class, attn, _ = resolve_attention(config, ModelSpec.load(config.model))
    checkpoint = os.path.join(folder, "ckpt")
    if rank == 0:
        torch.manual_seed(0)
        model_class(hf_config).save_pretrained(checkpoint)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2
    )
    try:
        dist.barrier()  # the checkpoint is written
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true" if efficient else "false"
        os.environ["LOCAL_RANK"] = str(rank)
        tracker = StorageTracker("cpu")
        tracker.start()
        try:
            model = model_class.from_pretrained(
                checkpoint,
                quantization_config=bnb_4bit_config(config, sharded=True),
                dtype=parse_dtype(config.compute_dtype),
                attn_implementation=attn,
            )
        finally:
            tracker.stop()
        meta = sum(p.is_meta for p in model.parameters())
        print(
            json.dumps({"rank": rank, "peak": tracker.peak(), "after": tracker.current(), "meta": meta}),
            flush=True,
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")
