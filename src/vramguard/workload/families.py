"""Model families: what a Hugging Face ``config.json`` is, and whether the analytic model knows it.

``--model`` accepts a Hugging Face ``config.json`` of any ``model_type`` transformers knows; the
model is built with ``AutoModelForCausalLM`` (random weights, 4-bit, PEFT) and measured like any
other. The analytic model (:mod:`vramguard.model.layers`) covers the families in :data:`FAMILIES`:
each is Llama's decoder layer plus the features listed here, and every feature is one term of the
per-layer formula, shared by every family that has it. A ``model_type`` missing here is measured
but gets no analytic model and no ratio (:class:`NoAnalyticModel`): a formula of another family is
never held against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramguard.errors import UsageError, first_line

LLAMA_ADAPTERS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
FUSED_ADAPTERS: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class NoAnalyticModel(Exception):
    """The analytic model does not cover this model/configuration; the message says why."""


@dataclass(frozen=True)
class Family:
    """A decoder-layer architecture the analytic model knows: Llama's layer plus these features."""

    name: str
    differs: str  # what differs from Llama, in words (the README table, the audit header)
    fused_qkv: bool = False  # one qkv_proj (LoRA on the fused projection); v is a view of its output
    fused_gate_up: bool = False  # one gate_up_proj; gate and up are views of its output
    qk_norm: bool = False  # RMSNorm over each head of q and k (keeps their fp32 input and rsqrt)
    sandwich_norms: bool = False  # pre- and post-feedforward norms: four norms per layer
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight): keeps that fp32 vector per norm
    local_rope: bool = False  # sliding layers use their own rotary embedding (second cos/sin pair)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The projections the family's LoRA targets (``qkv_proj`` and ``gate_up_proj`` where the family fuses
        them)."""
        return FUSED_ADAPTERS if self.fused_qkv else LLAMA_ADAPTERS


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "the reference"),
    "mistral": Family(
        "Mistral",
        "nothing kept differs while seq <= sliding window (longer: sdpa keeps a mask and k/v repeated "
        "to all heads, in every family)",
    ),
    "qwen2": Family("Qwen2", "nothing kept differs (q/k/v biases are frozen and keep nothing)"),
    "qwen3": Family("Qwen3", "q/k RMSNorm per head: their fp32 inputs and rsqrt", qk_norm=True),
    "phi3": Family(
        "Phi-3",
        "fused qkv_proj and gate_up_proj (4 adapters, not 7); v keeps the whole qkv output alive; "
        "o_proj's input is a copy of the attention output (sdpa)",
        fused_qkv=True,
        fused_gate_up=True,
    ),
    "gemma2": Family(
        "Gemma 2",
        "four norms per layer, each keeping (1 + weight); attention logits soft-capped (tanh kept); "
        "final logits soft-capped; eager attention (no sdpa in transformers)",
        sandwich_norms=True,
        norm_offset=True,
    ),
    "gemma3_text": Family(
        "Gemma 3",
        "four norms per layer, each keeping (1 + weight); q/k RMSNorm per head; "
        "local and global rotary embeddings (two cos/sin pairs)",
        qk_norm=True,
        sandwich_norms=True,
        norm_offset=True,
        local_rope=True,
    ),
}

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ZERO_EXPERTS_FAIL = frozenset({"mixtral"})
"""Model types transformers builds with 0 experts and then fails at the first forward (Mixtral's router: "k
not in range"); Qwen2/3-MoE and GraniteMoeHybrid read 0 experts as a dense model."""


def family(model_type: str) -> Family | None:
    """The family of a transformers ``model_type``, or None for one without an analytic model."""
    return FAMILIES.get(model_type)


def is_hf_config(data: dict[str, Any]) -> bool:
    """A Hugging Face ``config.json`` names its ``model_type``; vramguard's Llama presets do not."""
    return "model_type" in data


def transformers_config(data: dict[str, Any]) -> Any:
    """The transformers config object of a ``config.json`` dict (``AutoConfig.for_model``)."""
    import warnings

    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    d = dict(data)
    model_type = d.pop("model_type")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # e.g. token ids outside a tiny vocabulary: not our business
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.for_model(model_type, **d)
    finally:
        hf_logging.set_verbosity(level)


def _value(config: Any, key: str) -> Any:
    return getattr(config, key, None)


def spec_from_hf(path: Path | str, data: dict[str, Any]) -> tuple[str, dict[str, Any], Any]:
    """(model_type, the shape fields vramguard uses, the transformers config) of a Hugging Face ``config.json``.

    transformers parses the file (its own defaults and checks); unknown model types, models whose code is
    the repository's own (``trust_remote_code``) and shapes the build would fail on are one-line
    :class:`UsageError`. Mixtures of experts are measured as they load (:func:`experts_of`).
    """
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"model config {path}: model_type must be a non-empty string, got {model_type!r}")
    try:
        config = transformers_config(data)
    except ValueError as exc:
        if "auto_map" in data and ("Unrecognized model" in str(exc) or "model_type" in str(exc)):
            raise UsageError(
                f"model config {path}: model_type {model_type!r} is the repository's own code (auto_map), which "
                f"needs trust_remote_code; vramguard runs no remote code, and transformers {_tf()} does not know it"
            ) from None
        if "Unrecognized model" in str(exc) or "model_type" in str(exc):
            raise UsageError(
                f"model config {path}: model_type {model_type!r} is not known to transformers {_tf()}"
            ) from None
        raise UsageError(f"model config {path}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001  (transformers' own validation: strict dataclass errors too)
        raise UsageError(f"model config {path}: {_last_line(exc)}") from None
    from vramguard.workload.vision import is_vision_config, vision_shape

    if is_vision_config(data):  # the language model's shape is under text_config (workload.vision)
        return model_type, vision_shape(path, config).text, config
    fields: dict[str, Any] = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        value = _value(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(f"model config {path}: {key} must be a positive integer, got {value!r}")
        fields[key] = value
    kv = _value(config, "num_key_value_heads")
    kv = fields["num_attention_heads"] if kv is None else kv  # 0 is no head count (it was taken for "unset")
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or fields["num_attention_heads"] % kv:
        raise UsageError(
            f"model config {path}: num_key_value_heads must be a positive divisor of num_attention_heads, "
            f"got {kv!r}"
        )
    fields["num_key_value_heads"] = kv
    head_dim = _value(config, "head_dim")
    if head_dim is None:
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise UsageError(f"model config {path}: hidden_size is not a multiple of num_attention_heads")
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise UsageError(f"model config {path}: head_dim must be a positive even integer, got {head_dim!r}")
    fields["head_dim"] = head_dim
    fields["tie_word_embeddings"] = bool(_value(config, "tie_word_embeddings"))
    for key in (*MOE_KEYS, "num_experts_per_tok"):
        value = _value(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise UsageError(f"model config {path}: {key} must be a whole number, got {value!r}")
    count = next((_value(config, k) for k in MOE_KEYS if _value(config, k)), 0)
    top_k = _value(config, "num_experts_per_tok")
    if model_type in ZERO_EXPERTS_FAIL and not count and any(_value(config, k) == 0 for k in MOE_KEYS):
        raise UsageError(f"model config {path}: no experts to route each token's {top_k} to")
    if count and top_k is not None and not 0 < top_k <= count:
        raise UsageError(
            f"model config {path}: num_experts_per_tok must be between 1 and the {count} experts, got {top_k}"
        )
    return model_type, fields, config


@dataclass(frozen=True)
class Experts:
    """The mixture of experts of a config: how many experts, how many each token is routed to, and the
    intermediate size of one expert."""

    count: int
    top_k: int
    intermediate: int


def experts_of(config: Any) -> Experts | None:
    """The :class:`Experts` of a transformers config, or None for a dense model.

    transformers (5.x) keeps the experts of Mixtral, Qwen3-MoE, OLMoE, gpt-oss and the like as fused 3-D
    parameters (``mlp.experts.gate_up_proj``), which ``BitsAndBytesConfig(load_in_4bit=True)`` does not
    quantize (it replaces ``nn.Linear`` only): such a "4-bit" model loads with its experts in the dtype it
    is loaded in. That is what users get, and what is measured (see
    :func:`vramguard.workload.models.weights_line`).
    """
    count = next((getattr(config, k) for k in MOE_KEYS if isinstance(getattr(config, k, None), int)), 0)
    if not count or count < 2:
        return None
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1
    intermediate = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0)
    return Experts(count=int(count), top_k=int(top_k), intermediate=int(intermediate))


def layer_windows(config: Any, num_layers: int) -> list[int | None]:
    """The sliding-window size of each layer's attention (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or window <= 0:
        return [None] * num_layers
    if isinstance(types, (list, tuple)) and len(types) == num_layers:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [window] * num_layers


def analytic_features(model_type: str, config: Any, seq: int, attn: str) -> tuple[Family, dict[str, Any]]:
    """The family and the config-dependent features of its formula, or :class:`NoAnalyticModel`."""
    fam = family(model_type)
    if fam is None:
        raise NoAnalyticModel(f"no analytic model for {model_type}")
    n = int(config.num_hidden_layers)
    windows = layer_windows(config, n)
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise NoAnalyticModel(f"no analytic model for {model_type} with partial_rotary_factor {partial}")
    attn_cap = getattr(config, "attn_logit_softcapping", None)
    final_cap = getattr(config, "final_logit_softcapping", None)
    if attn_cap is not None and attn != "eager":
        raise NoAnalyticModel(f"no analytic model for {model_type} with attention soft-capping under {attn}")
    # the rotary embedding each layer uses: layers sharing one share its cos/sin (kept by the first)
    rope = ["local" if fam.local_rope and w is not None else "global" for w in windows]
    return fam, {
        "attn_softcap": attn_cap is not None,
        "final_softcap": final_cap is not None,
        "rope": rope,
        # layers whose window is shorter than the sequence get a materialised mask
        "window_mask": [w is not None and w < seq for w in windows],
    }


def _tf() -> str:
    import transformers

    return transformers.__version__


def _last_line(exc: BaseException) -> str:
    """The cause at the end of a (possibly wrapped, multi-line) validation message."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return text[-1] if text else type(exc).__name__


__all__ = [
    "FAMILIES",
    "Experts",
    "Family",
    "NoAnalyticModel",
    "analytic_features",
    "experts_of",
    "family",
    "is_hf_config",
    "layer_windows",
    "spec_from_hf",
    "transformers_config",
]
