"""``vramguard audit --trainer trainer|sft``: the audit through the real ``Trainer`` / TRL ``SFTTrainer``.

The model is the audit's (random weights, 4-bit, LoRA), the batches are the audit loop's (``q.batch(k)``
for step ``k``, served in order from an in-memory dataset), the tokenizer SFTTrainer requires is built
offline (a word-level vocabulary over the model's token ids). Everything else is the trainer's own
defaults (its optimizer, scheduler, gradient clipping, and for SFTTrainer its fused chunked loss), so
the numbers are the ones a user sees in that trainer; :class:`VramGuardCallback` measures them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch

from vramguard.audit import verdict as checks
from vramguard.audit.report import AuditReport
from vramguard.errors import UsageError
from vramguard.integrations.transformers import VramGuardCallback
from vramguard.workload.models import QLoRAConfig, QLoRAModel, build_qlora

TRAINERS = ("loop", "trainer", "sft")


def _dataset(q: QLoRAModel, steps: int, labels: bool) -> Any:
    from datasets import Dataset

    rows = torch.cat([q.batch(k)["input_ids"].cpu() for k in range(steps)]).tolist()
    return Dataset.from_dict({"input_ids": rows, **({"labels": rows} if labels else {})})


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", eos_token="t1", unk_token="t0")


def run_trainer_audit(
    config: QLoRAConfig, steps: int, trainer: str, output_dir: str | Path, offload_activations: bool = False
) -> AuditReport:
    """``steps`` steps of ``trainer`` ("trainer" or "sft") on the audit's model and batches.

    ``offload_activations``: the trainer's own way where it has one (SFTTrainer: ``activation_offloading``,
    TRL's ``OffloadActivations``, which needs an accelerator), else ``save_on_cpu(pin_memory=True)`` around
    ``train()`` (on a machine without CUDA it copies to plain host memory)."""
    if trainer not in ("trainer", "sft"):
        raise UsageError(f"--trainer must be one of {', '.join(TRAINERS)}, got {trainer!r}")
    on_cpu = torch.device(config.device).type == "cpu"
    if offload_activations and trainer == "sft" and on_cpu:
        raise UsageError(
            "--offload-activations with --trainer sft is TRL's OffloadActivations, which needs an accelerator; "
            "on CPU use --trainer trainer (torch's save_on_cpu)"
        )
    q = build_qlora(config)
    common: dict[str, Any] = {
        "max_steps": steps,
        "per_device_train_batch_size": config.batch,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "use_cpu": on_cpu,
        "train_sampling_strategy": "sequential",
        "gradient_checkpointing": config.gradient_checkpointing,
    }
    if config.gradient_checkpointing:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    cb = VramGuardCallback(table=False)
    if trainer == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(str(output_dir), **common)
        runner = Trainer(model=q.model, args=args, train_dataset=_dataset(q, steps, True), callbacks=[cb])
    else:
        try:
            from trl import SFTConfig, SFTTrainer
        except ImportError:
            raise UsageError("--trainer sft needs TRL: pip install 'vramguard[trl]'") from None
        if offload_activations:  # (only then: SFTConfig has the field from TRL 0.16 on)
            common["activation_offloading"] = True
        args = SFTConfig(str(output_dir), max_length=config.seq_len, **common)
        runner = SFTTrainer(
            model=q.model,
            args=args,
            train_dataset=_dataset(q, steps, False),
            processing_class=_tokenizer(int(q.spec.fields["vocab_size"])),
            callbacks=[cb],
        )
    from transformers.trainer_callback import PrinterCallback

    runner.remove_callback(PrinterCallback)  # the audit prints its own tables (stdout stays the report's)
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=True)
        if offload_activations and trainer == "trainer"
        else contextlib.nullcontext()
    )
    with offload:
        runner.train()
    report = cb.report
    assert report is not None
    trainer_config = dict(report.config)
    report.config = {**config.to_dict(), **trainer_config, "trainer": trainer_config["trainer"]}
    report.architecture = {**report.architecture, "attn_implementation": q.attn_implementation}
    # the build's notes (what it changed from the request, which weights are 4-bit, what routing decides), as
    # vramguard audit's own loop reports them: the callback sees the model, not how it was built
    build = checks.notes(checks.BUILD, q.notes)
    report.verdict = dataclasses.replace(report.verdict, findings=[*build, *report.verdict.findings])
    return report
