"""Small QLoRA models built from configs with random weights: nothing is ever downloaded.

The model goes through the same path a user's does: transformers' ``from_pretrained`` with a
``BitsAndBytesConfig`` (from a checkpoint of random weights written to a temporary directory),
PEFT's ``prepare_model_for_kbit_training`` and ``get_peft_model`` with LoRA on all linear
projections. What is measured is therefore the libraries' real code, not a re-implementation.
"""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.workload.families import is_hf_config, moe_refusal, spec_from_hf, transformers_config

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


@dataclass(frozen=True)
class ModelSpec:
    """A model config: preset name or JSON path, resolved to its shape fields.

    Either vramguard's Llama preset format, or a Hugging Face ``config.json`` (it has a
    ``model_type``; kept whole in ``hf`` and built with ``AutoModelForCausalLM``).
    """

    name: str
    fields: dict[str, Any]
    model_type: str = "llama"
    hf: dict[str, Any] | None = None

    @classmethod
    def load(cls, ref: str | Path) -> ModelSpec:
        """The spec of a preset name or a JSON path (a vramguard preset or a Hugging Face config.json); a
        missing, binary, oversized or malformed file is a UsageError."""
        path = Path(ref)
        if not (path.suffix == ".json" or path.exists()):
            known = presets()
            if str(ref) not in known:
                raise UsageError(
                    f"unknown model {str(ref)!r}: use a preset ({', '.join(known)}) or a JSON path"
                )
            path = known[str(ref)]
        try:
            with path.open("rb") as fh:
                raw = fh.read(MAX_CONFIG_BYTES + 1)
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
        if not isinstance(data, dict):
            raise UsageError(f"model config {path} must be a JSON object")
        if is_hf_config(data):
            model_type, hf_fields = spec_from_hf(path, data)
            return cls(name=path.stem, fields=hf_fields, model_type=model_type, hf=data)
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
        return cls(name=path.stem, fields=fields)

    def llama_config(self, attn_implementation: str = "sdpa") -> Any:
        """The transformers ``LlamaConfig`` of a Llama preset, with the attention implementation set."""
        from transformers import LlamaConfig

        config = LlamaConfig(**self.fields)
        config._attn_implementation = attn_implementation
        return config

    def transformers_config(self) -> Any:
        """The transformers config to build: the Hugging Face config itself, or a LlamaConfig."""
        return transformers_config(self.hf) if self.hf is not None else self.llama_config()

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head (``head_dim`` when the config has it, else hidden size over heads)."""
        return int(
            self.fields.get("head_dim") or self.fields["hidden_size"] // self.fields["num_attention_heads"]
        )


METHODS: tuple[str, ...] = ("qlora", "lora", "full")
"""qlora: 4-bit base + LoRA (as ``vramguard audit``); lora: LoRA on a base in the compute dtype;
full: every parameter trained, in fp32 (fp32 weights, gradients and AdamW moments: 16 B/param)."""

OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit", "paged-adamw-8bit")
"""adamw: ``torch.optim.AdamW`` (what the audit uses); adamw-8bit: ``bitsandbytes.optim.AdamW8bit``
(two uint8 moments with blockwise absmax); paged-adamw-8bit: ``bitsandbytes.optim.PagedAdamW8bit``,
which is ``AdamW8bit(is_paged=True)``: the same state, but the two moments of every parameter with at
least :data:`vramguard.estimate.run.PAGED_MIN_NUMEL` elements live in CUDA unified memory
(``cudaMallocManaged``), which the driver pages to the host when the device runs short. Unified memory
cannot be had on meta or on a CPU, so the meta run runs ``AdamW8bit`` and
:func:`vramguard.estimate.run.paged_state_bytes` names the bytes that would be paged."""

STEP_OPTIONS: tuple[str, ...] = ("method", "optimizer", "offload_activations")
"""The fields of :class:`QLoRAConfig` that schema 1 of the JSON document stores under ``config.extra``."""


@dataclass(frozen=True)
class QLoRAConfig:
    """Everything that decides a QLoRA step's memory, as the user would set it: one typed field per
    parameter, named as its CLI flag (``--seq-len`` is ``seq_len``) and its JSON key.

    A new parameter is a field with its default, a check in :meth:`validate` and, where a command takes it,
    an option in :mod:`vramguard.cli.options`; the JSON document records every field (:meth:`to_dict`).
    ``method``, ``optimizer`` and ``offload_activations`` are the meta-run estimate's (the audit's loop
    always runs qlora with torch AdamW, nothing offloaded)."""

    model: str = "tiny-llama"
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
    method: str = "qlora"
    optimizer: str = "adamw"
    offload_activations: bool = False

    def validate(self) -> None:
        """Raise UsageError (one line) on a value that cannot run: sizes not positive, dropout outside [0, 1),
        a seed outside torch's range."""
        for name in ("seq_len", "batch", "lora_rank"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UsageError(f"lora dropout must be in [0, 1), got {self.lora_dropout}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"seed must be an integer, got {self.seed!r}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise UsageError(f"seed must be in [-2**63, 2**64 - 1] (torch's seed range), got {self.seed}")
        parse_dtype(self.compute_dtype)
        if self.quant_type not in ("nf4", "fp4"):
            raise UsageError(f"quant type must be nf4 or fp4, got {self.quant_type!r}")
        if self.method not in METHODS:
            raise UsageError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise UsageError(
                f"attention implementation must be sdpa or eager, got {self.attn_implementation!r}"
            )
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
        :data:`STEP_OPTIONS` under ``extra``: ``method`` and ``optimizer`` (and ``offload_activations`` when
        set) with ``step_options`` (the estimate's meta run, which chose them), none otherwise (the audit's
        loop: ``extra`` is empty)."""
        d = asdict(self)
        options = {name: d.pop(name) for name in STEP_OPTIONS}
        if not options["offload_activations"]:
            del options["offload_activations"]
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
        ids = ids.to(self.device)
        return {"input_ids": ids, "labels": ids}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates: the LoRA adapters."""
        return [p for p in self.model.parameters() if p.requires_grad]


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
    if attn == "sdpa" and not getattr(model_class, "_supports_sdpa", False):
        attn = "eager"
        notes.append(
            f"{model_class.__name__} has no sdpa attention in transformers: it ran eager attention "
            "(what from_pretrained picks by default)"
        )
    hf_config._attn_implementation = attn
    return hf_config, model_class, attn, notes


def bnb_4bit_config(config: QLoRAConfig, sharded: bool = False) -> Any:
    """The ``BitsAndBytesConfig`` a user passes to ``from_pretrained`` for ``config``'s 4-bit base; with
    ``sharded``, the FSDP + QLoRA recipe's: packed weights stored in the compute dtype
    (``bnb_4bit_quant_storage``), so a wrap unit has one dtype (:mod:`vramguard.workload.sharding`)."""
    from transformers import BitsAndBytesConfig

    extra = {"bnb_4bit_quant_storage": parse_dtype(config.compute_dtype)} if sharded else {}
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


def lora_config(config: QLoRAConfig) -> Any:
    """PEFT's ``LoraConfig`` for ``config``: rank, alpha, dropout, target modules, causal LM."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
        task_type="CAUSAL_LM",
    )


def refuse_unquantized(model: torch.nn.Module, spec: ModelSpec, hf_config: Any) -> None:
    """UsageError when 4-bit loading left parameters of 3+ dimensions unquantized (fused experts of a
    mixture of experts, which bitsandbytes does not quantize)."""
    unquantized = [
        n for n, p in model.named_parameters() if p.dim() >= 3 and getattr(p, "quant_state", None) is None
    ]
    if unquantized:
        raise UsageError(
            moe_refusal(spec.model_type, hf_config)
            or f"{spec.model_type}: parameters bitsandbytes does not quantize ({unquantized[0]}, ...)"
        )


def build_qlora(config: QLoRAConfig, spec: ModelSpec | None = None, sharded: bool = False) -> QLoRAModel:
    """Random-weight model -> 4-bit via ``BitsAndBytesConfig`` -> PEFT LoRA on all linear layers.

    Any architecture transformers builds with ``AutoModelForCausalLM``; one without sdpa attention
    (Gemma 2) runs eager, as ``from_pretrained`` would by default, and says so in ``notes``.
    ``sharded``: the FSDP + QLoRA recipe (:func:`bnb_4bit_config`, :func:`prepare_for_training`), for a model
    :mod:`vramguard.workload.sharding` then shards.
    """
    config.validate()
    spec = spec or ModelSpec.load(config.model)
    from peft import get_peft_model
    from transformers.utils import logging as hf_logging

    hf_config, model_class, attn, notes = resolve_attention(config, spec)
    compute_dtype = parse_dtype(config.compute_dtype)
    torch.manual_seed(config.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="vramguard-model-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # On a GPU the random weights are drawn there, in the compute dtype: an 8B model in seconds,
        # where fp32 on the CPU takes minutes and twice the disk. The CPU path stays as it was (its
        # random weights, and every number measured from them, are reproducible across releases).
        if torch.device(config.device).type == "cuda":
            with torch.device(config.device):
                random_model = model_class._from_config(hf_config, dtype=compute_dtype)
        else:
            random_model = model_class(hf_config)
        random_model.save_pretrained(tmp)
        del random_model
        quant = bnb_4bit_config(config, sharded=sharded)
        model = model_class.from_pretrained(
            tmp,
            quantization_config=quant,
            device_map={"": config.device},
            dtype=compute_dtype,
            attn_implementation=attn,
        )
        refuse_unquantized(model, spec, hf_config)
        model = prepare_for_training(model, config, sharded=sharded)
        model = get_peft_model(model, lora_config(config))
    model.train()
    model.config.use_cache = False
    return QLoRAModel(model=model, spec=spec, config=config, attn_implementation=attn, notes=tuple(notes))
