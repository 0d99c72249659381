"""Axolotl and LLaMA-Factory training configs, translated to the ``trl sft`` keys of the same run.

Neither framework is installed (their pins conflict with vramguard's): their keys that change memory are
mapped onto TRL's (:data:`AXOLOTL` / :data:`LLAMA_FACTORY`), the keys that change no byte are named as such,
and every other key set is named NOT PRICED, never an error. What the framework's own code changes (its monkey
patches, its trainer subclass, its own packing) is not run: one line says so. Keys the file does not set get the
framework's default where it differs from TRL's and changes memory (gradient checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Translation = tuple[dict[str, Any], dict[str, str], list[tuple[str, Any, str]]]


@dataclass(frozen=True)
class Framework:
    """One framework's key map (its key -> TRL's), keys that change no byte, and what is not priced of it."""

    name: str
    keys: dict[str, str]
    no_byte: frozenset[str]
    defaults: dict[str, Any]
    own_code: str


AXOLOTL = Framework(
    "axolotl",
    {
        "base_model": "model_name_or_path",
        "load_in_4bit": "load_in_4bit",
        "load_in_8bit": "load_in_8bit",
        "lora_r": "lora_r",
        "lora_alpha": "lora_alpha",
        "lora_dropout": "lora_dropout",
        "lora_target_modules": "lora_target_modules",
        "sequence_len": "max_length",
        "micro_batch_size": "per_device_train_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "sample_packing": "packing",
        "gradient_checkpointing": "gradient_checkpointing",
        "optimizer": "optim",
        "fp16": "fp16",
    },
    frozenset(
        "model_type tokenizer_type strict datasets dataset_prepared_path val_set_size output_dir lora_model_dir "
        "pad_to_sequence_len lora_fan_in_fan_out wandb_project wandb_entity wandb_watch wandb_name wandb_log_model "
        "num_epochs lr_scheduler learning_rate train_on_inputs group_by_length tf32 early_stopping_patience "
        "resume_from_checkpoint local_rank logging_steps warmup_steps evals_per_epoch eval_table_size "
        "saves_per_epoch debug weight_decay special_tokens xformers_attention chat_template seed".split()
    ),
    {"gradient_checkpointing": False},
    "axolotl's own code is not run: its monkey patches (multipack sample packing, its flash-attention and "
    "loss patches) and its AxolotlTrainer subclass; priced as trl sft runs the translated keys",
)

LLAMA_FACTORY = Framework(
    "LLaMA-Factory",
    {
        "model_name_or_path": "model_name_or_path",
        "lora_rank": "lora_r",
        "lora_alpha": "lora_alpha",
        "lora_dropout": "lora_dropout",
        "cutoff_len": "max_length",
        "per_device_train_batch_size": "per_device_train_batch_size",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "packing": "packing",
        "fp16": "fp16",
        "optim": "optim",
    },
    frozenset(
        "quantization_method do_train dataset template max_samples overwrite_cache preprocessing_num_workers "
        "output_dir logging_steps save_steps plot_loss overwrite_output_dir learning_rate num_train_epochs "
        "lr_scheduler_type warmup_ratio ddp_timeout val_size per_device_eval_batch_size eval_strategy "
        "eval_steps report_to seed trust_remote_code dataset_dir stage".split()
    ),
    {"gradient_checkpointing": True},  # LLaMA-Factory checkpoints unless disable_gradient_checkpointing
    "LLaMA-Factory's own code is not run: its model patches and its CustomSeq2SeqTrainer subclass; priced as "
    "trl sft runs the translated keys",
)


SHARDING = {
    key: "a sharded or ZeRO run is not read from the file: one device's step is priced; for sharded ranks pass "
    "--world-size N --sharding fsdp2|fsdp1|zero3"
    for key in ("deepspeed", "fsdp", "fsdp_config")
}


def detect(data: dict[str, Any]) -> Framework | None:
    """The framework whose config ``data`` is (by keys only it has), or None for a TRL / Trainer file."""
    if data.keys() & {"base_model", "micro_batch_size", "sequence_len", "adapter", "sample_packing"}:
        return AXOLOTL
    if data.keys() & {"finetuning_type", "cutoff_len", "quantization_bit", "lora_rank", "lora_target"}:
        return LLAMA_FACTORY
    return None


OWN_CHECKPOINTING = ("unsloth", "offload")
"""Axolotl's ``gradient_checkpointing`` values for its own checkpointing (Unsloth's, or with the checkpoints
offloaded to the host): checkpointed, plus a host offload vramguard does not price."""


def translate(framework: Framework, data: dict[str, Any]) -> Translation:
    """(the TRL keys of the run, TRL key -> the file's key, the file's keys read otherwise as (key, value,
    reading) with reading "no-byte" or a why for NOT PRICED)."""
    trl: dict[str, Any] = {}
    names: dict[str, str] = {}
    other: list[tuple[str, Any, str]] = []

    def put(trl_key: str, value: Any, key: str) -> None:
        trl[trl_key] = value
        names[trl_key] = key

    for key, value in data.items():
        if value is None:
            continue  # an empty key is the framework's default
        if key in SHARDING or (key == "stage" and value != "sft"):
            other.append((key, value, SHARDING.get(key, "only the sft stage is priced (trl sft's step)")))
        elif key == "gradient_checkpointing" and isinstance(value, str) and value.lower() in OWN_CHECKPOINTING:
            put("gradient_checkpointing", True, key)  # checkpointed all the same; its own offload is not priced
            other.append((key, value, f"{framework.name}'s own {value!r} checkpointing: priced as plain checkpointing"))
        elif key in framework.keys:
            put(framework.keys[key], value, key)
        elif key in framework.no_byte:
            other.append((key, value, "no-byte"))
        elif not _special(framework, key, value, put):
            other.append((key, value, f"not a key vramguard translates from {framework.name}: not read"))
    for trl_key, value in framework.defaults.items():
        trl.setdefault(trl_key, value)
    if trl.get("load_in_4bit") or trl.get("load_in_8bit"):
        trl.setdefault("use_peft", True)
    return trl, names, other


def _special(framework: Framework, key: str, value: Any, put: Any) -> bool:
    """Keys whose value maps onto another TRL key's value; False for a key neither framework has."""
    if key == "adapter" and value in ("lora", "qlora"):
        put("use_peft", True, key)
        if value == "qlora":
            put("load_in_4bit", True, key)
    elif key == "lora_target_linear":
        if value:
            put("lora_target_modules", "all-linear", key)
    elif key == "bf16":
        put("bf16", value in (True, "auto", "true"), key)
        if value in (True, "auto", "true"):
            put("dtype", "bfloat16", key)  # both frameworks load the model in the precision they train in
    elif key == "flash_attention" or key == "flash_attn":
        attn = {True: "flash_attention_2", "fa2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
        put("attn_implementation", attn.get(value, "sdpa"), key)
    elif key == "quantization_bit":
        put("load_in_4bit" if value == 4 else "load_in_8bit", True, key)
    elif key == "finetuning_type":
        put("use_peft", value == "lora", key)
    elif key == "lora_target":
        put("lora_target_modules", "all-linear" if value == "all" else value, key)
    elif key == "disable_gradient_checkpointing":
        put("gradient_checkpointing", not value, key)
    else:
        return False
    return True

