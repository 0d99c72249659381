"""Float64 references: the exact function a quantized layer claims to compute, through plain autograd.

Why: the quantized layers are compared with *their own* dequantized weight (the library's
``dequantize_4bit`` / int8 rows times row scales), not with the original unquantized weight. That
removes the quantization error from the comparison, so the only difference left is floating-point
rounding, and tolerances (:mod:`vramguard.tolerance`) can be tight enough to see a 1 % gradient error.

Every function takes float64 leaf tensors (``requires_grad`` as the caller wants) and returns the
float64 output; the caller runs ``backward`` on it with the same upstream gradient as the layer.
"""

from __future__ import annotations

import torch


def dequantized_4bit_weight(packed: torch.Tensor, quant_state: object) -> torch.Tensor:
    """The [N, K] weight the 4-bit layer multiplies by, in float64 (library's ``dequantize_4bit``)."""
    import bitsandbytes.functional as bnbF

    with torch.no_grad():
        w = bnbF.dequantize_4bit(packed.detach().reshape(-1, 1), quant_state).to(torch.float64)
    # dequantize_4bit reads a packed tensor with shape[0] == 1 as transposed and returns out.t(): that is
    # the case of a one-byte weight (N*K <= 2), whose [(N*K+1)//2, 1] packing is [1, 1]
    shape = tuple(quant_state.shape)  # type: ignore[attr-defined]
    if tuple(w.shape) != shape and tuple(w.t().shape) == shape:
        w = w.t()
    return w


def dequantized_8bit_weight(cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of an LLM.int8() layer: int8 rows times their absmax / 127, in float64."""
    return cb.detach().to(torch.float64) * (scb.detach().to(torch.float64).unsqueeze(1) / 127.0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + b`` in float64 (any leading batch dims)."""
    out = x @ weight.T
    return out + bias if bias is not None else out


def int8_activation(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The activation MatMul8bitLt multiplies by: row-wise int8 quantized, outlier columns kept exact.

    Uses the library's own ``int8_vectorwise_quant`` on the fp16 cast (as MatMul8bitLt does), so the
    quantization is bit-identical; the result is differentiable w.r.t. ``x`` with the straight-through
    gradient (d/dx = identity), which is what MatMul8bitLt's backward implements.
    """
    import bitsandbytes.functional as bnbF

    x2 = x.detach().reshape(-1, x.shape[-1])
    ca, sca, outlier_cols = bnbF.int8_vectorwise_quant(x2.to(torch.float16), threshold=threshold)
    deq = ca.to(torch.float64) * (sca.to(torch.float64).unsqueeze(1) / 127.0)
    if outlier_cols is not None and outlier_cols.numel() > 0:
        deq[:, outlier_cols] = x2.to(torch.float64)[:, outlier_cols]
    deq = deq.reshape(x.shape)
    # straight-through: value of the quantized activation, gradient of the identity
    return x + (deq - x.detach())


def lora(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    dropout_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W_dq.T + b + scaling * (dropout(x) @ A.T) @ B.T`` with the dropout mask given explicitly.

    ``dropout_mask`` already carries the ``1/(1-p)`` factor (it is ``dropout(ones)``), so the reference
    uses the very mask the layer drew under the same seed.
    """
    dropped = x * dropout_mask if dropout_mask is not None else x
    return linear(x, base_weight, bias) + scaling * ((dropped @ lora_a.T) @ lora_b.T)
