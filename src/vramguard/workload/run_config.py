"""The user's own training configuration (``--config``): a ``trl sft --config`` YAML or a TrainingArguments
JSON, read into the one typed :class:`~vramguard.workload.models.QLoRAConfig`.

The key set is TRL's, not a copy of it: the file goes through ``HfArgumentParser`` with the dataclasses
``trl sft`` parses with (``ScriptArguments``, ``SFTConfig``, ``ModelConfig``, ``DatasetMixtureConfig``, read
from TRL's own ``make_parser``), so an unknown key or a value TRL refuses (``optim: nonsense``) is the same
error it would be there, one line here. Values the parser does not type-check (it builds the dataclasses
from the dict as given) are checked where they are mapped. Defaults are TRL's: a file that names no
``gradient_checkpointing`` is priced with it on, as ``trl sft`` would run.

Every key the file sets (a value other than TRL's default) is read one of three ways, each listed in the
output (:meth:`RunConfig.lines`), none silently:

* **priced**: it maps onto a :class:`QLoRAConfig` field, which the run then takes;
* **changes no byte**: it decides values, schedules, logging or files, not the memory of a step (the ones
  the run takes, ``lora_alpha``, ``use_rslora``, ``bnb_4bit_quant_type``, are passed to it all the same);
* **not priced**: it changes memory in a way vramguard does not run yet (wrapped packing, ...):
  named with what the figures assume instead.

One environment check of TrainingArguments is not the run's: it refuses ``bf16`` on a machine without a
GPU ("Your setup doesn't support bf16/gpu"). The file is read with ``use_cpu: true`` unless it sets
``use_cpu``, which changes no byte of the step priced; the estimate is for the machine the file is for.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vramguard.errors import UsageError, first_line
from vramguard.workload.framework_configs import detect, translate
from vramguard.workload.models import MAX_CONFIG_BYTES, QLoRAConfig, origin_of, presets, read_at_most

Reading = Literal["priced", "no-byte", "not-priced"]

OPTIMIZERS_OF_TRL: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "paged-adamw-8bit",
}
"""TrainingArguments' ``optim`` names vramguard prices, as :data:`~vramguard.workload.models.OPTIMIZERS`
names: torch's AdamW, fused or with torch's default implementation (the same state; on CUDA the default,
``foreach``, makes a temporary as large as the trainable parameters in the step, the fused kernel none), and
bitsandbytes' 8-bit AdamW, paged or not."""

TRL_OPTIMIZER_OF: dict[str, str] = {
    "adamw": "adamw_torch",
    "adamw-fused": "adamw_torch_fused",
    "adamw-8bit": "adamw_bnb_8bit",
    "paged-adamw-8bit": "paged_adamw_8bit",
}
"""The other way: the ``optim`` name Trainer is given for a vramguard optimizer (``audit --trainer``)."""

NO_BYTE_KEYS: dict[str, str] = {
    "lora_alpha": "scales the adapter's output; passed to PEFT",
    "use_rslora": "scales the adapter's output by alpha / sqrt(r); passed to PEFT",
    "bnb_4bit_quant_type": "nf4 and fp4 are both 4-bit codes of 16 entries; passed to bitsandbytes",
    "lora_task_type": "CAUSAL_LM is what is run",
    "model_revision": "which files, not their shapes",
    "learning_rate": "a value",
    "weight_decay": "a value",
    "adam_beta1": "a value",
    "adam_beta2": "a value",
    "adam_epsilon": "a value",
    "max_grad_norm": "clipping scales gradients in place",
    "seed": "values",
    "data_seed": "values",
    "num_train_epochs": "how many steps, not what one keeps",
    "max_steps": "how many steps, not what one keeps",
    "output_dir": "files",
    "run_name": "a name",
    "report_to": "logging",
    "use_cpu": "read as true unless set, see vramguard.workload.run_config",
    "dataset_name": "which data (the longest batch is priced)",
    "dataset_config": "which data",
    "dataset_train_split": "which data",
    "dataset_test_split": "evaluation data",
    "dataset_streaming": "data loading on the host",
    "datasets": "which data (a mixture; the longest batch is priced)",
    "streaming": "data loading on the host",
    "test_split_size": "evaluation data",
    "ignore_bias_buffers": "DDP's buffer broadcast between processes, not one device's step",
    "dataset_text_field": "which data",
    "dataset_num_proc": "data preparation on the host",
    "dataloader_num_workers": "data loading on the host",
    "chat_template_path": "the text, not its length bound",
    "eos_token": "the text",
    "pad_token": "the text",
    "remove_unused_columns": "which dataset columns the host keeps (a VLM's images column, for its collator)",
    "dataset_kwargs": "dataset preparation on the host (skip_prepare_dataset: the collator tokenizes instead)",
}
"""Keys that decide values, schedules, logging or files but not one byte of a step, with why. Besides these,
every key whose name starts with one of :data:`NO_BYTE_PREFIXES`."""

NO_BYTE_PREFIXES: tuple[str, ...] = (
    "logging_",
    "save_",
    "eval_",
    "hub_",
    "push_to_hub",
    "lr_scheduler_",
    "warmup_",
    "log_",
    "disable_tqdm",
)

PRICED_KEYS: tuple[str, ...] = (
    "model_name_or_path",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "gradient_checkpointing",
    "activation_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs",
    "optim",
    "bf16",  # into mixed_precision (Trainer's autocast), named by the commands
    "fp16",
    "activation_offloading",
    "packing",
    "packing_strategy",
    "padding_free",
    "use_peft",
    "load_in_4bit",
    "use_bnb_nested_quant",
    "lora_r",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "use_dora",
    "attn_implementation",
    "dtype",
    "use_liger_kernel",
)
"""Keys read into :class:`QLoRAConfig` fields (a value outside what the field takes is named, not priced)."""


@dataclass(frozen=True)
class KeyReading:
    """How one key of the file is read: ``priced`` (into ``field``), ``no-byte`` or ``not-priced`` (``why``)."""

    key: str
    value: Any
    reading: Reading
    why: str = ""


@dataclass(frozen=True)
class RunConfig:
    """A training configuration file read into :class:`QLoRAConfig` values (``values``: field -> value, what
    the file decides; the flags override them) and how each key it sets was read (``readings``)."""

    path: Path
    values: dict[str, Any]
    readings: list[KeyReading] = field(default_factory=list)
    model_problem: str | None = None  # why model_name_or_path gives no model (then --model must)
    framework: str = ""  # an Axolotl / LLaMA-Factory file: what of that framework's own code is not priced

    def config(self, **overrides: Any) -> QLoRAConfig:
        """The :class:`QLoRAConfig` of the file, with ``overrides`` (the flags the user gave) on top."""
        values = {**self.values, **overrides}
        if "model" not in values:
            raise UsageError(self.model_problem or f"{self.path} names no model_name_or_path: pass --model")
        config = QLoRAConfig(**values)
        config.validate()
        self._refuse_keep_end(config)
        return config

    def _refuse_keep_end(self, config: QLoRAConfig) -> None:
        """TRL's SFTTrainer refuses ``truncation_mode: keep_end`` for a vision dataset (rows with images)
        while ``max_length`` is set (its default 1024 included): the user's `trl sft` run stops in its
        ``__init__``, so the estimate is one line, not a figure with the key named NOT PRICED."""
        read = {r.key: r.value for r in self.readings}
        keep_end = read.get("truncation_mode") == "keep_end" and read.get("max_length", 0) is not None
        if config.image_size and keep_end:
            raise UsageError(
                f"--config {self.path}: TRL's SFTTrainer refuses truncation_mode keep_end for rows with "
                "images (it may cut their image tokens), as `trl sft` would: write keep_start (the default) "
                "or max_length: null"
            )

    def named(self, reading: Reading) -> list[KeyReading]:
        """The keys read as ``reading``."""
        return [r for r in self.readings if r.reading == reading]

    def lines(self, overridden: frozenset[str] = frozenset()) -> list[str]:
        """One line per reading that has keys: what is priced, what changes no byte, what is not priced and
        what the figures assume instead. ``overridden``: fields a flag set (said in the priced line)."""
        out = []
        priced = self.named("priced")
        if priced:
            out.append(f"config {self.path.name}: priced: " + ", ".join(_show(r) for r in priced))
        same = self.named("no-byte")
        if same:
            out.append(
                f"config {self.path.name}: changes no byte: " + ", ".join(f"{r.key} ({r.why})" for r in same)
            )
        if overridden:
            out.append(f"config {self.path.name}: overridden by flags: {', '.join(sorted(overridden))}")
        if self.framework:
            out.append(f"config {self.path.name}: NOT PRICED: {self.framework}")
        missing = self.named("not-priced")
        if missing:
            out.append(
                f"config {self.path.name}: NOT PRICED: " + "; ".join(f"{_show(r)}: {r.why}" for r in missing)
            )
        return out


def _show(r: KeyReading) -> str:
    return f"{r.key}={json.dumps(r.value, default=str)}"


def read_file(path: Path) -> dict[str, Any]:
    """The mapping a ``--config`` file holds: YAML (``trl sft --config``) or JSON (TrainingArguments); a
    missing, binary, oversized or malformed file, or one that is no mapping, is a one-line UsageError."""
    import yaml

    try:
        raw = read_at_most(path, MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path} is over {MAX_CONFIG_BYTES} bytes: not a training config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not UTF-8 text (a binary file?)") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise UsageError(f"--config {path}: cannot parse it: {first_line(exc)}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UsageError(f"--config {path} must be a mapping of TRL / TrainingArguments keys")
    if _values_past(data, MAX_CONFIG_VALUES):
        raise UsageError(
            f"--config {path} expands to over {MAX_CONFIG_VALUES:,} values (YAML aliases): "
            "not a training config"
        )
    return data


MAX_CONFIG_VALUES = 100_000
"""Values a config may expand to. A YAML alias repeats a whole node, so 500 bytes of nested aliases expand to
10^9 values: read, they share memory, but every copy that prints or converts them (the NOT PRICED line,
TrainingArguments) expands them all (580 MB of stderr for 10^8, found by fuzzing)."""


def _values_past(data: Any, budget: int) -> bool:
    """Whether ``data`` holds more than ``budget`` values, counting each alias's copy; stops at ``budget``."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > budget:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):  # !!pairs and !!omap load as lists of tuples
            stack.extend(node)
    return False


def parse_trl(path: Path, data: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], list[dict[str, Any]]]:
    """(SFTConfig, ModelConfig, the file's values as they parse, the defaults they are held against) of
    ``data``, parsed by TRL's own dataclasses through ``HfArgumentParser``; an unknown key or a value TRL
    refuses is a one-line UsageError.

    Values are compared as the dataclasses write them (``to_dict``: enums by value), against TRL's defaults
    and against TrainingArguments' own (a TrainingArguments dump records every field at its defaults, some of
    which TRL changes, such as ``logging_steps``): a key equal to either is not set by the user."""
    try:
        from transformers import HfArgumentParser, TrainingArguments
        from trl import ModelConfig, SFTConfig
    except ImportError as exc:
        raise UsageError(f"--config needs TRL (pip install 'vramguard[trl]'): {exc}") from None
    data = dict(data)
    data.pop("env", None)  # TrlParser's environment block: named by load_run_config, not a dataclass field
    data.setdefault("use_cpu", True)
    data.setdefault("output_dir", str(Path.cwd()))  # TrainingArguments' only required field; files only
    types = trl_sft_dataclasses()
    fields = {f.name for cls in types for f in dataclasses.fields(cls)}
    required = {cls: _required(cls) for cls in types if cls is not SFTConfig}  # e.g. dataset_name before TRL 0.19
    for names in required.values():
        for name in names:
            data.setdefault(name, None)  # trl sft would read the data; the step's memory does not depend on it
    for key in launch_keys(set(data) - fields):  # trl sft hands these to accelerate launch: not the step's
        del data[key]
    for key in ("accelerator_config", "deepspeed", "fsdp_config"):  # paths transformers opens, or mappings
        if isinstance(data.get(key), (bool, int, float)):  # an int is opened as a file descriptor
            raise UsageError(f"--config {path}: {key} must be a file's path or a mapping, got {data[key]!r}")
    parser = HfArgumentParser(types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. gradient_checkpointing's deprecation in favour of its new name
        try:
            parsed_all = parser.parse_dict(data, allow_extra_keys=False)
            base = {"use_cpu": True, "output_dir": data["output_dir"]}
            trl_defaults: dict[str, Any] = {}
            for cls in types:
                default = cls(**base) if cls is SFTConfig else cls(**dict.fromkeys(required[cls]))
                trl_defaults.update(default.to_dict() if cls is SFTConfig else dataclasses.asdict(default))
            defaults = [trl_defaults, TrainingArguments(**base).to_dict()]
        except (ValueError, TypeError, KeyError, OSError) as exc:  # OSError: a path in it that cannot be read
            raise UsageError(f"--config {path}: {first_line(exc)}") from None
        except ImportError as exc:  # deepspeed: ... without DeepSpeed installed
            missing = first_line(exc)
            raise UsageError(f"--config {path} needs a package that is not installed: {missing}") from None
    sft = next(obj for obj in parsed_all if isinstance(obj, SFTConfig))
    model_args = next(obj for obj in parsed_all if isinstance(obj, ModelConfig))
    parsed: dict[str, Any] = {}
    for obj in parsed_all:
        parsed.update(obj.to_dict() if obj is sft else dataclasses.asdict(obj))
    return sft, model_args, parsed, defaults


TRL_LAUNCH_KEYS: frozenset[str] = frozenset({"accelerate_config"})
"""Keys ``trl sft`` itself reads besides its dataclasses: ``accelerate_config`` names the accelerate config
(one TRL ships, such as ``fsdp2`` or ``zero3``, or a file) it launches the script with."""


def launch_keys(keys: set[str]) -> set[str]:
    """Of ``keys`` (the file's keys that are no field of ``trl sft``'s dataclasses), those ``trl sft`` passes
    to ``accelerate launch`` (``num_processes``, ``mixed_precision``, ``fsdp_*``, ...: the options of
    accelerate's own launch parser) or reads for it (:data:`TRL_LAUNCH_KEYS`). The rest are unknown, as they
    are to ``trl sft``."""
    if not keys:
        return set()
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError:
        return keys & TRL_LAUNCH_KEYS
    options = {action.dest for action in launch_command_parser()._actions} - {"help"}
    return keys & (options | TRL_LAUNCH_KEYS)


def _required(cls: type) -> list[str]:
    """The fields of dataclass ``cls`` that have no default."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def trl_sft_dataclasses() -> tuple[type, ...]:
    """The dataclasses ``trl sft --config`` reads a file into, from TRL's own ``make_parser`` (script
    arguments such as ``dataset_name``, SFTConfig, ModelConfig, the dataset mixture); where the installed TRL
    has no such function, the ones it exports of that set."""
    try:
        from trl.scripts.sft import make_parser

        return tuple(make_parser().dataclass_types)
    except (ImportError, AttributeError, TypeError):
        import trl

        names = ("ScriptArguments", "SFTConfig", "ModelConfig", "DatasetMixtureConfig")
        return tuple(getattr(trl, n) for n in names if hasattr(trl, n))


def _value_of(obj: Any) -> Any:
    """A dataclass value as the file would write it (enums by their value)."""
    return getattr(obj, "value", obj)


def load_run_config(path: str | Path) -> RunConfig:
    """Read ``path`` (a ``trl sft --config`` YAML or a TrainingArguments JSON) into a :class:`RunConfig`."""
    path = Path(path)
    return _run_config(path, read_file(path))


TRL_RUN_OF_METHOD: dict[str, dict[str, bool]] = {
    "qlora": {"use_peft": True, "load_in_4bit": True},
    "lora": {"use_peft": True},
    "full": {},
}
"""The ``trl sft`` keys that choose what is trained, per :data:`~vramguard.workload.models.METHODS` name."""


def trl_sft_defaults(method: str = "qlora") -> dict[str, Any]:
    """The :class:`QLoRAConfig` values of ``trl sft`` run with TRL's defaults for every key but those that choose
    ``method`` (:data:`TRL_RUN_OF_METHOD`): what ``estimate`` with flags alone fills the flags not given with.
    Read from TRL's own dataclasses (:func:`parse_trl`) as a file with those keys alone would be, never typed
    here; no model (TRL has none by default)."""
    if method not in TRL_RUN_OF_METHOD:
        raise UsageError(f"--method must be one of {', '.join(TRL_RUN_OF_METHOD)}, got {method!r}")
    return dict(_run_config(Path("trl-sft-defaults.yaml"), dict(TRL_RUN_OF_METHOD[method])).values)


def _run_config(path: Path, data: dict[str, Any]) -> RunConfig:
    """The :class:`RunConfig` of ``data``, the mapping read from ``path``."""
    framework = detect(data)
    translated: dict[str, str] = {}
    other: list[tuple[str, Any, str]] = []
    if framework is not None:
        data, translated, other = translate(framework, data)
    sft, model_args, parsed, defaults = parse_trl(path, data)
    values: dict[str, Any] = {}
    readings: list[KeyReading] = []
    model_problem = None

    def given(key: str) -> bool:
        if key not in data:
            return False
        value = parsed.get(key, data[key])
        return all(value != d.get(key, object()) for d in defaults)

    def priced(key: str, name: str, value: Any, shown: Any = None) -> None:
        values[name] = value
        if key in data:
            readings.append(KeyReading(key, data[key] if shown is None else shown, "priced", name))

    def no_byte(key: str, name: str, value: Any) -> None:
        """A key passed to the run that changes none of its bytes (the tests check both)."""
        values[name] = value
        if key in data:
            readings.append(KeyReading(key, _value_of(data[key]), "no-byte", NO_BYTE_KEYS[key]))

    def not_priced(key: str, why: str) -> None:
        readings.append(KeyReading(key, _value_of(data.get(key)), "not-priced", why))

    # the model: a preset, a config.json, a local directory with config.json or a Hub id, taken by --model's
    # rule (vramguard.workload.models.origin_of); a relative path is found beside the config file first
    ref = model_args.model_name_or_path
    if ref is not None:
        try:
            candidate = Path(str(ref)).expanduser()
        except RuntimeError as exc:  # ~user that does not exist, or no home directory
            raise UsageError(f"--config {path}: model_name_or_path {ref!r}: {exc}") from None
        if not candidate.is_absolute() and (path.parent / candidate).exists():
            candidate = path.parent / candidate
        origin = origin_of(str(candidate)) if candidate.exists() else origin_of(str(ref))
        if origin == "directory" and (candidate / "config.json").is_file():
            priced("model_name_or_path", "model", str(candidate / "config.json"))
        elif origin == "file" and candidate.is_file():
            priced("model_name_or_path", "model", str(candidate))
        elif origin in ("preset", "hub"):
            priced("model_name_or_path", "model", str(ref))
        else:
            near = difflib.get_close_matches(str(ref).lower(), list(presets()), n=1)
            model_problem = (
                f"--config {path}: model_name_or_path {ref!r} is not a preset, a local directory with a "
                "config.json, a config.json nor a Hugging Face Hub id (org/name)"
                + (f": did you mean {near[0]}?" if near else ": pass --model")
            )

    def integer(key: str, obj: Any, minimum: int = 1) -> int | None:
        value = getattr(obj, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UsageError(f"--config {path}: {key} must be an integer >= {minimum}, got {value!r}")
        return value

    def boolean(key: str, obj: Any) -> bool:
        value = getattr(obj, key)
        if not isinstance(value, bool):
            raise UsageError(f"--config {path}: {key} must be true or false, got {value!r}")
        return value

    priced("per_device_train_batch_size", "batch", integer("per_device_train_batch_size", sft))
    priced(
        "gradient_accumulation_steps",
        "gradient_accumulation_steps",
        integer("gradient_accumulation_steps", sft),
    )
    if sft.max_length is None:
        if "max_length" in data:
            not_priced(
                "max_length", "null (no truncation): the longest row is the data's; priced at --seq-len"
            )
    else:
        priced("max_length", "seq_len", integer("max_length", sft))

    # gradient checkpointing (and its new name): on by default in TRL; non-reentrant is what is run
    checkpointing = boolean("activation_checkpointing", sft)
    for key in ("gradient_checkpointing", "activation_checkpointing"):
        if key in data:
            priced(key, "gradient_checkpointing", checkpointing)
    values["gradient_checkpointing"] = checkpointing
    kwargs = sft.activation_checkpointing_kwargs
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if key not in data:
            continue
        if kwargs is not None and not isinstance(kwargs, dict):
            raise UsageError(f"--config {path}: {key} must be a mapping, got {kwargs!r}")
        if not checkpointing:
            readings.append(KeyReading(key, data[key], "no-byte", "gradient checkpointing is off"))
        elif not kwargs or kwargs == {"use_reentrant": False}:  # None: transformers 5 runs non-reentrant
            readings.append(KeyReading(key, data[key], "priced", "gradient_checkpointing (non-reentrant)"))
        else:
            not_priced(key, "priced as {use_reentrant: false}, the only checkpointing vramguard runs")

    optim = str(_value_of(sft.optim))
    if optim in OPTIMIZERS_OF_TRL:
        priced("optim", "optimizer", OPTIMIZERS_OF_TRL[optim], shown=optim)
    else:
        not_priced("optim", "priced as torch AdamW (fp32 moments)")
    values.setdefault("optimizer", "adamw")

    # Trainer's autocast (TRL's default: bf16): priced; both commands say how in one line
    values["mixed_precision"] = "bf16" if sft.bf16 else "fp16" if sft.fp16 else "no"
    for key in ("bf16", "fp16"):
        if key in data:
            readings.append(KeyReading(key, data[key], "priced", "mixed_precision"))

    priced("activation_offloading", "offload_activations", boolean("activation_offloading", sft))
    # Liger, as transformers' Trainer applies it (the estimate on meta, vramguard.estimate.liger; the audit's loop
    # on CUDA; elsewhere the audit names it not priced: its Triton kernels need a GPU)
    priced("use_liger_kernel", "use_liger_kernel", boolean("use_liger_kernel", sft))

    # packing and padding-free batches, by SFTTrainer's rule: bfd packing (TRL's default strategy) implies
    # padding-free; the padding-free batch is TRL's collator's (vramguard.workload.models.padding_free_batch)
    packing = boolean("packing", sft)
    strategy = str(sft.packing_strategy)
    padding_free = boolean("padding_free", sft) or (packing and strategy in ("bfd", "bfd_split"))
    values["padding_free"] = padding_free
    values["packing"] = packing and padding_free
    if "padding_free" in data:
        priced(
            "padding_free",
            "padding_free",
            padding_free,
            shown=data["padding_free"],
        )
    if packing and padding_free:
        readings.append(
            KeyReading(
                "packing",
                data["packing"],
                "priced",
                f"packing ({strategy}, padding-free: two sequences a row)",
            )
        )
    elif packing:
        not_priced(
            "packing",
            f"packing_strategy {strategy}: rows of max_length with an all-ones attention_mask, priced as plain "
            "rows without the mask",
        )
    if given("packing_strategy"):
        if not packing:
            readings.append(KeyReading("packing_strategy", strategy, "no-byte", "packing is off"))
        elif padding_free:
            readings.append(KeyReading("packing_strategy", strategy, "priced", "padding-free packing"))
        else:
            not_priced("packing_strategy", "wrapped packing is priced as plain rows (see packing)")

    # what is trained: TRL loads 4-bit with use_peft + load_in_4bit, LoRA on the dtype's base with use_peft
    # alone, and trains every parameter without use_peft
    peft = boolean("use_peft", model_args)
    four_bit = boolean("load_in_4bit", model_args)
    method = ("qlora" if four_bit else "lora") if peft else "full"
    for key in ("use_peft", "load_in_4bit"):
        if key in data:
            readings.append(KeyReading(key, data[key], "priced", f"method {method}"))
    values["method"] = method
    if boolean("load_in_8bit", model_args):
        not_priced("load_in_8bit", f"8-bit loading is not run: priced as method {method}")
    if four_bit and not peft:
        not_priced(
            "load_in_4bit", "a 4-bit base without use_peft cannot train (TRL needs adapters): priced as full"
        )

    quant_type = model_args.bnb_4bit_quant_type
    if quant_type not in ("nf4", "fp4"):
        raise UsageError(f"--config {path}: bnb_4bit_quant_type must be nf4 or fp4, got {quant_type!r}")
    no_byte("bnb_4bit_quant_type", "quant_type", quant_type)
    priced("use_bnb_nested_quant", "double_quant", boolean("use_bnb_nested_quant", model_args))
    if model_args.bnb_4bit_quant_storage not in (None, "uint8"):
        not_priced("bnb_4bit_quant_storage", "priced with uint8 storage (what bitsandbytes uses by default)")

    priced("lora_r", "lora_rank", integer("lora_r", model_args))
    alpha = model_args.lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha <= 0:
        raise UsageError(f"--config {path}: lora_alpha must be a positive integer, got {alpha!r}")
    no_byte("lora_alpha", "lora_alpha", alpha)
    dropout = model_args.lora_dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise UsageError(f"--config {path}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    priced("lora_dropout", "lora_dropout", float(dropout))
    no_byte("use_rslora", "use_rslora", boolean("use_rslora", model_args))
    targets = model_args.lora_target_modules
    priced(
        "lora_target_modules", "target_modules", _names(path, "lora_target_modules", targets, "peft-default")
    )
    priced(
        "lora_target_parameters",
        "target_parameters",
        _names(path, "lora_target_parameters", model_args.lora_target_parameters, ""),
    )
    if model_args.lora_modules_to_save:
        not_priced("lora_modules_to_save", "the full copies of these modules PEFT trains are not run")
    if peft:
        priced("use_dora", "use_dora", boolean("use_dora", model_args))
    elif boolean("use_dora", model_args):
        readings.append(KeyReading("use_dora", True, "no-byte", "no adapters without use_peft"))

    attn = model_args.attn_implementation
    if attn in (None, "sdpa", "eager", "flash_attention_2"):  # flash_attention_2: estimate --target cuda only
        if attn is not None:
            priced("attn_implementation", "attn_implementation", attn)
        values.setdefault("attn_implementation", "sdpa")  # what from_pretrained picks by default
    else:
        not_priced("attn_implementation", "priced with sdpa (on --target cuda, the kernel CUDA's sdpa picks)")
        values["attn_implementation"] = "sdpa"

    dtype = str(model_args.dtype)
    names = {
        "bfloat16": "bf16",
        "float16": "fp16",
        "float32": "fp32",
        "bf16": "bf16",
        "fp16": "fp16",
        "fp32": "fp32",
    }
    if dtype in names and method == "full" and "dtype" in data:
        # TRL loads the model in this dtype and AdamW keeps its moments in the parameters' dtype
        priced("dtype", "full_dtype", names[dtype], shown=dtype)
        values["compute_dtype"] = names[dtype]
    elif dtype in names:
        priced("dtype", "compute_dtype", names[dtype], shown=dtype)
    elif dtype == "auto":
        not_priced("dtype", "'auto' takes the checkpoint's dtype: priced as bfloat16")
        values["compute_dtype"] = "bf16"
    else:
        raise UsageError(f"--config {path}: dtype must be bfloat16, float16, float32 or auto, got {dtype!r}")

    # a BitsAndBytesConfig given to from_pretrained through model_init_kwargs (how a YAML keeps a VLM's tower out of
    # 4-bit: llm_int8_skip_modules; TRL refuses it together with load_in_4bit, as SFTTrainer does)
    quantized, init_readings = _init_quantization(path, data, sft.model_init_kwargs, four_bit)
    compute = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[values["compute_dtype"]]
    asked = quantized.pop("bnb_4bit_compute_dtype", compute)
    if asked != compute:  # BitsAndBytesConfig's default is float32, where TRL's load_in_4bit takes dtype's
        init_readings.append(
            KeyReading(
                "model_init_kwargs.quantization_config.bnb_4bit_compute_dtype",
                asked,
                "not-priced",
                f"the 4-bit layers compute in {asked} there: priced in {compute}, the dtype the model loads in",
            )
        )
    if quantized:
        values.update(quantized)
        values["method"] = "qlora" if peft else "full"
    readings += init_readings

    # everything else the file sets
    read = {r.key for r in readings}
    for key in data:
        if key in PRICED_KEYS or key in read or not given(key) or (key == "model_init_kwargs" and init_readings):
            continue  # mapped above, or at TRL's default: the run TRL describes, nothing to name
        why = NO_BYTE_KEYS.get(key) or next(
            (f"{p.rstrip('_')} only" for p in NO_BYTE_PREFIXES if key.startswith(p)), None
        )
        if why is not None:
            readings.append(KeyReading(key, _value_of(data[key]), "no-byte", why))
        elif key not in parsed:  # not a dataclass field: an accelerate launch option (parse_trl let only these by)
            shown = "<hidden>" if any(w in key for w in ("secret", "access_key", "token")) else _value_of(data[key])
            readings.append(KeyReading(key, shown, "not-priced", _LAUNCH_WHY.get(key, _LAUNCH_WHY[""])))
        else:
            not_priced(key, _UNPRICED_WHY.get(key, "not run by vramguard: its effect on memory is left out"))
    if "env" in data:
        not_priced("env", "environment variables the run would set are not applied")
    readings.sort(key=lambda r: list(data).index(r.key) if r.key in data else len(data))
    if framework is None:
        return RunConfig(path=path, values=values, readings=readings, model_problem=model_problem)
    readings = [_named_as(r, translated) for r in readings] + [
        KeyReading(key, value, "no-byte" if why == "no-byte" else "not-priced",
                   f"{framework.name}: changes no byte" if why == "no-byte" else why)
        for key, value, why in other
    ]
    return RunConfig(path, values, readings, model_problem, framework.own_code)


def _init_quantization(
    path: Path, data: dict[str, Any], kwargs: Any, four_bit: bool
) -> tuple[dict[str, Any], list[KeyReading]]:
    """The :class:`QLoRAConfig` values and readings of ``model_init_kwargs`` (SFTConfig's, passed to
    ``from_pretrained``): its ``quantization_config``, read by transformers' own ``AutoQuantizationConfig`` as
    ``from_pretrained`` reads a mapping, is priced when it is bitsandbytes' 4-bit (quant type, double quant,
    ``llm_int8_skip_modules``); every other key of it is named NOT PRICED. Nothing for a file without a
    ``quantization_config`` there (``model_init_kwargs`` is then named NOT PRICED as a whole, as before)."""
    if "model_init_kwargs" not in data or not isinstance(kwargs, dict) or "quantization_config" not in kwargs:
        return {}, []  # (named NOT PRICED as a whole, as before)
    readings = [
        KeyReading(f"model_init_kwargs.{k}", v, "not-priced", "passed to from_pretrained; not run by vramguard")
        for k, v in kwargs.items()
        if k != "quantization_config"
    ]
    quant = kwargs["quantization_config"]
    if four_bit:  # SFTTrainer: "You set `quantization_config` both as a trainer argument and in model_init_kwargs"
        raise UsageError(
            f"--config {path}: quantization_config is set both by load_in_4bit and in model_init_kwargs "
            "(SFTTrainer refuses both): keep one"
        )
    from transformers.quantizers.auto import AutoQuantizationConfig

    try:
        bnb = AutoQuantizationConfig.from_dict(dict(quant)) if isinstance(quant, dict) else None
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--config {path}: model_init_kwargs.quantization_config: {first_line(exc)}") from None
    key = "model_init_kwargs.quantization_config"
    if bnb is None or _value_of(getattr(bnb, "quant_method", "")) != "bitsandbytes" or not bnb.load_in_4bit:
        return {}, [*readings, KeyReading(key, quant, "not-priced", "only bitsandbytes' 4-bit is run")]
    if bnb.bnb_4bit_quant_type not in ("nf4", "fp4"):
        raise UsageError(f"--config {path}: {key}.bnb_4bit_quant_type must be nf4 or fp4")
    skip = bnb.llm_int8_skip_modules
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(n, str) for n in skip)):
        raise UsageError(f"--config {path}: {key}.llm_int8_skip_modules must be a list of names, got {skip!r}")
    values: dict[str, Any] = {
        "quant_type": bnb.bnb_4bit_quant_type,
        "double_quant": bool(bnb.bnb_4bit_use_double_quant),
        "llm_int8_skip_modules": ",".join(skip) if skip else "",
    }
    why = f"method qlora, {', '.join(f'{k}={v!r}' for k, v in values.items() if v != '')}"
    readings.append(KeyReading(key, quant, "priced", why))
    values["bnb_4bit_compute_dtype"] = str(bnb.bnb_4bit_compute_dtype).removeprefix("torch.")
    return values, readings


def _named_as(r: KeyReading, translated: dict[str, str]) -> KeyReading:
    """A reading of a translated key, named by the file's key and the TRL key it was read as."""
    own = translated.get(r.key)
    if own is None or own == r.key:
        return r
    return dataclasses.replace(r, key=f"{own} (as {r.key})")


_LAUNCH_WHY: dict[str, str] = {
    "": "an accelerate launch option (trl sft launches the script with it): one device's step is priced; for "
    "sharded ranks pass --world-size N --sharding fsdp2|fsdp1|zero3",
    "mixed_precision": "accelerate launch's autocast (trl sft launches the script with it): autocast is priced "
    "from bf16 / fp16 only (set bf16: true, or pass --bf16)",
}


_UNPRICED_WHY: dict[str, str] = {
    "liger_kernel_config": "Liger's defaults for the architecture are priced (use_liger_kernel), not these "
    "keywords",
    "torch_compile": "torch.compile is not run: eager autograd is priced",
    "assistant_only_loss": "loss masks change no tensor size, but are not run",
    "completion_only_loss": "loss masks change no tensor size, but are not run",
}


def _names(path: Path, key: str, value: Any, none: str) -> str:
    """A list (or comma-separated string) of names as :class:`QLoRAConfig` holds it; ``none`` for null."""
    if value is None:
        return none
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    raise UsageError(f"--config {path}: {key} must be a list of names, got {value!r}")


__all__ = [
    "NO_BYTE_KEYS",
    "NO_BYTE_PREFIXES",
    "OPTIMIZERS_OF_TRL",
    "TRL_OPTIMIZER_OF",
    "PRICED_KEYS",
    "KeyReading",
    "RunConfig",
    "load_run_config",
    "parse_trl",
    "trl_sft_defaults",
    "read_file",
]
