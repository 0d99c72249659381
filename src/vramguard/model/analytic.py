"""The analytic memory model of a QLoRA step, itemised so a measurement can be held against it.

Bytes, for N quantized parameters and M LoRA parameters (the brief's model, made exact):

* 4-bit weights: N/2 packed bytes, plus the absmax of every ``blocksize`` block: 4 B (fp32) per
  block, or with double quantization 1 B per block plus 4 B per 256 blocks (0.5625 and ~0.516
  B/param at blocksize 64), plus small per-layer code tables (:func:`quantized_weight_bytes`);
* LoRA: 16 M (fp32 weight 4, gradient 4, Adam's two moments 8);
* parameters left unquantized (embeddings, norms, lm_head) at their own dtype;
* activations per decoder layer, term by term (:func:`vramguard.model.layers.layer_terms`, the one
  place the per-layer formula lives);
* fp32 logits kept by the loss's log-softmax: 4·b·s·vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from vramguard.model.layers import (
    checkpointed_layer_bytes,
    layer_terms,
    logits_fp32_bytes,
    rope_bytes,
    shape_from,
)
from vramguard.workload.families import NoAnalyticModel, analytic_features, experts_of
from vramguard.workload.models import ModelSpec, QLoRAConfig

QUANT_BLOCKSIZE = 64
DOUBLE_QUANT_GROUP = 256


def quantized_weight_bytes(n: int, blocksize: int = QUANT_BLOCKSIZE, double_quant: bool = True) -> int:
    """Bytes of one 4-bit weight of ``n`` elements with its quantization state, exactly as
    bitsandbytes stores it: packed nibbles, one absmax per block (fp32, or uint8 with double
    quantization plus an fp32 absmax per 256 blocks, a 256-entry fp32 code and an fp32 offset),
    and the 16-entry fp32 code of the 4-bit data type."""
    blocks = -(-n // blocksize)
    code = 16 * 4
    if double_quant:
        groups = -(-blocks // DOUBLE_QUANT_GROUP)
        absmax = blocks * 1 + groups * 4 + DOUBLE_QUANT_GROUP * 4 + 4
    else:
        absmax = blocks * 4
    return -(-n // 2) + absmax + code


#: LoRA training state per trainable parameter: fp32 weight, gradient and two Adam moments.
LORA_TRAINING_BYTES_PER_PARAM = 16


@dataclass
class Expectation:
    """The analytic model for one configuration, in bytes: the weights and LoRA training state (zero in an
    activations-only expectation, until :meth:`with_weights` adds them) and the activations kept for backward,
    per layer and outside the layers."""

    quantized_params: int = 0
    other_params: int = 0
    lora_params: int = 0
    quantized_weight_bytes: int = 0
    other_weight_bytes: int = 0
    lora_training_bytes: int = 0
    layer_terms: list[dict[str, int]] = field(default_factory=list)
    shared_bytes: int = 0  # outside the layers, besides the logits: final norm, loss targets
    logits_bytes: int = 0
    family: str | None = None  # the family whose formula this is (vramguard.workload.families)
    no_analytic_model: str | None = None  # why there is no activation model (weights only), or None

    def with_weights(
        self, quantized: int, quantized_bytes: int, other: int, other_bytes: int, lora: int
    ) -> Expectation:
        """This expectation with the parameters counted: ``quantized`` 4-bit parameters in ``quantized_bytes``,
        ``other`` unquantized ones in ``other_bytes``, ``lora`` trainable LoRA parameters, each with its
        weight, gradient and two Adam moments in fp32 (16 B)."""
        return replace(
            self,
            quantized_params=quantized,
            other_params=other,
            lora_params=lora,
            quantized_weight_bytes=quantized_bytes,
            other_weight_bytes=other_bytes,
            lora_training_bytes=LORA_TRAINING_BYTES_PER_PARAM * lora,
        )

    @property
    def layer_bytes(self) -> list[int]:
        """Saved activation bytes of each decoder layer (the sum of its terms)."""
        return [sum(t.values()) for t in self.layer_terms]

    @property
    def activation_bytes(self) -> int:
        """Every activation byte kept for backward: the layers, the shared state and the fp32 logits."""
        return sum(self.layer_bytes) + self.shared_bytes + self.logits_bytes

    @property
    def weights_bytes(self) -> int:
        """Frozen weights as stored: the 4-bit ones with their quantization state, and the others."""
        return self.quantized_weight_bytes + self.other_weight_bytes

    @property
    def total_bytes(self) -> int:
        """Weights, LoRA training state and activations: the least one training step needs."""
        return self.weights_bytes + self.lora_training_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        """The fields and the derived totals, as the audit's JSON records them."""
        d = asdict(self)
        d.update(
            layer_bytes=self.layer_bytes,
            activation_bytes=self.activation_bytes,
            weights_bytes=self.weights_bytes,
            total_bytes=self.total_bytes,
        )
        return d


def _count(model: torch.nn.Module, double_quant: bool) -> tuple[int, int, int, int, int, torch.dtype]:
    """(quantized params, their bytes, other params, other bytes, LoRA params, residual-stream dtype)."""
    quantized = quantized_bytes = other = other_bytes = lora = 0
    norm_dtype: torch.dtype | None = None
    for name, p in model.named_parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            n = int(torch.Size(qs.shape).numel())
            quantized += n
            quantized_bytes += quantized_weight_bytes(
                n, int(getattr(qs, "blocksize", QUANT_BLOCKSIZE)), double_quant
            )
        elif p.requires_grad:
            lora += p.numel()
        else:
            other += p.numel()
            other_bytes += p.numel() * p.element_size()
            if norm_dtype is None and "norm" in name:
                norm_dtype = p.dtype
    return quantized, quantized_bytes, other, other_bytes, lora, norm_dtype or torch.float32


def weights_expectation(model: torch.nn.Module, *, double_quant: bool = True, reason: str) -> Expectation:
    """Weights and LoRA training state only (exact for any architecture: they are counted from the
    model's own parameters), for a model whose activations have no analytic model (``reason``)."""
    n_q, q_bytes, n_other, other_bytes, m, _ = _count(model, double_quant)
    return Expectation(no_analytic_model=reason).with_weights(n_q, q_bytes, n_other, other_bytes, m)


def qlora_expectation(
    model: torch.nn.Module,
    spec: ModelSpec,
    *,
    batch: int,
    seq_len: int,
    lora_rank: int,
    compute_dtype: torch.dtype,
    double_quant: bool = True,
    checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    lora_dropout: bool = False,
    target: str = "cpu",
    explicit_mask: bool = False,
) -> Expectation:
    """The expectation of ``model`` (a built QLoRA model) for one training step.

    Raises :class:`vramguard.workload.families.NoAnalyticModel` for a family (or configuration) the
    analytic model does not cover: then there is no expectation to compare against.
    """
    n_q, q_bytes, n_other, other_bytes, m, norm_dtype = _count(model, double_quant)
    act_bytes = torch.empty((), dtype=torch.promote_types(norm_dtype, compute_dtype)).element_size()
    activations = activation_expectation(
        spec,
        batch=batch,
        seq_len=seq_len,
        lora_rank=lora_rank,
        act_bytes=act_bytes,
        checkpointing=checkpointing,
        attn_implementation=attn_implementation,
        lora_dropout=lora_dropout,
        target=target,
        explicit_mask=explicit_mask,
    )
    return activations.with_weights(n_q, q_bytes, n_other, other_bytes, m)


def activation_expectation(
    spec: ModelSpec,
    *,
    batch: int,
    seq_len: int,
    lora_rank: int,
    act_bytes: int = 4,
    checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    lora_dropout: bool = False,
    target: str = "cpu",
    explicit_mask: bool = False,
) -> Expectation:
    """The saved activations of one step from the config alone (weights left at 0): an estimate
    for shapes never built, e.g. the full-size presets. ``act_bytes`` 4: the residual stream is
    fp32 after ``prepare_model_for_kbit_training`` (it upcasts the norms). ``explicit_mask``: sdpa gets
    an explicit causal mask in every layer (transformers 4.56-4.57 for a batch without attention_mask),
    which costs what a sliding-window mask does."""
    fam, arch = analytic_features(spec.model_type, spec.transformers_config(), seq_len, attn_implementation)
    features = {
        "fused_qkv": fam.fused_qkv,
        "fused_gate_up": fam.fused_gate_up,
        "qk_norm": fam.qk_norm,
        "sandwich_norms": fam.sandwich_norms,
        "norm_offset": fam.norm_offset,
        "attn_softcap": arch["attn_softcap"],
    }
    f = spec.fields
    tokens = batch * seq_len
    layers: list[dict[str, int]] = []
    for idx in range(f["num_hidden_layers"]):
        if checkpointing:
            layers.append(
                {
                    "checkpointed layer input": checkpointed_layer_bytes(
                        batch, seq_len, f["hidden_size"], act_bytes
                    )
                }
            )
            continue
        shape = shape_from(
            f,
            batch=batch,
            seq_len=seq_len,
            lora_rank=lora_rank,
            act_bytes=act_bytes,
            dropout=lora_dropout,
            mask_bytes=1 if target == "cuda" else act_bytes,
            attn=attn_implementation,
            first_layer=idx == 0,  # the embeddings need no grad, so layer 0's input norm keeps nothing
            target=target,
            window_mask=(arch["window_mask"][idx] or explicit_mask) and attn_implementation == "sdpa",
            **features,
        )
        layers.append(layer_terms(shape))
    if not checkpointing:
        # cos/sin are computed once per forward and kept by the rotary muls of the first layer
        # using them; Gemma 3's sliding layers have a rotary embedding of their own
        for kind in dict.fromkeys(arch["rope"]):
            first = arch["rope"].index(kind)
            layers[first][f"rotary cos/sin ({kind}, shared by all layers)"] = rope_bytes(
                1, seq_len, spec.head_dim
            )
    final_norm = tokens * f["hidden_size"] * 4 + tokens * 4 + (f["hidden_size"] * 4 if fam.norm_offset else 0)
    # final_logit_softcapping (Gemma 2): tanh(logits / cap) * cap keeps tanh's output
    softcap = tokens * f["vocab_size"] * act_bytes if arch["final_softcap"] else 0
    # nll_loss keeps the int64 targets (labels padded by one position, then shifted and flattened:
    # still a view of the padded (1, s+1) storage for batch 1, a contiguous b*s copy otherwise)
    # and the fp32 total weight
    loss_state = ((seq_len + 1) if batch == 1 else batch * seq_len) * 8 + 4
    return Expectation(
        layer_terms=layers,
        shared_bytes=final_norm + loss_state + softcap,
        logits_bytes=logits_fp32_bytes(batch, seq_len, f["vocab_size"]),
        family=fam.name,
    )


def _projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) features of the seven linear projections of one Llama decoder layer."""
    f = spec.fields
    h, i, d = f["hidden_size"], f["intermediate_size"], spec.head_dim
    q, kv = f["num_attention_heads"] * d, f["num_key_value_heads"] * d
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def planned_expectation(config: QLoRAConfig, spec: ModelSpec) -> Expectation:
    """The analytic model of ``config`` from the model config alone, before anything is built.

    The activations are the family's own formula (:func:`activation_expectation`, norms in fp32 as
    ``prepare_model_for_kbit_training`` leaves them); for a family without one, a lower bound any
    decoder keeps (each layer's input hidden state and the fp32 logits). The parameters are counted
    from the shapes: the seven projections per layer in 4 bits (fused projections hold the same
    elements), embeddings, lm_head and norms in fp32, LoRA on every projection; for a mixture of experts,
    the four attention projections in 4 bits and the expert stacks and routers unquantized in fp32 (a
    lower bound: LoRA on the experts is left out). The tests hold it equal
    to the expectation of the built model.
    """
    f = spec.fields
    try:
        empty = activation_expectation(
            spec,
            batch=config.batch,
            seq_len=config.seq_len,
            lora_rank=config.lora_rank,
            checkpointing=config.gradient_checkpointing,
            attn_implementation=config.attn_implementation,
            lora_dropout=config.lora_dropout > 0,
            target=torch.device(config.device).type,
        )
    except NoAnalyticModel as exc:
        per_layer = checkpointed_layer_bytes(config.batch, config.seq_len, f["hidden_size"])
        empty = Expectation(
            layer_terms=[{"layer input (lower bound)": per_layer}] * f["num_hidden_layers"],
            logits_bytes=logits_fp32_bytes(config.batch, config.seq_len, f["vocab_size"]),
            no_analytic_model=str(exc),
        )
    layers, h, vocab = f["num_hidden_layers"], f["hidden_size"], f["vocab_size"]
    projections = _projections(spec)
    experts = experts_of(spec.transformers_config()) if spec.hf is not None else None
    stacks = 0
    if (
        experts is not None
    ):  # the MLP is a stack of experts bitsandbytes leaves unquantized (fp32 once prepared)
        projections = projections[:4]
        stacks = layers * experts.count * (3 * h * experts.intermediate + h)  # + the router's row per expert
    quantized = layers * sum(i * o for i, o in projections)
    quantized_bytes = layers * sum(
        quantized_weight_bytes(i * o, QUANT_BLOCKSIZE, config.double_quant) for i, o in projections
    )
    embeddings = vocab * h * (1 if f.get("tie_word_embeddings", False) else 2)
    other = embeddings + (2 * layers + 1) * h + stacks  # + input, post-attention and final norms
    lora = layers * sum(config.lora_rank * (i + o) for i, o in projections)
    return empty.with_weights(quantized, quantized_bytes, other, 4 * other, lora)
