"""Tolerances for comparing a quantized layer with its float64 reference: the one place they are set.

Why a norm-wise bound: the reference (see :mod:`vramguard.grad.reference`) is the *exact* function the
quantized layer claims to compute, evaluated in float64 on the library's own dequantized weight. What
remains is floating-point rounding in the layer's dtype, so the error is compared as

    err = ||got - ref||_F / ||ref||_F         (absolute ||got||_F when ref is exactly zero)

against

    tol(dtype, K) = C_IO * u(dtype) + C_ACC * u(float32) * sqrt(K)

* ``u(dtype)`` is the unit roundoff (half the machine epsilon): fp16 2^-11, bf16 2^-8, fp32 2^-24.
  Inputs are exact in every dtype (the reference reads the very same values), so the error is made of a
  few roundings of intermediates and results to ``dtype`` -- the dequantized weight, the output, the
  casts PEFT does around the adapter -- each contributing at most ``u`` relative per element and, for the
  random data the strategies draw, about ``u/sqrt(3)`` norm-wise. That term does not grow with K.
* ``K`` is the reduction length of the quantity (in_features for the output, out_features for the
  input gradient, the number of rows for bias / LoRA / weight gradients). CPU and CUDA GEMMs and sums
  accumulate fp16/bf16 in float32, so accumulation contributes ``u(float32) * sqrt(K)`` (the
  probabilistic bound of Higham & Mary), negligible for fp16/bf16 and the dominant term for fp32.

Measured (200 examples per family on CPU; torch 2.13, bitsandbytes 0.50.2, peft 0.21.2): largest
err/u(dtype) 1.06 (fp16 3-D bias grad), 0.75 (bf16 4-bit output), 1.56 (bf16 outputs with N=1, where
base + bias/adapter partially cancel); fp32 err/(u32 sqrt K) <= 0.61. A quantity made of a few dot products
gets no averaging over elements: PEFT's LoRA A gradient from one row is the outer product of ``r`` sums of N
terms with x, so its norm-wise error is the error of those ``r`` sums. Over 1,500 random fp32 LoRA cases of
1-4 rows (N <= 64) the largest (err - C_IO u)/(u32 sqrt K) was 0.89 for that gradient (p99 0.38), and the
nightly profile found 1.12 (x(1,32) W(26,32) r=2 rsLoRA seed 26; the error of one 26-term sum, a tail of its
roughly normal distribution, not a defect: it fails the same way on every release). ``C_IO = 2.0``,
``C_ACC = 2.0`` (about 3.5 standard deviations of one such sum): bf16 tol 7.8e-3 + ~2e-6 stays below the
1e-2 that a 1 % scale error produces, in every dtype; fp32 tol at K = 4096 is 7.7e-6.
The denominator has a cancellation floor: the larger of ``||sum|terms| || / sqrt(K)`` and the terms'
root-sum-square, the size a sum of random-sign terms typically has and the scale of rounding each term's
weight to the layer dtype (see ``runner._expected_linear``; LLM.int8() outputs: the size of the partial
results it rounds before adding them).

Quantities that also depend on a *stochastic* step of the library (none today: the LLM.int8()
activation quantization is reproduced exactly by the reference) would need their own entry here.
"""

from __future__ import annotations

import math

import torch

#: multiple of the dtype's unit roundoff allowed (roundings of inputs/outputs; K-independent)
C_IO: float = 2.0
#: multiple of float32's unit roundoff times sqrt(K) allowed (float32 accumulation over K terms)
C_ACC: float = 2.0

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype``; raises for dtypes the layers do not compute in."""
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"no unit roundoff known for {dtype}") from None


def tolerance(dtype: torch.dtype, reduction_length: int) -> float:
    """Allowed norm-wise relative error of a quantity computed in ``dtype`` by summing ``K`` terms."""
    k = max(int(reduction_length), 1)
    return C_IO * unit_roundoff(dtype) + C_ACC * unit_roundoff(torch.float32) * math.sqrt(k)


def relative_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``||got - ref|| / max(||ref||, floor)`` in float64; the absolute ``||got - ref||`` when both are 0.

    ``floor`` guards against cancellation (see the module docstring); it never exceeds the typical
    size of the result, so it cannot hide a scale error in a result of ordinary size.

    Non-finite values in ``got`` give ``inf`` so that they always fail.
    """
    got64 = got.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64)
    if got64.shape != ref64.shape:
        raise ValueError(f"shape {tuple(got64.shape)} != reference shape {tuple(ref64.shape)}")
    if got64.numel() == 0:
        return 0.0
    if not torch.isfinite(got64).all():
        return math.inf
    diff = torch.linalg.vector_norm(got64 - ref64).item()
    denom = max(torch.linalg.vector_norm(ref64).item(), floor)
    return diff / denom if denom > 0 else diff
