"""Small QLoRA models built from configs with random weights: nothing is ever downloaded.

The model goes through the same path a user's does: transformers' ``from_pretrained`` with a
``BitsAndBytesConfig`` (from a checkpoint of random weights written to a temporary directory),
PEFT's ``prepare_model_for_kbit_training`` and ``get_peft_model`` with LoRA on all linear
projections. What is measured is therefore the libraries' real code, not a re-implementation.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from vramguard.errors import UsageError, first_line
from vramguard.units import MAX_COUNT
from vramguard.workload.families import experts_of, is_hf_config, spec_from_hf, transformers_config
from vramguard.workload.hub import HUB_ID, Fetch, fetch_config, hub_config

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}

_CONFIG_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "head_dim",
}


PRESETS_DIR = Path(__file__).resolve().with_name("presets")
"""The model presets ship inside the package (package data), so a wheel install has them too;
the suites read them from here as well: one copy."""

MAX_CONFIG_BYTES = 1 << 20
"""A model config is a few hundred bytes; anything above this is not one (``/dev/zero``, a checkpoint)."""

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds ``torch.manual_seed`` accepts."""


def presets() -> dict[str, Path]:
    """Preset name -> config file: every ``*.json`` in the package's ``presets/`` folder."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.json"))}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``bf16``, ``fp16`` or ``fp32`` (any case); anything else is a UsageError."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r} (choose from bf16, fp16, fp32)") from None


def read_at_most(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``. A pipe is opened without waiting for a writer: a named one nobody
    writes reads as empty (opening it plainly waited for ever), one with a writer (``<(cat ...)``,
    ``/dev/stdin``) reads as any file. OSError as :func:`open`'s."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)  # then wait for what a writer has still to write, as a plain open would
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit)


ORIGINS: tuple[str, ...] = ("preset", "file", "directory", "hub")
"""Where a model reference points: a preset name, a config.json path, a model directory (its config.json) or a
Hugging Face Hub id (``org/name[@revision]``, its config.json through ``huggingface_hub``)."""


def origin_of(ref: str) -> str | None:
    """The origin (:data:`ORIGINS`) a model reference names by its form, before anything is read: an existing
    path (or one ending ``.json``) is a file or a directory, else a preset name, else a Hub id; None for none of
    them. ``--model`` (:func:`locate`) and ``--config``'s ``model_name_or_path`` take references by this rule."""
    path = Path(ref)
    if path.suffix == ".json" or path.exists():
        return "directory" if path.is_dir() else "file"
    if ref in presets():
        return "preset"
    return "hub" if HUB_ID.fullmatch(ref) else None


def unknown_model(ref: str) -> str:
    """Why ``ref`` names no model (:func:`origin_of` gave None), suggesting the nearest preset."""
    known = presets()
    near = difflib.get_close_matches(ref.lower(), list(known), n=1)
    return (
        f"unknown model {ref!r}: {f'did you mean {near[0]}? ' if near else ''}use a preset "
        f"({', '.join(known)}) or a JSON path (a config.json, or a model directory holding one), or a Hugging Face "
        "Hub id (org/name[@revision])"
    )


def locate(ref: str, fetch: Fetch = hub_config) -> tuple[Path, str, str | None]:
    """(the config.json, its origin (:data:`ORIGINS`, by :func:`origin_of`), the Hub commit or None) of a model
    reference; anything else is a UsageError that suggests the nearest preset."""
    origin = origin_of(ref)
    path = Path(ref)
    if origin == "file":
        return path, "file", None
    if origin == "directory":
        if not (path / "config.json").is_file():
            raise UsageError(f"model directory {path} has no config.json")
        return path / "config.json", "directory", None
    if origin == "preset":
        return presets()[ref], "preset", None
    if origin == "hub":
        found, commit = fetch_config(ref, fetch)
        return found, "hub", commit
    raise UsageError(unknown_model(ref))


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object of a model config file, with transformers' encoding of special floats decoded
    (``{"__float__": "Infinity"}``, as ``PretrainedConfig.from_json_file`` reads it); a missing, binary,
    oversized or malformed file is a UsageError."""
    try:
        raw = read_at_most(path, MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise UsageError(f"model config not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read model config {path}: {exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"model config {path} is over {MAX_CONFIG_BYTES} bytes: not a JSON model config")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"cannot read model config {path}: not UTF-8 text (a binary file?)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"cannot read model config {path}: {exc}") from None
    except RecursionError:
        raise UsageError(f"cannot read model config {path}: JSON nested too deeply") from None
    except ValueError as exc:  # a number of over 4,300 digits
        raise UsageError(f"cannot read model config {path}: {first_line(exc)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"model config {path} must be a JSON object")
    from transformers import PretrainedConfig

    try:
        return dict(PretrainedConfig._decode_special_floats(data))
    except RecursionError:
        raise UsageError(f"cannot read model config {path}: JSON nested too deeply") from None


@dataclass(frozen=True)
class ModelSpec:
    """The resolved model: what a model reference (:meth:`load`) names, read and validated once, with its
    transformers config built once (``built``); it travels as :attr:`QLoRAConfig.model` instead of the string.

    Either vramguard's Llama preset format, or a Hugging Face ``config.json`` (it has a
    ``model_type``; kept whole in ``hf`` and built with ``AutoModelForCausalLM``). ``ref``: the reference as
    given (what the report records); ``origin``: one of :data:`ORIGINS`; ``revision``: the Hub commit it was
    read at (Hub ids only).
    """

    name: str
    fields: dict[str, Any]
    model_type: str = "llama"
    hf: dict[str, Any] | None = None
    ref: str = ""
    origin: str = "file"
    revision: str | None = None
    built: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.built is None:
            built = transformers_config(self.hf) if self.hf is not None else self.llama_config()
            object.__setattr__(self, "built", built)

    def __str__(self) -> str:
        return self.ref or self.name

    @classmethod
    def load(cls, ref: str | Path, fetch: Fetch = hub_config) -> ModelSpec:
        """Resolve a model reference: a preset name, a config.json path, a model directory or a Hugging Face Hub
        id (:func:`locate`; ``fetch`` reads a Hub id's config.json: :func:`vramguard.workload.hub.hub_config`);
        a bad reference or config is a UsageError."""
        text = str(ref)
        path, origin, revision = locate(text, fetch)
        data = read_config(path)
        name = {"directory": path.parent.name, "hub": text}.get(origin, path.stem)
        where = {"hub": text}.get(origin, str(path))
        if is_hf_config(data):
            model_type, hf_fields, built = spec_from_hf(where, data)
            return cls(name, hf_fields, model_type, data, text, origin, revision, built)
        return cls(name=name, fields=llama_fields(Path(where), data), ref=text, origin=origin, revision=revision)

    def llama_config(self, attn_implementation: str = "sdpa") -> Any:
        """The transformers ``LlamaConfig`` of a Llama preset, with the attention implementation set."""
        from transformers import LlamaConfig

        config = LlamaConfig(**self.fields)
        config._attn_implementation = attn_implementation
        return config

    def transformers_config(self) -> Any:
        """A copy of the transformers config built once (the Hugging Face config itself, or a LlamaConfig): the
        builds set their attention implementation on it."""
        return copy.deepcopy(self.built)

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head (``head_dim`` when the config has it, else hidden size over heads)."""
        return int(
            self.fields.get("head_dim") or self.fields["hidden_size"] // self.fields["num_attention_heads"]
        )


def llama_fields(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The shape fields of a vramguard Llama preset, validated (UsageError naming ``path``)."""
    arch = data.get("architecture", "llama")
    if arch != "llama":
        raise UsageError(f"model config {path}: architecture {arch!r} is not supported (only 'llama')")
    fields = {k: v for k, v in data.items() if k in _CONFIG_KEYS}
    missing = {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    }
    missing -= set(fields)
    if missing:
        raise UsageError(f"model config {path} lacks {', '.join(sorted(missing))}")
    for key, value in fields.items():
        if key not in ("rms_norm_eps", "tie_word_embeddings") and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise UsageError(f"model config {path}: {key} must be a positive integer, got {value!r}")
    eps = fields.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise UsageError(f"model config {path}: rms_norm_eps must be a positive number, got {eps!r}")
    if "rms_norm_eps" in fields:
        fields["rms_norm_eps"] = float(eps)
    if not isinstance(fields.get("tie_word_embeddings", False), bool):
        raise UsageError(
            f"model config {path}: tie_word_embeddings must be true or false, "
            f"got {fields['tie_word_embeddings']!r}"
        )
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise UsageError(f"model config {path}: hidden_size is not a multiple of num_attention_heads")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise UsageError(
            f"model config {path}: num_attention_heads is not a multiple of num_key_value_heads"
        )
    if fields.get("head_dim", 2) % 2:
        raise UsageError(f"model config {path}: head_dim must be even (rotary embeddings)")
    return fields


METHODS: tuple[str, ...] = ("qlora", "lora", "full")
"""qlora: 4-bit base + LoRA (as ``vramguard audit``); lora: LoRA on a base in the compute dtype;
full: every parameter trained, in fp32 (fp32 weights, gradients and AdamW moments: 16 B/param)."""

OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit")
"""adamw: ``torch.optim.AdamW`` with torch's default implementation for the parameters' device (what the audit
uses; TrainingArguments' ``adamw_torch``): ``foreach`` on CUDA, whose step makes ``sqrt(exp_avg_sq)`` of every
parameter at once (a temporary as large as the trainable parameters), the single-tensor loop on the CPU (one
parameter's temporaries at a time); adamw-fused: ``torch.optim.AdamW(fused=True)`` (TrainingArguments' default,
``adamw_torch_fused``, where torch is 2.8 or newer): one in-place kernel, no temporaries, its step counters on the device
(the same 8 bytes of state a parameter); adamw-8bit: ``bitsandbytes.optim.AdamW8bit``
(two uint8 moments with blockwise absmax); paged-adamw-8bit: ``bitsandbytes.optim.PagedAdamW8bit``,
which is ``AdamW8bit(is_paged=True)``: the same state, but the two moments of every parameter with at
least :data:`vramguard.estimate.run.PAGED_MIN_NUMEL` elements live in CUDA unified memory
(``cudaMallocManaged``), which the driver pages to the host when the device runs short. Unified memory
cannot be had on meta or on a CPU, so the meta run and the CPU audit run ``AdamW8bit`` and
:func:`vramguard.estimate.run.paged_state_bytes` names the bytes that would be paged; the audit on CUDA runs
``PagedAdamW8bit`` itself."""

ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2")
"""transformers' attention implementations vramguard runs; ``flash_attention_2`` on meta only (the estimate,
:mod:`vramguard.estimate.flash`: the flash_attn package is CUDA-only)."""

MIXED_PRECISION: tuple[str, ...] = ("no", "bf16", "fp16")
"""Trainer's autocast (``TrainingArguments.bf16`` / ``fp16``): the step's forward and loss run under it
(:func:`vramguard.workload.training.forward_as_trainer`; on meta, :mod:`vramguard.estimate.autocast`)."""

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


REGEX_CHARS = frozenset("*()|[]\\^$+?{}")
"""Characters that make a ``target_modules`` value a regular expression: PEFT full-matches a string
``target_modules`` against each module's qualified name (what a ``trl sft`` YAML's ``lora_target_modules: "..."``
string reaches PEFT as, e.g. ``.*language_model.*\\.(q_proj|v_proj)`` for LoRA on the language model only)."""


def is_target_regex(value: Any) -> bool:
    """Whether a ``target_modules`` value is a regular expression (:data:`REGEX_CHARS`) rather than names."""
    return isinstance(value, str) and value != "all-linear" and any(c in REGEX_CHARS for c in value)


def names_of(value: str) -> list[str]:
    """The names of a comma-separated list (``target_modules``, ``target_parameters``), blanks dropped."""
    return [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else []


STEP_OPTIONS: tuple[str, ...] = (
    "method",
    "optimizer",
    "offload_activations",
    "full_dtype",
    "use_liger_kernel",
)
"""The fields of :class:`QLoRAConfig` that schema 1 of the JSON document stores under ``config.extra``."""


@dataclass(frozen=True)
class QLoRAConfig:
    """Everything that decides a QLoRA step's memory, as the user would set it: one typed field per
    parameter, named as its CLI flag (``--seq-len`` is ``seq_len``) and its JSON key.

    A new parameter is a field with its default, a check in :meth:`validate` and, where a command takes it,
    an option in :mod:`vramguard.cli.options`; the JSON document records every field (:meth:`to_dict`).
    ``method``, ``optimizer``, ``offload_activations`` and ``full_dtype`` are the meta-run estimate's (the
    audit's loop always runs qlora with torch AdamW, nothing offloaded). ``full_dtype``: the dtype ``--method
    full`` loads and trains every parameter in (TRL's ``dtype``): ``fp32`` (weights, gradients and AdamW's
    two moments, 16 B per parameter) or ``bf16``/``fp16`` (torch's AdamW keeps its moments in the
    parameters' dtype: 8 B per parameter).

    ``target_modules``: PEFT's ``target_modules``: ``all-linear``, ``peft-default`` (PEFT's own choice for
    the architecture, what ``LoraConfig(target_modules=None)`` and TRL's default pick), comma-separated
    module names, or a regular expression (:func:`is_target_regex`) PEFT full-matches against qualified names. ``target_parameters``: PEFT's ``target_parameters``, comma-separated parameter names
    (e.g. a mixture of experts' ``mlp.experts.gate_up_proj``), empty for none. ``use_rslora``: PEFT's
    rank-stabilised scaling (``alpha / sqrt(r)``). ``use_dora``: PEFT's DoRA (``LoraConfig(use_dora=True)``: a
    trained magnitude vector per adapted layer, and a forward that dequantizes the 4-bit weight to compute the
    weight norm; with dropout it keeps that dequantized copy for backward). ``padding_free``: TRL's
    padding-free batch (:func:`padding_free_batch`): the rows flattened into one, with position ids that restart
    per sequence; ``packing`` (with ``padding_free``: TRL's ``bfd`` packing): several sequences per row.
    ``mixed_precision``: Trainer's ``bf16`` / ``fp16``
    autocast (``no``, ``bf16``, ``fp16``), run as accelerate runs it for Trainer (fp16 needs a GPU: accelerate
    refuses it on the CPU, and so do the CPU audit and ``estimate --target cpu``). ``use_liger_kernel``: Trainer's
    ``use_liger_kernel`` (Liger's kernels, its fused linear cross-entropy among them), the estimate's on meta
    (:mod:`vramguard.estimate.liger`); the audit's loop applies it on CUDA and runs without it elsewhere (Triton
    needs a GPU). ``gradient_accumulation_steps``: Trainer's gradient accumulation: a step is that many
    micro-batches of ``batch`` rows, each a forward and a backward that adds into the gradients the earlier ones
    left (so every micro-batch after the first runs with the whole gradient held), then one optimizer step.
    ``image_size`` (``HxW``) and ``images_per_row``: a vision-language model's images, each row that many of that
    size as its family's processor makes them (:mod:`vramguard.workload.vision`; ``seq_len`` is the whole row,
    image tokens included); empty: text-only rows. Recorded in the JSON document only when set. The vision tower's
    choices (:data:`vramguard.workload.vision.TOWER_FIELDS`, recorded only where not their defaults):
    ``vision_tower`` (``4bit`` or ``unquantized``), ``llm_int8_skip_modules`` (``BitsAndBytesConfig``'s, as the
    user writes it), ``lora_scope`` (``all``, ``language-model``, ``language-model+projector``),
    ``tower_checkpointing``, Qwen's processor bounds ``min_pixels`` / ``max_pixels`` (0: the processor's
    default), Gemma 3's ``pan_and_scan`` (its processor's ``do_pan_and_scan``) and a row's video
    (``video_frames`` frames of ``video_size``, ``HxW``; 0 and empty: none); resolved once into
    :class:`~vramguard.workload.vision.TowerChoices`."""

    model: str | ModelSpec = "tiny-llama"
    seq_len: int = 128
    batch: int = 2
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    compute_dtype: str = "bf16"
    quant_type: str = "nf4"
    double_quant: bool = True
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    seed: int = 0
    target_modules: str = "all-linear"
    target_parameters: str = ""
    use_rslora: bool = False
    use_dora: bool = False
    padding_free: bool = False
    packing: bool = False
    mixed_precision: str = "no"
    method: str = "qlora"
    optimizer: str = "adamw"
    offload_activations: bool = False
    full_dtype: str = "fp32"
    use_liger_kernel: bool = False
    gradient_accumulation_steps: int = 1
    image_size: str = ""
    images_per_row: int = 1
    vision_tower: str = "4bit"
    llm_int8_skip_modules: str = ""
    lora_scope: str = "all"
    tower_checkpointing: bool = True
    train_projector: bool = False
    min_pixels: int = 0
    max_pixels: int = 0
    pan_and_scan: bool = False
    video_frames: int = 0
    video_size: str = ""

    @property
    def spec(self) -> ModelSpec:
        """The resolved model: ``model`` itself once :meth:`resolved`, else the reference resolved now (each
        call: resolve once with :meth:`resolved` and pass that config on)."""
        return self.model if isinstance(self.model, ModelSpec) else ModelSpec.load(self.model)

    def resolved(self) -> QLoRAConfig:
        """This config with ``model`` resolved to its :class:`ModelSpec` (read, validated and built once; a bad
        reference is a UsageError): what a run passes on, and what ``dataclasses.replace`` keeps."""
        return self if isinstance(self.model, ModelSpec) else replace(self, model=self.spec)

    @property
    def model_ref(self) -> str:
        """The model as the user named it (what the JSON document records)."""
        return str(self.model)

    def validate(self) -> None:
        """Raise UsageError (one line) on a value that cannot run: sizes not positive, dropout outside [0, 1),
        a seed outside torch's range."""
        for name in ("seq_len", "batch", "lora_rank", "gradient_accumulation_steps"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise UsageError(f"{name.replace('_', '-')} must be an integer, got {getattr(self, name)!r}")
            if getattr(self, name) <= 0:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
            if getattr(self, name) > MAX_COUNT:
                got = str(getattr(self, name))[:40]
                raise UsageError(f"{name.replace('_', '-')} must be at most {MAX_COUNT:,}, got {got}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UsageError(f"lora dropout must be in [0, 1), got {self.lora_dropout}")
        for name in ("use_dora", "padding_free", "packing", "use_liger_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(
                    f"{name.replace('_', '-')} must be true or false, got {getattr(self, name)!r}"
                )
        if self.packing and not self.padding_free:
            raise UsageError("packing is priced padding-free only (TRL's bfd packing): set padding_free too")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"seed must be an integer, got {self.seed!r}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise UsageError(f"seed must be in [-2**63, 2**64 - 1] (torch's seed range), got {self.seed}")
        parse_dtype(self.compute_dtype)
        parse_dtype(self.full_dtype)
        if self.full_dtype != "fp32" and self.method != "full":
            raise UsageError(
                f"full-dtype {self.full_dtype} is the dtype of --method full, not of {self.method}"
            )
        if self.quant_type not in ("nf4", "fp4"):
            raise UsageError(f"quant type must be nf4 or fp4, got {self.quant_type!r}")
        if self.method not in METHODS:
            raise UsageError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise UsageError(
                f"attention implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
                f"got {self.attn_implementation!r}"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise UsageError(
                f"mixed precision must be one of {', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}"
            )
        if is_target_regex(self.target_modules):
            try:
                re.compile(self.target_modules)
            except re.error as exc:
                raise UsageError(f"target-modules {self.target_modules!r} is no regular expression: {exc}") from None
        for name in ("target_modules", "target_parameters")[is_target_regex(self.target_modules) :]:
            value = getattr(self, name)
            names = names_of(value)
            if not isinstance(value, str) or any(not _NAME.fullmatch(n) for n in names):
                raise UsageError(
                    f"{name.replace('_', '-')} must be comma-separated module names (letters, digits, _ . -), "
                    f"got {value!r}"
                )
        if self.image_size:
            from vramguard.workload.vision import MAX_IMAGES_PER_ROW, parse_image_size

            parse_image_size(self.image_size)
            n = self.images_per_row
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES_PER_ROW:
                raise UsageError(f"images-per-row must be an integer from 1 to {MAX_IMAGES_PER_ROW}, got {n!r}")
        elif self.images_per_row != 1:
            raise UsageError("images-per-row needs image-size (HxW)")
        from vramguard.workload.vision import validate_tower_options

        validate_tower_options(self)
        if not (is_target_regex(self.target_modules) or names_of(self.target_modules)) and not names_of(
            self.target_parameters
        ):
            raise UsageError("target-modules is empty and so is target-parameters: LoRA would adapt nothing")
        dev = self.device
        try:
            torch_dev = torch.device(dev)
        except RuntimeError:
            raise UsageError(f"not a device: {dev!r}") from None
        if torch_dev.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"device {dev!r} requested but CUDA is not available")
        if torch_dev.type not in ("cpu", "cuda"):
            raise UsageError(f"device must be cpu or cuda, got {dev!r}")

    def to_dict(self, step_options: bool = False) -> dict[str, Any]:
        """The configuration as the JSON document records it (schema 1): every field, with the
        :data:`STEP_OPTIONS` under ``extra``: ``method`` and ``optimizer`` (and ``offload_activations`` and
        ``full_dtype`` and ``use_liger_kernel`` when not their defaults) with ``step_options`` (the estimate's meta
        run, which chose them), none otherwise (the audit's loop: ``extra`` is empty)."""
        d = asdict(replace(self, model=self.model_ref))
        options = {name: d.pop(name) for name in STEP_OPTIONS}
        for name in ("offload_activations", "use_liger_kernel"):
            if not options[name]:
                del options[name]
        if options["full_dtype"] == "fp32":  # the default: documents written before the field read the same
            del options["full_dtype"]
        if isinstance(self.model, ModelSpec) and self.model.revision is not None:
            d["model_revision"] = self.model.revision  # the Hub commit the config was read at
        if not d["image_size"]:  # a text model's run: its document as before the fields
            del d["image_size"], d["images_per_row"]
        from vramguard.workload.vision import TOWER_FIELDS

        defaults = QLoRAConfig()
        for name in TOWER_FIELDS:  # the vision tower's choices: recorded where they are not the defaults
            if d[name] == getattr(defaults, name):
                del d[name]
        d["extra"] = options if step_options else {}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QLoRAConfig:
        """Inverse of :meth:`to_dict` (a document's ``config``): the fields, with the step options read
        from ``extra``; keys that are no field (a trainer run's ``trainer``, ``max_steps``, ...) are left out."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values.update({k: v for k, v in (data.get("extra") or {}).items() if k in STEP_OPTIONS})
        return cls(**values)


@dataclass
class QLoRAModel:
    """A PEFT-wrapped 4-bit model plus what was needed to build it."""

    model: torch.nn.Module
    spec: ModelSpec
    config: QLoRAConfig
    attn_implementation: str = "sdpa"  # what the model runs (config's, or eager where sdpa is missing)
    notes: tuple[str, ...] = ()  # what the build changed from the request, and why

    @property
    def model_class(self) -> str:
        """Class name of the model under the PEFT wrapper, e.g. ``LlamaForCausalLM``."""
        base = getattr(self.model, "get_base_model", None)
        return type(base() if callable(base) else self.model).__name__

    @property
    def device(self) -> torch.device:
        """The device the model was built on."""
        return torch.device(self.config.device)

    def batch(self, step: int = 0) -> dict[str, torch.Tensor]:
        """Synthetic tokens for one step, deterministic in (seed, step)."""
        # modulo 2**64: the same seed torch derives from a negative or small value, defined for all
        g = torch.Generator().manual_seed((self.config.seed * 1_000_003 + step) % (1 << 64))
        ids = torch.randint(
            0, self.spec.fields["vocab_size"], (self.config.batch, self.config.seq_len), generator=g
        )
        if self.config.padding_free:
            return {
                k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in padding_free_batch(ids, self.config.packing).items()
            }
        ids = ids.to(self.device)
        return {"input_ids": ids, "labels": ids}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates: the LoRA adapters."""
        return [p for p in self.model.parameters() if p.requires_grad]


def packed_lengths(seq_len: int, packing: bool) -> list[int]:
    """The sequence lengths of one row of ``seq_len`` tokens, the boundaries a padding-free batch is priced with:
    one sequence per row, or with ``packing`` two (``seq_len - seq_len // 2`` and ``seq_len // 2``). With sdpa
    and eager attention only whether a row holds one sequence or several changes a byte (transformers builds
    the packed-sequence mask, 1 x 1 x N x N, for several); the lengths themselves change none."""
    return [seq_len - seq_len // 2, seq_len // 2] if packing and seq_len > 1 else [seq_len]


def padding_free_batch(ids: torch.Tensor, packing: bool) -> dict[str, Any]:
    """TRL's padding-free batch of the rows ``ids`` (batch x seq), made by TRL's own collator
    (``DataCollatorForLanguageModeling(padding_free=True)``, what ``SFTTrainer`` uses with ``padding_free`` or
    ``bfd`` packing): every row flattened into one of batch x seq tokens, ``position_ids`` restarting at each
    sequence (:func:`packed_lengths`), no attention mask, the varlen boundaries (``cu_seq_lens_*``,
    ``max_length_*``, ``seq_idx``) the model is passed too."""
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError as exc:
        raise UsageError(f"padding-free batches are TRL's (pip install 'vramguard[trl]'): {exc}") from None
    examples = [
        {"input_ids": row, "seq_lengths": packed_lengths(len(row), packing)} for row in ids.cpu().tolist()
    ]
    return dict(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples))


def causal_lm_class(hf_config: Any) -> Any:
    """The ``AutoModelForCausalLM`` class of a transformers config (UsageError when there is none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise UsageError(
            f"model_type {hf_config.model_type!r} has no causal language model class in transformers"
        ) from None


def resolve_attention(config: QLoRAConfig, spec: ModelSpec) -> tuple[Any, Any, str, list[str]]:
    """``spec``'s transformers config, its causal-LM class, the attention the model runs and why it
    differs from ``config``'s (the config is set to it): a class without sdpa runs eager attention,
    as ``from_pretrained`` would by default."""
    hf_config = spec.transformers_config()
    model_class = causal_lm_class(hf_config)
    attn = config.attn_implementation
    notes: list[str] = []
    if attn == "flash_attention_2" and not getattr(model_class, "_supports_flash_attn", False):
        raise UsageError(f"{model_class.__name__} has no flash_attention_2 in transformers")
    if attn == "sdpa" and not getattr(model_class, "_supports_sdpa", False):
        attn = "eager"
        notes.append(
            f"{model_class.__name__} has no sdpa attention in transformers: it ran eager attention "
            "(what from_pretrained picks by default)"
        )
    hf_config._attn_implementation = attn
    return hf_config, model_class, attn, notes


def _placement(config: QLoRAConfig) -> dict[str, Any]:
    """``from_pretrained``'s device placement: ``device_map`` on ``config.device``, or none while a DeepSpeed
    ZeRO-3 configuration is alive (transformers' ``HfDeepSpeedConfig``): transformers refuses a device map
    then ("DeepSpeed Zero-3 is not compatible with passing a `device_map`"), and the model loads on the host,
    as a ZeRO-3 user's does, for the engine to partition."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return {} if is_deepspeed_zero3_enabled() else {"device_map": {"": config.device}}


def bnb_4bit_config(
    config: QLoRAConfig, sharded: bool = False, skip_modules: tuple[str, ...] | None = None
) -> Any:
    """The ``BitsAndBytesConfig`` a user passes to ``from_pretrained`` for ``config``'s 4-bit base; with
    ``sharded``, the FSDP + QLoRA recipe's: packed weights stored in the compute dtype
    (``bnb_4bit_quant_storage``), so a wrap unit has one dtype (:mod:`vramguard.workload.sharding`);
    ``skip_modules``: its ``llm_int8_skip_modules`` (a vision-language model's tower kept unquantized)."""
    from transformers import BitsAndBytesConfig

    extra: dict[str, Any] = {"bnb_4bit_quant_storage": parse_dtype(config.compute_dtype)} if sharded else {}
    if skip_modules is not None:
        extra["llm_int8_skip_modules"] = list(skip_modules)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.quant_type,
        bnb_4bit_compute_dtype=parse_dtype(config.compute_dtype),
        bnb_4bit_use_double_quant=config.double_quant,
        **extra,
    )


def prepare_for_training(model: Any, config: QLoRAConfig, sharded: bool = False) -> Any:
    """What the model goes through before LoRA: PEFT's ``prepare_model_for_kbit_training`` (norms and
    unquantized weights upcast to fp32, input gradients, checkpointing), or, ``sharded`` (the FSDP + QLoRA
    recipe, which TRL follows by skipping that preparation for a sharded 4-bit model), only gradient
    checkpointing when asked: everything stays in the model dtype."""
    checkpointing = {"use_reentrant": False} if config.gradient_checkpointing else None
    if not sharded:
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs=checkpointing,
        )
    for p in model.parameters():
        p.requires_grad_(False)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model


KERNEL_EXPERTS = ("deepgemm", "sonicmoe")
"""transformers' experts implementations that load a CUDA kernel package (``kernels``) at the first forward."""


def refuse_kernel_experts(hf_config: Any, name: str) -> None:
    """A config asking for experts from a kernel package is bad input here: the audit on the CPU cannot run
    them and the meta run does not price them (transformers would only fail at the first forward)."""
    impl = getattr(hf_config, "_experts_implementation", None)
    if impl in KERNEL_EXPERTS:
        raise UsageError(
            f"{name}: experts_implementation {impl} runs a CUDA kernel package's experts, which vramguard neither "
            "runs on the CPU nor prices on meta; use eager, grouped_mm or batched_mm"
        )


def with_lora(model: Any, config: QLoRAConfig, tower: Any = None) -> Any:
    """PEFT's ``get_peft_model`` with the config's LoRA (``tower``: a vision-language model's
    :class:`~vramguard.workload.vision.TowerChoices`, its ``exclude_modules`` and ``modules_to_save``); a LoRA
    config PEFT refuses for this model (no target module found, dropout on expert parameters, ...) is bad input,
    said in one line as PEFT says it."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, lora_config(config, tower))
    except ValueError as exc:
        raise lora_refused(exc, model) from None
    refuse_tuple_routers(peft_model)
    return peft_model


def lora_refused(exc: ValueError, model: torch.nn.Module) -> UsageError:
    """The one line for a LoRA setup PEFT refuses for ``model`` (PEFT's own ``get_peft_model`` in the loop, or
    inside ``SFTTrainer``): the Mamba mixer's layers named with the targets that work, a model type PEFT has no
    default targets for with the flag that sets them, anything else as PEFT says it."""
    if "incompatible with Mamba-based models" in str(exc):
        return UsageError(mamba_refusal(model))
    line = f"PEFT refuses this LoRA setup: {first_line(exc)}"
    if "specify `target_modules`" in str(exc):
        kind = getattr(getattr(model, "config", None), "model_type", "this model")
        line += f" (PEFT has no default targets for {kind}: pass --target-modules all-linear, or names)"
    return UsageError(line)


MAMBA_REFUSED = ("out_proj", "conv1d")
"""The Mamba mixer's layers PEFT refuses LoRA on in the model types it calls Mamba-based (Falcon-H1, Mamba,
Nemotron-H: ``peft.tuners.tuners_utils._check_lora_target_modules_mamba``)."""


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last names of ``model``'s linear layers (``nn.Linear`` and bitsandbytes' 4-bit ones), the output layer
    left out: what ``all-linear`` targets."""
    names = set()
    for name, m in model.named_modules():
        while name.endswith(".base_layer"):  # a layer PEFT had wrapped before it refused another
            name = name.removesuffix(".base_layer")
        if isinstance(m, torch.nn.Linear) and name and ".lora_" not in name and not name.endswith("lm_head"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def mamba_refusal(model: torch.nn.Module) -> str:
    """One line for PEFT's refusal of LoRA on a Mamba mixer's ``out_proj`` / ``conv1d``, naming the targets that
    work: every other linear layer."""
    kind = getattr(getattr(model, "config", None), "model_type", "this model")
    works = ",".join(n for n in linear_names(model) if n not in MAMBA_REFUSED)
    return (
        f"PEFT refuses LoRA on the Mamba mixer's {' and '.join(MAMBA_REFUSED)} in {kind} models (all-linear "
        f"includes out_proj): pass the other layers, --target-modules {works}"
    )


def refuse_tuple_routers(model: torch.nn.Module) -> None:
    """A UsageError where PEFT put LoRA on a router that is an ``nn.Linear`` with a forward of its own returning a
    tuple (Llama 4's ``Llama4Router``, Phi-MoE's router): PEFT's LoRA layer reads the base layer's output as one
    tensor, so the user's own run fails at its first forward ("'tuple' object has no attribute 'dtype'")."""
    routers: dict[str, str] = {}
    for name, m in model.named_modules():
        base = m.get_base_layer() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer") else None
        forward = getattr(type(base), "forward", None)
        if (
            isinstance(base, torch.nn.Linear)
            and type(base).__name__.endswith("Router")  # FalconLinear & co. have a forward of their own too
            and getattr(forward, "__module__", "").startswith("transformers.")
        ):
            routers[name.rsplit(".", 1)[-1]] = type(base).__name__
    if not routers:
        return
    adapted, wrapped = lora_targets(model)
    works = f"--target-modules {','.join(sorted(adapted - set(routers)))}"
    if wrapped:
        works += f" --target-parameters {','.join(sorted(wrapped))}"
    named = ", ".join(f"{n!r} ({c})" for n, c in sorted(routers.items()))
    raise UsageError(
        f"PEFT cannot put LoRA on the experts' router {named}: its forward returns a tuple, which PEFT's LoRA "
        "layer takes for one tensor (the run would fail: 'tuple' object has no attribute 'dtype'); leave the "
        f"router out: {works}"
    )


def lora_config(config: QLoRAConfig, tower: Any = None) -> Any:
    """PEFT's ``LoraConfig`` for ``config``: rank, alpha, dropout, target modules and parameters, rsLoRA,
    DoRA, causal LM; with ``tower`` (a vision-language model's choices) its ``exclude_modules`` and
    ``modules_to_save`` where set (PEFT's defaults otherwise: none)."""
    extra: dict[str, Any] = {}
    if tower is not None and tower.exclude_modules is not None:
        extra["exclude_modules"] = tower.exclude_modules
    if tower is not None and tower.modules_to_save is not None:
        extra["modules_to_save"] = list(tower.modules_to_save)
    from peft import LoraConfig

    targets: str | list[str] | None = names_of(config.target_modules)  # [] with target_parameters alone
    if config.target_modules in ("all-linear", "peft-default"):
        targets = None if config.target_modules == "peft-default" else "all-linear"
    elif is_target_regex(config.target_modules):  # PEFT full-matches a string against qualified names
        targets = config.target_modules
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        target_parameters=names_of(config.target_parameters) or None,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        task_type="CAUSAL_LM",
        **extra,
    )


def weights_line(model: torch.nn.Module, hf_config: Any) -> str | None:
    """One line on how a mixture of experts really loaded: which weights are 4-bit, which stay unquantized
    (and in which dtype), how many bytes each takes, and where PEFT put LoRA; None for a dense model.

    Read from the built model's own parameters (after ``prepare_model_for_kbit_training``, which casts every
    parameter bitsandbytes left unquantized to fp32: the expert stacks load in the compute dtype and train
    in fp32)."""
    experts = experts_of(hf_config)
    if experts is None:
        return None
    quantized = stacks = other = 0
    quantized_bytes = stack_bytes = other_bytes = 0
    stack_dtypes: set[str] = set()
    for p in model.parameters():
        if p.requires_grad:
            continue
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            quantized += int(torch.Size(qs.shape).numel())
            quantized_bytes += storage_bytes_of(p, qs)
        elif p.dim() >= 3:
            stacks += p.numel()
            stack_bytes += p.numel() * p.element_size()
            stack_dtypes.add(str(p.dtype).removeprefix("torch."))
        else:
            other += p.numel()
            other_bytes += p.numel() * p.element_size()
    adapted, wrapped = lora_targets(model)
    impl = getattr(hf_config, "_experts_implementation", None) or "eager"
    fb = _format_bytes
    lora = ", ".join(sorted(adapted))
    return (
        f"mixture of experts: {experts.count} experts, top {experts.top_k}, experts_implementation {impl}; "
        f"4-bit (bitsandbytes Linear4bit): {quantized:,} params in {fb(quantized_bytes)}; not quantized "
        f"(bitsandbytes replaces nn.Linear only): the fused 3-D expert stacks, {stacks:,} params in "
        f"{'/'.join(sorted(stack_dtypes))} = {fb(stack_bytes)}, and {other:,} other params (embeddings, "
        f"lm_head, norms, routers) = {fb(other_bytes)}; LoRA (PEFT) on modules {lora or 'none'}"
        + (f" and on parameters {', '.join(sorted(wrapped))} (target_parameters)" if wrapped else "")
    )


def may_wrap_parameters(config: QLoRAConfig) -> bool:
    """Whether PEFT may put LoRA on parameters of ``config``'s model (its ``ParamWrapper``, as
    :func:`lora_targets` names them): ``target_parameters`` are given, or the model is a mixture of experts,
    whose fused expert stacks ``all-linear`` targets. Read from the config alone, without a build: those are
    the setups PEFT's build refuses with some options (dropout) and FSDP1 cannot shard."""
    if names_of(config.target_parameters):
        return True
    spec = config.spec
    return spec.hf is not None and experts_of(spec.built) is not None


def lora_targets(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """Where PEFT put LoRA in ``model``: the modules it adapts (its ``lora.Linear*`` layers), by their last
    name, and the parameters it wraps (its ``ParamWrapper``: ``target_parameters``, or ``all-linear`` on the
    fused expert stacks of a mixture of experts), as ``module.parameter``."""
    adapted: set[str] = set()
    wrapped: set[str] = set()
    for name, m in model.named_modules():
        if not hasattr(m, "lora_A"):
            continue
        while name.endswith(".base_layer"):
            name = name.removesuffix(".base_layer")
        last = name.rsplit(".", 1)[-1]
        if hasattr(m, "parameter_name"):
            wrapped.add(f"{last}.{m.parameter_name}")
        else:
            adapted.add(last)
    return adapted, wrapped


def routing_line(hf_config: Any) -> str | None:
    """What routing decides in a mixture of experts' step, or None for a dense model.

    With transformers' ``grouped_mm`` experts (its default where ``torch.nn.functional.grouped_mm`` exists)
    every expert matmul takes all ``tokens x top_k`` rows, sorted by expert and split by offsets: no tensor's
    size depends on which experts the router picks, so the bound for balanced routing and the one for the
    worst case (all tokens to the same experts) are the measured figure. The ``eager`` implementation loops
    over the experts hit, with per-expert tensors sized by their tokens: there routing decides, and the build
    cannot say how much; :func:`vramguard.audit.run.run_audit` (given ``routing_figures``, on the CPU), the
    Trainer audits on the CPU and :func:`vramguard.estimate.run.run_estimate` replace that line with the
    figures of forced routings (:func:`vramguard.workload.routing.bounds_line`)."""
    experts = experts_of(hf_config)
    if experts is None:
        return None
    impl = getattr(hf_config, "_experts_implementation", None) or "eager"
    if impl in ("grouped_mm", "batched_mm"):
        return (
            f"routing: with the {impl} experts every expert matmul takes all tokens x top {experts.top_k} rows, "
            "whatever the router picks: balanced routing, all tokens to the same experts and the measured "
            "figure keep the same bytes (no tensor's size depends on routing)"
        )
    return (
        f"routing: with the {impl} experts the tensors of each expert are sized by the tokens routed to it; "
        "these figures are for the routing this run drew (for eager experts, vramguard estimate, on one device and "
        "sharded, and vramguard audit on the CPU, its own loop and the Trainer audits, replace this line with the "
        "step peak of forced routings: vramguard.workload.routing; not a GPU, not the multi-process audit)"
    )


def _format_bytes(n: int) -> str:
    from vramguard.units import format_bytes

    return format_bytes(n)


def storage_bytes_of(p: torch.Tensor, quant_state: Any) -> int:
    """Bytes of a 4-bit parameter as stored: packed data, absmax (and its double-quantization state), code."""
    total = p.numel() * p.element_size()
    for t in (
        getattr(quant_state, "absmax", None),
        getattr(quant_state, "code", None),
        getattr(getattr(quant_state, "state2", None), "absmax", None),
        getattr(getattr(quant_state, "state2", None), "code", None),
        getattr(quant_state, "offset", None),
    ):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


BUILD_ERRORS = (ValueError, TypeError, ImportError, KeyError, AttributeError, ZeroDivisionError, IndexError)
"""What transformers raises building a model from a config it cannot build (an unknown ``hidden_act`` or
``rope_scaling`` type is a KeyError, a ``quantization_config`` that is no mapping an AttributeError): the
user's file, one line; the model classes run no vramguard code."""


def build_error(exc: BaseException) -> str:
    """One line of ``exc`` for :data:`BUILD_ERRORS`, with its type where its text alone says little
    (``'gelu2'``)."""
    text = first_line(exc)
    return text if isinstance(exc, (ValueError, TypeError, ImportError)) else f"{type(exc).__name__} {text}"


def build_qlora(
    config: QLoRAConfig, spec: ModelSpec | None = None, sharded: bool = False, prepared: bool = True
) -> QLoRAModel:
    """Random-weight model -> 4-bit via ``BitsAndBytesConfig`` -> PEFT LoRA on all linear layers.

    Any architecture transformers builds with ``AutoModelForCausalLM``; one without sdpa attention
    (Gemma 2) runs eager, as ``from_pretrained`` would by default, and says so in ``notes``.
    ``sharded``: the FSDP + QLoRA recipe (:func:`bnb_4bit_config`, :func:`prepare_for_training`), for a model
    :mod:`vramguard.workload.sharding` then shards. ``prepared`` False: the 4-bit model as ``from_pretrained``
    loads it, without k-bit preparation and LoRA (TRL's SFTTrainer, handed a ``peft_config``, does its own).
    """
    config.validate()
    spec = spec or config.spec
    from vramguard.workload.vision import build_vision_qlora, is_vision_spec

    if is_vision_spec(spec):  # AutoModelForImageTextToText, the family's processor's rows (workload.vision)
        if sharded:
            raise UsageError(
                "vision-language models are measured on one device in vramguard's loop (--trainer loop) for now"
            )
        return build_vision_qlora(config, spec=spec, prepared=prepared).q  # type: ignore[no-any-return]
    from vramguard.workload.vision import refuse_tower_options

    refuse_tower_options(config)
    from transformers.utils import logging as hf_logging

    hf_config, model_class, attn, notes = resolve_attention(config, spec)
    refuse_kernel_experts(hf_config, spec.name)
    # a config's ``experts_implementation`` (e.g. "eager"): save_pretrained does not write it, so from_pretrained
    # is told it, as a user passes it (otherwise the checkpoint loads with transformers' default, grouped_mm)
    experts = getattr(hf_config, "_experts_implementation", None)
    asked = {"experts_implementation": experts} if experts is not None else {}
    compute_dtype = parse_dtype(config.compute_dtype)
    torch.manual_seed(config.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="vramguard-model-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # On a GPU the random weights are drawn there, in the compute dtype: an 8B model in seconds,
        # where fp32 on the CPU takes minutes and twice the disk. The CPU path stays as it was (its
        # random weights, and every number measured from them, are reproducible across releases).
        try:
            if torch.device(config.device).type == "cuda":
                with torch.device(config.device):
                    random_model = model_class._from_config(hf_config, dtype=compute_dtype)
            else:
                random_model = model_class(hf_config)
        except BUILD_ERRORS as exc:  # the config asks what transformers cannot build
            raise UsageError(f"transformers cannot build {spec.name}: {build_error(exc)}") from None
        random_model.save_pretrained(tmp)
        del random_model
        quant = bnb_4bit_config(config, sharded=sharded)
        model = model_class.from_pretrained(
            tmp,
            quantization_config=quant,
            **_placement(config),
            dtype=compute_dtype,
            attn_implementation=attn,
            **asked,
        )
        if prepared:
            model = prepare_for_training(model, config, sharded=sharded)
            model = with_lora(model, config)
    model.train()
    model.config.use_cache = False
    loaded = getattr(model, "config", hf_config)  # from_pretrained set its experts implementation there
    notes += [line for line in (weights_line(model, loaded), routing_line(loaded)) if line]
    return QLoRAModel(model=model, spec=spec, config=config, attn_implementation=attn, notes=tuple(notes))
