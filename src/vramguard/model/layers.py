"""Analytic saved-tensor bytes, per layer, from shapes alone.

Every function here answers "how many bytes may this piece of a QLoRA training step keep alive
for backward?" from the model config and the step's shapes -- never from a measured number, so
a library version that keeps more fails against it.

Notation (all integers; bytes unless said otherwise)::

    b  batch            s  sequence length      T = b * s  tokens
    h  hidden size      a  attention heads      kv key/value heads      d head dim
    i  intermediate     r  LoRA rank            V vocabulary
    e  bytes per element of the activations (4 when PEFT's prepare_model_for_kbit_training has
       upcast the norms to fp32, which makes the whole residual stream fp32; 2 for bf16/fp16)
    m  bytes per element of a dropout mask (CPU: e, PyTorch multiplies by a mask in the input's
       dtype; CUDA: 1, native_dropout keeps a bool mask)

What one Llama decoder layer keeps (no checkpointing, LoRA on all 7 projections)::

    RMSNorm x2           2 * (T*h*4 + T*4)      fp32 input (the norm upcasts) and rsqrt
    normed hidden x2     2 * T*h*e              shared by q/k/v LoRA-A, and by gate/up LoRA-A
                                                (dropout 0 only: with dropout each adapter keeps
                                                its own dropped copy instead, see below)
    LoRA-B inputs        7 * T*r*e              the rank-r intermediate of each adapter
    attention, sdpa      T*a*d*e (q) + 2*T*kv*d*e (k, v) + T*a*d*e (out) + b*a*s*4 (logsumexp)
                         out is also o_proj's LoRA-A input (one storage); the kernel torch picks
                         (:func:`sdpa_kernel`) changes this: memory-efficient (CUDA) pads the
                         logsumexp to b*a*ceil32(s)*4; math (CUDA: fp32 attention with fewer k/v
                         heads) keeps q, k and v scaled/repeated to a heads (3*T*a*d*e), the
                         softmax output b*a*s*s*e and o_proj's input (a copy)
    attention, eager     T*a*d*e (q) + 2*T*a*d*e (k, v repeated to a heads) + T*a*d*e (o_proj
                         input; dropout 0 only) + b*a*s*s*4 (fp32 softmax) [+ b*a*s*s*e when
                         e != 4: the cast copy the second matmul keeps]
    MLP                  4 * T*i*e              silu input, both mul operands, down_proj input
                                                (dropout 0; with dropout the down_proj input is
                                                not kept, the adapter's dropped copy is)
    LoRA dropout p > 0   sum over adapters of T*in*(e + m): dropped input and mask, in = h for
                         q, k, v, gate, up; a*d for o; i for down (first layer: q, k, v keep
                         no mask, their input does not require grad)

Family features (:mod:`vramguard.workload.families`; each one term, the same for every family that has it)::

    qk_norm (Qwen3, Gemma 3)       q_norm T*a*d*4 + T*a*4, k_norm T*kv*d*4 + T*kv*4
    fused_qkv/gate_up (Phi-3)      4 adapters; v is a view of the qkv output, so sdpa keeps
                                   T*(a+2kv)*d*e for it; o_proj's input is a copy (sdpa, dropout 0)
    sandwich_norms (Gemma 2/3)     pre/post-feedforward norms: four norm terms per layer
    norm_offset (Gemma 2/3)        + h*4 per norm (the (1 + weight) vector), + d*4 per q/k norm
    attn_softcap (Gemma 2, eager)  + b*a*s*s*e (tanh output)
    window_mask (sdpa, sliding window < seq)
                                   k and v repeated to a heads + a (b, 1, s, s) mask per layer

The first layer (without checkpointing) keeps no input norm: the embedding output does not
require grad, so nothing upstream of the first LoRA needs the norm's input or rsqrt.

With non-reentrant gradient checkpointing a layer keeps its input hidden state only: T*h*e_h
(e_h = bytes of the residual stream, 4 after prepare_model_for_kbit_training).

The loss keeps the fp32 logits (log_softmax's output): 4*T*V, plus the int64 targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ADAPTERS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_ADAPTERS: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FP32 = 4


@dataclass(frozen=True)
class LayerShape:
    """Everything the per-layer formula needs."""

    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rank: int
    act_bytes: int = FP32
    dropout: bool = False
    mask_bytes: int = FP32
    attn: str = "sdpa"
    first_layer: bool = False
    # family features (vramguard.workload.families), all off for Llama
    fused_qkv: bool = False
    fused_gate_up: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: bool = False
    attn_softcap: bool = False
    window_mask: bool = False  # a sliding window shorter than seq: attention gets an explicit mask
    sdpa_kernel: str = "flash"  # the kernel scaled_dot_product_attention runs (see sdpa_kernel())

    @property
    def adapters(self) -> tuple[str, ...]:
        """The projections that carry a LoRA adapter in this layer (fused q/k/v when the family fuses them)."""
        return FUSED_ADAPTERS if self.fused_qkv else ADAPTERS

    @property
    def tokens(self) -> int:
        """Tokens in one step: batch times sequence length."""
        return self.batch * self.seq

    def to_dict(self) -> dict[str, Any]:
        """The shape as JSON (the audit records it beside the per-layer terms)."""
        return asdict(self)


def adapter_in_features(shape: LayerShape) -> dict[str, int]:
    """Input width of each LoRA adapter of a decoder layer."""
    h, i, ad = shape.hidden, shape.intermediate, shape.heads * shape.head_dim
    if shape.fused_qkv:
        return {"qkv_proj": h, "o_proj": ad, "gate_up_proj": h, "down_proj": i}
    return {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": ad, "gate_proj": h, "up_proj": h, "down_proj": i}


def lora_adapter_bytes(
    tokens: int, in_features: int, rank: int, act_bytes: int, dropout: bool, mask_bytes: int
) -> int:
    """New bytes one LoRA adapter keeps beyond its (caller-owned) input.

    dropout 0: the rank-r intermediate (LoRA-B's input), T*r*e; LoRA-A keeps the caller's input
    storage itself, which costs nothing new. dropout > 0: also the dropped copy and its mask.
    """
    out = tokens * rank * act_bytes
    if dropout:
        out += tokens * in_features * (act_bytes + mask_bytes)
    return out


def layer_terms(shape: LayerShape) -> dict[str, int]:
    """Bytes a decoder layer keeps, term by term (names as in the module docstring).

    Llama's layer; each family feature of the shape (:mod:`vramguard.workload.families`) adds or changes
    the terms marked with it, the same way for every family that has it.
    """
    T, h, e = shape.tokens, shape.hidden, shape.act_bytes
    a, kv, d, i = shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    b, s = shape.batch, shape.seq
    terms: dict[str, int] = {}
    # norm_offset (Gemma): the norm multiplies by (1 + weight), an fp32 vector its mul keeps
    offset = h * FP32 if shape.norm_offset else 0
    norm = T * h * FP32 + T * FP32 + offset
    terms["input_layernorm"] = 0 if shape.first_layer else norm
    terms["post_attention_layernorm"] = norm
    if shape.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
        terms["pre_feedforward_layernorm"] = norm
        terms["post_feedforward_layernorm"] = norm
    if not shape.dropout:
        terms["normed_hidden(q,k,v)"] = T * h * e
        terms["normed_hidden(gate,up)"] = T * h * e
    terms["lora_B_inputs"] = len(shape.adapters) * T * shape.rank * e
    if shape.qk_norm:  # RMSNorm over each head of q and of k: fp32 input and rsqrt (+ (1 + weight))
        head_offset = d * FP32 if shape.norm_offset else 0
        terms["q_norm"] = T * a * d * FP32 + T * a * FP32 + head_offset
        terms["k_norm"] = T * kv * d * FP32 + T * kv * FP32 + head_offset
    # fused_qkv: v is a view of the fused qkv output, so whoever keeps v keeps all of it
    v_sdpa = T * (a + 2 * kv) * d * e if shape.fused_qkv else T * kv * d * e
    if shape.attn == "sdpa" and shape.sdpa_kernel == "math":
        # the composite: q and k each times sqrt(scale) (k repeated to a heads first, as enable_gqa
        # asks), q @ k^T keeps both, the softmax and probs @ v keep the probabilities and v (repeated)
        # fp16/bf16 inputs are upcast to fp32 first (torch's default: no reduced-precision math sdpa),
        # so the composite's own tensors are fp32 whatever e is; its output comes back in e
        m = FP32
        terms["attn_q(scaled)"] = T * a * d * m
        terms["attn_k(repeated, scaled)"] = T * a * d * m
        terms["attn_v(repeated)"] = T * a * d * m if (kv != a or e != m) else v_sdpa
        if not shape.dropout:  # the kernel keeps no output: only o_proj's LoRA-A keeps its input
            terms["attn_out(o_proj input)"] = T * a * d * e
        terms["attn_probs"] = b * a * s * s * m
    elif shape.attn == "sdpa":
        terms["attn_q"] = T * a * d * e
        if shape.window_mask:
            # with an explicit mask transformers repeats k and v to a heads itself (no GQA in the
            # kernel): copies, except when kv == a (then v is still the projection's output)
            terms["attn_kv"] = T * a * d * e + (T * a * d * e if kv != a else v_sdpa)
            # and the CPU kernel keeps its own float copy of the (b, 1, s, s) boolean mask per layer
            terms["attn_window_mask"] = b * s * s * e
        else:
            terms["attn_kv"] = T * kv * d * e + v_sdpa
        terms["attn_out(o_proj input)"] = T * a * d * e
        if shape.fused_qkv and not shape.dropout:
            # q from the fused output is not dense, so rotary makes it contiguous (b, a, s, d) and
            # the attention output is too: o_proj's input is a transposed copy, kept by its LoRA-A
            terms["o_proj input (copy)"] = T * a * d * e
        # the memory-efficient kernel allocates its logsumexp in whole blocks of 32 queries
        lse_rows = -(-s // 32) * 32 if shape.sdpa_kernel == "efficient" else s
        terms["attn_logsumexp"] = b * a * lse_rows * FP32
    elif shape.attn == "eager":
        terms["attn_q"] = T * a * d * e
        # k and v repeated to a heads; the matmuls flatten (b, a) of a non-contiguous k/v, which
        # copies them, so each is T*a*d*e even when kv == a or v is a view of the fused qkv output
        terms["attn_kv_repeated"] = 2 * T * a * d * e
        if not shape.dropout:  # kept only by o_proj's LoRA-A, which then keeps its dropped copy instead
            terms["attn_out(o_proj input)"] = T * a * d * e
        terms["attn_probs"] = b * a * s * s * FP32 + (b * a * s * s * e if e != FP32 else 0)
        if shape.attn_softcap:  # Gemma 2: tanh(scores / cap) * cap keeps tanh's output
            terms["attn_softcap(tanh)"] = b * a * s * s * e
    else:
        raise ValueError(f"unknown attention implementation {shape.attn!r}")
    # fused_gate_up: silu keeps the whole (T, 2i) output (gate is a view), which covers up's operand
    terms["mlp"] = (4 if not shape.dropout else 3) * T * i * e
    if shape.dropout:
        for name, fin in adapter_in_features(shape).items():
            # the first layer's q/k/v input needs no grad: dropout keeps no mask for it
            first = name in ("q_proj", "k_proj", "v_proj", "qkv_proj")
            mask = 0 if shape.first_layer and first else shape.mask_bytes
            terms[f"lora_dropout({name})"] = T * fin * (e + mask)
    return terms


SDPA_KERNELS: tuple[str, ...] = ("flash", "efficient", "math")


def sdpa_kernel(
    target: str, act_bytes: int, heads: int, kv_heads: int, head_dim: int, explicit_mask: bool
) -> str:
    """The kernel torch's ``scaled_dot_product_attention`` runs for a decoder layer's attention.

    transformers passes k and v with their ``kv_heads`` and ``enable_gqa=True`` when it passes no
    mask; with a mask it repeats them to ``heads`` itself (so the kernel sees equal heads). On the
    CPU torch takes its flash kernel for every dtype, fewer k/v heads included. On CUDA, torch's
    rules (sm80+): flash needs fp16/bf16, no explicit mask and a head dim of at most 256 (padded to
    a multiple of 8 by torch); the memory-efficient kernel takes fp32 and masks but only the same
    number of heads for q, k and v; anything else runs the math composite. Measured on an H100
    (torch 2.11, docs/measurements/): the fp32 cases, which are QLoRA's, since the attention runs in
    the residual stream's dtype (``act_bytes``) and PEFT's ``prepare_model_for_kbit_training`` makes
    that fp32: a GQA model's attention is the math composite there, an equal-heads one memory-
    efficient. Inferred from torch's rules, not yet seen on a GPU: the fp16/bf16 rows. Not modelled:
    GPUs before sm80 (no flash), sm86/89's refusal of flash with gradients for head dims over 192,
    and torch builds that prefer cuDNN attention.
    """
    if target != "cuda":
        return "flash"
    if act_bytes == 2 and not explicit_mask and head_dim <= 256:
        return "flash"
    if kv_heads == heads:
        return "efficient"
    return "math"


def layer_saved_bytes(shape: LayerShape) -> int:
    """Total bytes one decoder layer keeps for backward (see :func:`layer_terms`)."""
    return sum(layer_terms(shape).values())


def rope_bytes(batch_cos: int, seq: int, head_dim: int) -> int:
    """cos and sin, fp32, computed once per forward and shared by all layers: 2*b'*s*d*4."""
    return 2 * batch_cos * seq * head_dim * FP32


def checkpointed_layer_bytes(batch: int, seq: int, hidden: int, act_bytes: int = FP32) -> int:
    """A layer under non-reentrant checkpointing keeps its input hidden state only."""
    return batch * seq * hidden * act_bytes


def logits_fp32_bytes(batch: int, seq: int, vocab: int) -> int:
    """The fp32 logits the loss keeps (log_softmax's output): 4 x batch x seq x vocab."""
    return FP32 * batch * seq * vocab


def shape_from(
    spec_fields: dict[str, Any],
    *,
    batch: int,
    seq_len: int,
    lora_rank: int,
    act_bytes: int = FP32,
    dropout: bool = False,
    mask_bytes: int = FP32,
    attn: str = "sdpa",
    first_layer: bool = False,
    target: str = "cpu",
    **features: bool,
) -> LayerShape:
    """A :class:`LayerShape` from a model config's fields (``ModelSpec.fields``); ``features``:
    the family's (``fused_qkv``, ``qk_norm``, ... as in :class:`LayerShape`). ``target`` (the device whose kernels run) decides
    the attention kernel (:func:`sdpa_kernel`)."""
    h = int(spec_fields["hidden_size"])
    a = int(spec_fields["num_attention_heads"])
    kv = int(spec_fields.get("num_key_value_heads") or a)
    d = int(spec_fields.get("head_dim") or h // a)
    mask = bool(features.get("window_mask", False))
    # with a mask transformers repeats k and v to a heads before the kernel
    kernel = sdpa_kernel(target, act_bytes, a, a if mask else kv, d, mask)
    return LayerShape(
        batch=batch,
        seq=seq_len,
        hidden=h,
        heads=a,
        kv_heads=kv,
        head_dim=d,
        sdpa_kernel=kernel,
        intermediate=int(spec_fields["intermediate_size"]),
        rank=lora_rank,
        act_bytes=act_bytes,
        dropout=dropout,
        mask_bytes=mask_bytes,
        attn=attn,
        first_layer=first_layer,
        **features,
    )
