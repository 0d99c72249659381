"""One rank of a 2-process Trainer run with VramGuardCallback (tests/test_integrations_distributed.py): transformers'
Trainer on the host, which accelerate runs as a multi-CPU (gloo) job from the torchrun environment variables the
test sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Argument: the report path."""

from __future__ import annotations

import sys

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from vramguard.integrations.transformers import VramGuardCallback
from vramguard.workload.models import QLoRAConfig, build_qlora


def main(report: str, out: str) -> None:
    torch.set_num_threads(1)
    model = build_qlora(QLoRAConfig(model="tiny-llama", seq_len=64, batch=2)).model
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    cb = VramGuardCallback(report_path=report, table=False)
    args = TrainingArguments(
        out, max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no"
    )
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
