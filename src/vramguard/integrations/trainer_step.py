"""The real ``Trainer`` / TRL ``SFTTrainer`` built for one QLoRA config: shared by the audit through the trainer on
a device (:mod:`vramguard.integrations.trainer_audit`) and the estimate of that trainer's step on meta
(:mod:`vramguard.estimate.trainer`).

``Trainer`` is handed the model the QLoRA recipe prepares by hand (k-bit preparation, then PEFT's LoRA), as a
user of plain ``Trainer`` does. ``SFTTrainer`` is handed the 4-bit model as loaded and the ``LoraConfig``
(``peft_config``), as ``trl sft`` hands them: its own ``__init__`` then wraps it with PEFT, enables input
gradients and casts the adapters of a quantized model to bf16, and it never calls
``prepare_model_for_kbit_training`` (norms and the residual stream stay in the compute dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vramguard.errors import UsageError, first_line
from vramguard.workload.models import QLoRAConfig, QLoRAModel, lora_config, lora_refused, refuse_tuple_routers
from vramguard.workload.run_config import TRL_OPTIMIZER_OF
from vramguard.workload.training import optimizer_on

TRAINERS = ("loop", "trainer", "sft")


def trainer_prepares(trainer: str) -> bool:
    """Whether ``trainer`` prepares the 4-bit model itself (gets it unprepared, with a ``peft_config``)."""
    return trainer == "sft"


def dataset(rows: list[list[int]], labels: bool) -> Any:
    """An in-memory dataset of token rows (with ``labels`` equal to them for plain Trainer)."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # SFTTrainer's dataset preparation draws bars on stderr
    return Dataset.from_dict({"input_ids": rows, **({"labels": rows} if labels else {})})


def loop_rows(q: QLoRAModel, micro_batches: int) -> list[list[int]]:
    """The token rows of the loop's first ``micro_batches`` batches (:meth:`QLoRAModel.batch`), in order, on the
    host: the same rows whatever device the model is on."""
    host = QLoRAModel(model=q.model, spec=q.spec, config=_on_cpu(q.config))
    return torch.cat([QLoRAModel.batch(host, k)["input_ids"].cpu() for k in range(micro_batches)]).tolist()


def _on_cpu(config: QLoRAConfig) -> QLoRAConfig:
    return dataclasses.replace(config, device="cpu", padding_free=False)


def tokenizer(vocab_size: int) -> Any:
    """The tokenizer SFTTrainer requires, built offline: a word-level vocabulary over the model's token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", eos_token="t1", unk_token="t0")


def trainer_arguments(
    config: QLoRAConfig, steps: int, trainer: str, output_dir: str | Path, use_cpu: bool, offload: bool
) -> Any:
    """``TrainingArguments`` / ``SFTConfig`` of the run: the config's batch, accumulation, checkpointing
    (non-reentrant), mixed precision, optimizer (as the loop runs it on the config's device) and, for
    SFTTrainer, ``max_length``, packing and padding-free batches; the trainer's defaults for the rest."""
    common: dict[str, Any] = {
        "max_steps": steps,
        "per_device_train_batch_size": config.batch,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "use_cpu": use_cpu,
        "train_sampling_strategy": "sequential",
        "gradient_checkpointing": config.gradient_checkpointing,
        "bf16": config.mixed_precision == "bf16",
        "fp16": config.mixed_precision == "fp16",
        # the config's optimizer as the loop runs it on this device, not Trainer's default (adamw_torch_fused)
        "optim": TRL_OPTIMIZER_OF[optimizer_on(config.optimizer, config.device)],
    }
    if config.gradient_checkpointing:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    from transformers import TrainingArguments

    if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        for old in ("gradient_checkpointing", "gradient_checkpointing_kwargs"):  # transformers 5.24's names
            if old in common:
                common[old.replace("gradient", "activation")] = common.pop(old)
    if trainer == "trainer":
        return TrainingArguments(str(output_dir), **common)
    try:
        from trl import SFTConfig
    except ImportError:
        raise UsageError("--trainer sft needs TRL: pip install 'vramguard[trl]'") from None
    if offload:  # (only then: SFTConfig has the field from TRL 0.16 on)
        common["activation_offloading"] = True
    if config.padding_free:  # bfd packing implies padding-free batches (SFTTrainer's rule); else plain rows
        common["padding_free"] = True
        common["packing"] = config.packing
    if config.use_liger_kernel:
        common["use_liger_kernel"] = True
    return SFTConfig(str(output_dir), max_length=config.seq_len, **common)


def _raised_by(exc: BaseException, package: str) -> bool:
    """Whether ``exc`` was raised in ``package``'s code (the innermost frame of its traceback)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] == package


def sft_inputs(q: QLoRAModel, micro_batches: int) -> tuple[Any, Any, Any]:
    """(the dataset, the processing class, the ``LoraConfig``) SFTTrainer takes for ``q``'s first
    ``micro_batches`` batches: the loop's token rows and the word-level tokenizer; for a vision-language model
    its vision dataset and processor (:mod:`vramguard.workload.vision_sft`) and its tower's LoRA choices."""
    vision = getattr(q, "vision", None)
    if vision is None:
        rows = loop_rows(q, micro_batches)
        return dataset(rows, False), tokenizer(int(q.spec.fields["vocab_size"])), lora_config(q.config)
    from vramguard.workload.vision_sft import sft_data

    data, processor = sft_data(q, micro_batches * q.config.batch)
    return data, processor, lora_config(q.config, vision.choices)


def make_trainer(q: QLoRAModel, trainer: str, args: Any, micro_batches: int, callbacks: list[Any]) -> Any:
    """The ``trainer`` ("trainer" or "sft") over ``q``'s model and its first ``micro_batches`` batches, its
    printer callback removed (the audit prints its own tables). SFTTrainer gets the model unprepared and the
    config's ``LoraConfig`` when :func:`trainer_prepares` (see the module), and a vision-language model's own
    data (:func:`sft_inputs`)."""
    if trainer not in ("trainer", "sft"):
        raise UsageError(f"--trainer must be one of {', '.join(TRAINERS)}, got {trainer!r}")
    if trainer == "trainer":
        from transformers import Trainer

        rows = loop_rows(q, micro_batches)
        runner = Trainer(model=q.model, args=args, train_dataset=dataset(rows, True), callbacks=callbacks)
    else:
        from trl import SFTTrainer

        data, processing_class, peft_config = sft_inputs(q, micro_batches)

        with warnings.catch_warnings():  # PEFT's wrapping asks the model by transformers 5.23's old name
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            try:
                runner = SFTTrainer(
                    model=q.model,
                    args=args,
                    train_dataset=data,
                    processing_class=processing_class,
                    callbacks=callbacks,
                    peft_config=peft_config if trainer_prepares(trainer) else None,
                )
            except ValueError as exc:  # as vramguard.workload.models.with_lora says it for the loop
                if _raised_by(exc, "trl"):  # its own checks of the config, which the user's run meets the same
                    why = first_line(exc)
                    raise UsageError(f"TRL's SFTTrainer refuses this config, as `trl sft` would: {why}") from None
                if not _raised_by(exc, "peft"):
                    raise
                raise lora_refused(exc, q.model) from None
        refuse_tuple_routers(runner.model)
        if getattr(q, "vision", None) is not None:
            from vramguard.workload.vision_sft import check_prepared

            check_prepared(runner, q.config.seq_len)
    from transformers.trainer_callback import PrinterCallback

    runner.remove_callback(PrinterCallback)
    return runner


@contextlib.contextmanager
def fails_as_the_users_run(q: QLoRAModel, trainer: str) -> Iterator[None]:
    """An AttributeError or TypeError raised inside TRL's or transformers' trainer code while it trains ``q``
    (TRL 1.16's MoE auxiliary loss reads ``config.num_experts``, which Granite 4's config names otherwise) is the
    library's limit, hit by the user's own run the same way: one line naming it and the workaround."""
    try:
        yield
    except (AttributeError, TypeError) as exc:
        if not (_raised_by(exc, "trl") or _raised_by(exc, "transformers")):
            raise
        kind = getattr(q.spec, "model_type", None) or q.spec.name
        hint = "; --trainer loop runs vramguard's loop instead"
        if "num_experts" in str(exc):
            hint = " (its MoE auxiliary loss; router_aux_loss_coef: 0.0 in the YAML turns that off)" + hint
        raise UsageError(
            f"the {trainer} trainer's own step fails on this {kind} model, as a `trl sft` run of it would: "
            f"{type(exc).__name__}: {first_line(exc)}{hint}"
        ) from None
