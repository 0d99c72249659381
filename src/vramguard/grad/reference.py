"""Float64 references: the exact function a quantized layer claims to compute, through plain autograd.

Why: the quantized layers are compared with *their own* dequantized weight (the library's
``dequantize_4bit`` / int8 rows times row scales), not with the original unquantized weight. That
removes the quantization error from the comparison, so the only difference left is floating-point
rounding, and tolerances (:mod:`vramguard.grad.tolerance`) can be tight enough to see a 1 % gradient error.

The references never take the derived state of the object under test on trust: a LoRA scaling is
computed from the config (``alpha / r``, ``alpha / sqrt(r)`` with rsLoRA), not read from PEFT's
``layer.scaling``; a 4-bit weight is decoded here from its packed codes with code tables written out
below (not bitsandbytes' ``dequantize_4bit``), and the codes and block scales are checked against an
independent quantization of the original weight; the int8 row scales (``SCB``, ``SCA``) and codes are
checked against the original rows. A library bug that computes the state wrongly, and then uses it
consistently in forward and backward, is a :class:`StateMismatch`, not a pass.

Every function takes float64 leaf tensors (``requires_grad`` as the caller wants) and returns the
float64 output; the caller runs ``backward`` on it with the same upstream gradient as the layer.
"""

from __future__ import annotations

import math

import torch


class StateMismatch(AssertionError):
    """State the library derived (scales, codes, scaling) is not what its configuration implies."""


#: NF4 code points (QLoRA, Dettmers et al. 2023, appendix E), index = the stored 4-bit code
NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
#: bitsandbytes' FP4 (sign bit, then 3 bits of e2m1 scaled to a maximum of 1), index = the stored code
_FP4_MAGNITUDES = (0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 1 / 2, 1 / 6, 1 / 4)
FP4_CODE: tuple[float, ...] = _FP4_MAGNITUDES + tuple(-m for m in _FP4_MAGNITUDES)
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}
#: blocksize of the second-level (double) quantization of the 4-bit absmax (bitsandbytes' constant)
NESTED_BLOCKSIZE = 256
#: slack, in units of a group's largest |absmax - mean|, that a nested scale may sit farther from its
#: block's true (absmax - mean) than the nearest code of :data:`DYNAMIC_CODE` does: the library divides in
#: the CPU kernel of 0.50 decides values within ~3e-5 of a midpoint either way (largest excess seen over
#: 600 random nested weights: 2.9e-5); a wrong code far from a midpoint (0.46-0.49: 0.007) stays visible
NESTED_CODE_SLACK = 1e-4


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> tuple[float, ...]:
    """The signed 8-bit dynamic data type of Dettmers (2015, arXiv:1511.04561) that bitsandbytes uses for
    the second-level quantization of 4-bit block scales, sorted: for each exponent ``e`` (0..6) the
    midpoints of a linear split of [0.1, 1] into ``2**e`` parts, times ``10**(e - 6)``, both signs, plus
    0 and 1 (so the most negative code is -0.99297, not -1). Written from the definition, in float32 as the
    library stores it, not read from the library."""
    data: list[float] = []
    free = total_bits - 1
    for i in range(max_exponent_bits):
        edges = torch.linspace(0.1, 1, 2 ** (i + free - max_exponent_bits) + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * mids).tolist() + (-scale * mids).tolist()  # float32 products
    data += [0.0, 1.0]
    return tuple(sorted(torch.tensor(data, dtype=torch.float32).to(torch.float64).tolist()))


#: the 256 codes of the signed dynamic map, ascending
DYNAMIC_CODE: tuple[float, ...] = dynamic_map()


def dynamic_most_negative_band() -> tuple[float, float]:
    """The values (of a block's absmax) whose nearest dynamic code is the most negative one, -0.99297, and
    which a search that assumed a code at -1 would give the next code: between the midpoint with -1 and the
    midpoint with the next code."""
    c0, c1 = DYNAMIC_CODE[0], DYNAMIC_CODE[1]
    return (c0 - 1.0) / 2, (c0 + c1) / 2


def nested_statistics(original: torch.Tensor, blocksize: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The second level of nested (double) quantization of ``original``'s 4-bit block scales, computed in
    float32 as the library does: ``(mean, group, position)`` where ``mean`` is torch's float32 mean of the
    scales, ``group`` per block the largest ``|absmax - mean|`` of its group of :data:`NESTED_BLOCKSIZE`
    blocks, and ``position = (absmax - mean) / group``, the value stored as its nearest :data:`DYNAMIC_CODE`
    (float64 tensors)."""
    flat = original.detach().cpu().reshape(-1).to(torch.float32).to(torch.float64)
    true32 = _block_absmax(flat, blocksize).to(torch.float32)
    mean = true32.mean()
    dev = true32 - mean
    pad = (-dev.numel()) % NESTED_BLOCKSIZE
    group = torch.nn.functional.pad(dev.abs(), (0, pad)).reshape(-1, NESTED_BLOCKSIZE).amax(dim=1)
    group = group.repeat_interleave(NESTED_BLOCKSIZE)[: dev.numel()].clamp(min=1e-30).to(torch.float64)
    return float(mean), group, dev.to(torch.float64) / group


def partial_block_rounding_hits(original: torch.Tensor, blocksize: int, quant_type: str) -> bool:
    """Whether any element of the last, partial block of ``original`` takes a different nearest code when
    ``w / absmax`` is computed in ``original.dtype`` instead of exactly (the trigger of the 0.49.2 CPU
    defect ``partial_block_16bit``); False when the last block is whole."""
    flat = original.detach().cpu().reshape(-1)
    n = flat.numel()
    rest = n % blocksize
    if rest == 0:
        return False
    last = flat[n - rest :]
    absmax = last.abs().max()
    if absmax == 0:
        return False
    table = torch.tensor(CODES[quant_type], dtype=torch.float64)
    exact = (last.to(torch.float64) / absmax.to(torch.float64)).unsqueeze(1)
    rounded = (last / absmax).to(torch.float64).unsqueeze(1)
    return bool(((exact - table).abs().argmin(1) != (rounded - table).abs().argmin(1)).any())


def lora_scaling(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """The factor of the adapter path: ``alpha / r``, or ``alpha / sqrt(r)`` with rank-stabilised LoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The 4-bit codes of a packed tensor (two per byte, high nibble first), first ``n``."""
    q = packed.detach().reshape(-1).contiguous().view(torch.uint8).to(torch.int64)
    out = torch.empty(q.numel() * 2, dtype=torch.int64)
    out[0::2], out[1::2] = q >> 4, q & 0xF
    return out[:n]


def _block_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    pad = (-flat.numel()) % blocksize
    return torch.nn.functional.pad(flat.abs(), (0, pad)).reshape(-1, blocksize).amax(dim=1)


def used_4bit_absmax(quant_state: object) -> torch.Tensor:
    """The per-block scales a 4-bit weight is multiplied by (after undoing double quantization)."""
    import bitsandbytes.functional as bnbF

    absmax = quant_state.absmax  # type: ignore[attr-defined]
    if getattr(quant_state, "nested", False):
        with torch.no_grad():
            absmax = bnbF.dequantize_blockwise(absmax, quant_state.state2) + quant_state.offset  # type: ignore[attr-defined]
    return absmax.detach().cpu().to(torch.float64)


def check_4bit_quantization(
    original: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    nested: bool,
) -> None:
    """Raise :class:`StateMismatch` unless ``packed``/``absmax`` quantize ``original`` as configured: blocks
    of ``blocksize`` consecutive elements (row-major), each scaled by its own absmax (exact; within the
    double-quantization error when ``nested``), each element stored as its nearest ``quant_type`` code."""
    flat = original.detach().cpu().reshape(-1).to(torch.float32).to(torch.float64)
    n = flat.numel()
    if n == 0:
        return
    true = _block_absmax(flat, blocksize)
    absmax = absmax.reshape(-1).to(torch.float64)
    if absmax.numel() != true.numel():
        raise StateMismatch(
            f"4-bit state: {absmax.numel()} block scales, but {n} elements in blocks of {blocksize} need "
            f"{true.numel()}"
        )
    if nested:
        # second level: each block's (absmax - mean), divided by the largest |absmax - mean| of its group
        # of NESTED_BLOCKSIZE blocks, is stored as its nearest code of the signed dynamic map
        mean, group, want = nested_statistics(original, blocksize)
        table = torch.tensor(DYNAMIC_CODE, dtype=torch.float64)
        nearest = (want.unsqueeze(1) - table).abs().min(dim=1).values
        stored = (absmax - mean) / group
        # a float32 rounding or two of the scale itself
        fp32 = 4 * 2.0**-24 * true / group
        far = ((stored - want).abs() > nearest + NESTED_CODE_SLACK + fp32).nonzero()
        if far.numel():
            i = int(far[0])
            best = table[(want[i] - table).abs().argmin()].item()
            raise StateMismatch(
                f"4-bit state: block {i} scale {absmax[i].item():.6g} != absmax of its {blocksize} weights "
                f"{true[i].item():.6g} (nested=True: (absmax - mean) / group max = {want[i].item():.5g} is "
                f"stored as {stored[i].item():.5g}, the nearest dynamic code is {best:.5g}; {far.numel()} "
                f"of {true.numel()} blocks off)"
            )
        allowed = (nearest + NESTED_CODE_SLACK + fp32) * group + 1e-6 * true
    else:
        allowed = 1e-6 * true  # float32 absmax of float32 values: exact
    bad = ((absmax - true).abs() > allowed).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise StateMismatch(
            f"4-bit state: block {i} scale {absmax[i].item():.6g} != absmax of its {blocksize} weights "
            f"{true[i].item():.6g} (nested={nested}; {bad.numel()} of {true.numel()} blocks off)"
        )
    table = torch.tensor(CODES[quant_type], dtype=torch.float64)
    scaled = flat / true.repeat_interleave(blocksize)[:n].clamp(min=1e-38)
    chosen = table[_codes(packed, n)]
    distance = (scaled.unsqueeze(1) - table).abs()
    nearest = distance.min(dim=1).values
    off = ((scaled - chosen).abs() > nearest + 1e-6).nonzero()
    if off.numel():
        i = int(off[0])
        best = table[distance[i].argmin()].item()
        raise StateMismatch(
            f"4-bit codes: element {i} (w/absmax = {scaled[i].item():.4g}) is stored as "
            f"{chosen[i].item():.4g}, the nearest {quant_type} code is {best:.4g} "
            f"({off.numel()} of {n} elements)"
        )


def quantized_4bit_weight(
    original: torch.Tensor,
    packed: torch.Tensor,
    quant_state: object,
    *,
    blocksize: int,
    quant_type: str,
    nested: bool,
) -> torch.Tensor:
    """The weight a 4-bit layer claims to multiply by, in float64, decoded here (not by bitsandbytes).

    ``original`` is the tensor that was quantized (its shape and dtype are the configuration); the
    packed codes and the block scales are first checked against it (:func:`check_4bit_quantization`),
    then each code is looked up in :data:`CODES` and multiplied by its block's scale, and the result is
    rounded to ``original.dtype`` as the layer's dequantization does (float32 products, so that a correct
    dequantization is bit-identical to this).
    """
    absmax = used_4bit_absmax(quant_state)
    check_4bit_quantization(original, packed, absmax, blocksize, quant_type, nested)
    return decode_4bit(packed, absmax, blocksize, quant_type, tuple(original.shape), original.dtype)


def decode_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Codes looked up in :data:`CODES`, times their block's scale, in float64 (of ``dtype`` values)."""
    n = math.prod(shape)
    # float32 code points times float32 scales, rounded once to the weight's dtype: the format's arithmetic
    table = torch.tensor(CODES[quant_type], dtype=torch.float32)
    scale = absmax.detach().cpu().reshape(-1).to(torch.float32).repeat_interleave(blocksize)[:n]
    w = table[_codes(packed.cpu(), n)] * scale
    return w.to(dtype).to(torch.float64).reshape(shape)


def check_int8_rows(
    original: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    what: str,
    row_absmax: torch.Tensor | None = None,
) -> None:
    """Raise :class:`StateMismatch` unless ``cb``/``scb`` are the LLM.int8() row-wise quantization of
    ``original``: ``scb`` each row's absmax (of the fp16 cast), ``cb * scb / 127`` within half a step."""
    rows = original.detach().cpu().reshape(-1, original.shape[-1]).to(torch.float64)
    if rows.numel() == 0:
        return
    scb64 = scb.detach().cpu().reshape(-1).to(torch.float64)
    true = rows.abs().amax(dim=1) if row_absmax is None else row_absmax.to(torch.float64)
    fp16 = 2.0**-10  # the library quantizes the fp16 cast of the weight
    # ... whose subnormals (below 2**-14) are spaced 2**-24 apart: there the cast's error is absolute
    fp16_sub = 2.0**-25
    bad = ((scb64 - true).abs() > fp16 * true + fp16_sub).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise StateMismatch(
            f"{what}: row {i} scale {scb64[i].item():.6g} != its absmax {true[i].item():.6g} "
            f"({bad.numel()} of {true.numel()} rows)"
        )
    deq = cb.detach().cpu().reshape(rows.shape).to(torch.float64) * (scb64.unsqueeze(1) / 127.0)
    step = scb64.unsqueeze(1) / 127.0
    off = ((deq - rows).abs() > 0.5 * step * (1 + 1e-6) + fp16 * rows.abs() + fp16_sub).nonzero()
    if off.numel():
        r, c = (int(v) for v in off[0])
        raise StateMismatch(
            f"{what}: int8 code of row {r} column {c} gives {deq[r, c].item():.6g} for "
            f"{rows[r, c].item():.6g}, more than half a step ({0.5 * step[r, 0].item():.3g}) away "
            f"({off.shape[0]} elements)"
        )


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
    x16 = x2.to(torch.float16)
    ca, sca, outlier_cols = bnbF.int8_vectorwise_quant(x16.clone(), threshold=threshold)
    _check_int8_activation(x16, ca, sca, outlier_cols, threshold)
    deq = ca.to(torch.float64) * (sca.to(torch.float64).unsqueeze(1) / 127.0)
    if outlier_cols is not None and outlier_cols.numel() > 0:
        deq[:, outlier_cols] = x2.to(torch.float64)[:, outlier_cols]
    deq = deq.reshape(x.shape)
    # straight-through: value of the quantized activation, gradient of the identity
    return x + (deq - x.detach())


def int8_partial_magnitude(
    x: torch.Tensor, w64: torch.Tensor, threshold: float, bias: torch.Tensor | None = None
) -> float:
    """Norm of ``sum |outlier terms| + |int8 part| + |bias|`` of an LLM.int8() output. MatMul8bitLt
    multiplies the outlier columns by their weight dequantized to the layer dtype (a rounding per term),
    rounds the rescaled int8 product to the layer dtype, and only then adds the two: when they partly
    cancel, the output's error is a rounding of *their* size, not of the (smaller) sum's. Used as the
    cancellation floor of the output's relative error."""
    k = x.shape[-1]
    x2 = x.detach().reshape(-1, k).to(torch.float64)
    act = int8_activation(x2, threshold).detach()
    cols = (x2.to(torch.float16).abs() >= threshold).any(dim=0)
    w = w64.to(torch.float64)
    # the outlier columns: a few large terms, each with a weight dequantized to the layer dtype (a rounding
    # per term), so their sum of |terms|; the int8 part: one rescaled product, rounded once
    mag = act[:, cols].abs() @ w[:, cols].abs().T + (act[:, ~cols] @ w[:, ~cols].T).abs()
    if bias is not None:
        mag = mag + bias.detach().to(torch.float64).abs()
    return torch.linalg.vector_norm(mag).item()


def _check_int8_activation(
    x16: torch.Tensor, ca: torch.Tensor, sca: torch.Tensor, cols: torch.Tensor | None, threshold: float
) -> None:
    """The library's activation quantization, checked: outlier columns are exactly those with an element
    >= threshold, and the other columns are row-wise int8 with the absmax of the non-outlier elements."""
    if x16.numel() == 0:
        return
    a = x16.to(torch.float64)
    outliers = a.abs() >= threshold if threshold > 0 else torch.zeros_like(a, dtype=torch.bool)
    want_cols = outliers.any(dim=0).nonzero().reshape(-1).tolist()
    got_cols = sorted(cols.tolist()) if cols is not None else []
    if threshold > 0 and got_cols != want_cols:
        raise StateMismatch(
            f"int8 activation: outlier columns {got_cols} != {want_cols} (threshold {threshold:g})"
        )
    keep = [c for c in range(a.shape[1]) if c not in set(want_cols)]
    if keep:
        inliers = a.masked_fill(outliers, 0.0)  # the scale is the absmax of the elements below threshold
        check_int8_rows(inliers[:, keep], ca[:, keep], sca, "int8 activation", inliers.abs().amax(dim=1))


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
