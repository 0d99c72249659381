"""Run one case through the quantized library and through its float64 reference, and compare.

Why: the properties (patched == unpatched == reference, dtypes and shapes, determinism) are the same
for every strategy and every patch, so they live here once; ``tests_grad`` only draws cases. A broken
property raises :class:`GradMismatch` whose message is one line naming the example, the quantity,
the measured and the allowed error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vramguard.grad import capabilities
from vramguard.grad import reference as ref
from vramguard.grad.patches import Patch
from vramguard.grad.strategies import Linear4bitCase, Linear8bitCase, LoraCase
from vramguard.grad.tolerance import relative_error, tolerance

Case = Linear4bitCase | Linear8bitCase | LoraCase


class GradMismatch(AssertionError):
    """A property does not hold; the message is one readable line."""


class Unsupported(Exception):
    """The installed library cannot run this combination on this device (the example is skipped)."""


@dataclass
class Observed:
    """What the library produced: output and gradients (None where no gradient is expected)."""

    output: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    # float64 reference output and gradients, with the reduction length of each quantity
    # and the same quantity computed from the absolute values of every operand (the sum of |terms|)
    expected: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, int]] = field(default_factory=dict)
    #: quantities whose precision is capped below the layer dtype (MatMul8bitLt quantizes from an fp16 cast)
    tol_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    #: a larger cancellation floor where the layer rounds partial results before adding them
    floor: dict[str, float] = field(default_factory=dict)


# --- deterministic inputs ------------------------------------------------------------------------


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    k, n, s = case.in_features, case.out_features, case.seed
    x = _randn((*case.lead, k), s, case.dtype)
    if isinstance(case, Linear8bitCase) and case.outlier_cols and x.numel():
        x[..., list(case.outlier_cols)] *= 2.5 * case.threshold  # columns above the outlier threshold
    return {
        "x": x,
        "weight": _randn((n, k), s + 1, case.dtype, 1 / math.sqrt(k)),
        "bias": _randn((n,), s + 2, case.dtype, 0.5),
        "grad_out": _randn((*case.lead, n), s + 3, case.dtype),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """bitsandbytes warns on deprecated call forms and logs dtype casts; neither is a failure here."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _leaf(t: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    return t.detach().clone().to(device).requires_grad_(requires_grad)


def _backward(y: torch.Tensor, grad_out: torch.Tensor) -> None:
    if y.requires_grad:
        y.backward(grad_out.to(y.device))


def _ref_backward(y64: torch.Tensor, grad_out: torch.Tensor) -> None:
    if y64.requires_grad:
        y64.backward(grad_out.to(torch.float64).cpu())


def _g(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of a leaf's gradient (never an alias: a later backward would accumulate into it in place)."""
    return None if t is None or not t.is_leaf or t.grad is None else t.grad.detach().cpu().clone()


# --- 4-bit -----------------------------------------------------------------------------------------


def _cap(name: str) -> capabilities.Probe:
    return capabilities.get(name)


def runs_8bit_lt(case: Linear8bitCase) -> bool:
    """Does ``case`` run MatMul8bitLt (int8 activations)? CPU training runs MatMul8bitFp where the installed
    bitsandbytes has that path (probed: 0.48+; 0.46/0.47 without IPEX train through MatMul8bitLt)."""
    if not (case.training and case.device == "cpu"):
        return True
    return not _cap("cpu_8bit_training_fp")


def check_supported(case: Case) -> None:
    """Raise :class:`Unsupported` (with the reason) for combinations the installed library cannot run, or
    runs into a known defect (probed on this machine, see :mod:`vramguard.grad.capabilities`)."""
    if case.device.startswith("cuda") and not torch.cuda.is_available():
        raise Unsupported("CUDA is not available")
    cpu = case.device == "cpu"
    if isinstance(case, (Linear4bitCase, LoraCase)) and getattr(case, "base", "4bit") == "4bit":
        numel = case.in_features * case.out_features
        if cpu and case.quant_type == "fp4" and not (c := _cap("fp4_cpu")):
            raise Unsupported(f"no fp4 on CPU: {c.detail}")
        if cpu and case.quant_type == "fp4" and not (c := _cap("defect:fp4_codes_cpu")):
            raise Unsupported(f"{KNOWN_DEFECT_FP4_CODES}: {c.detail}")
        if cpu and numel % case.blocksize and not (c := _cap("blocksize_remainder_cpu")):
            raise Unsupported(f"no CPU 4-bit quantization of a weight that is not whole blocks: {c.detail}")
        if cpu and numel % 2 and not (c := _cap("defect:odd_numel_4bit")):
            raise Unsupported(f"{KNOWN_DEFECT_ODD_NUMEL}: {c.detail}")
        one_block = numel <= case.blocksize
        if cpu and case.compress_statistics and one_block and not (c := _cap("defect:nested_single_block")):
            raise Unsupported(f"{KNOWN_DEFECT_NESTED_ONE_BLOCK}: {c.detail}")
        half_partial = cpu and case.dtype in (torch.bfloat16, torch.float16) and numel % case.blocksize
        if (
            half_partial
            and not (c := _cap("defect:partial_block_16bit"))
            and ref.partial_block_rounding_hits(_quantized_tensor(case), case.blocksize, case.quant_type)
        ):
            raise Unsupported(f"{KNOWN_DEFECT_PARTIAL_BLOCK_16BIT}: {c.detail}")
        if cpu and case.compress_statistics and not (c := _cap("defect:dynamic_map_cpu")):
            lo, hi = ref.dynamic_most_negative_band()
            _, _, position = ref.nested_statistics(_quantized_tensor(case), case.blocksize)
            if ((position > lo) & (position < hi)).any():
                raise Unsupported(f"{KNOWN_DEFECT_DYNAMIC_MAP}: {c.detail}")
        call = getattr(case, "call", "module")
        if call != "module" and not (c := _cap(f"matmul_4bit:{call}")):
            raise Unsupported(f"call form {call} not taken by this bitsandbytes: {c.detail}")
        # a 2-element weight packs to [1, 1], read as transposed: MatMul4Bit.backward (x needs grad) and the
        # deprecated [K, N] forward fail (the latter with an empty input too: "0x1 and 2x1"); the forward of
        # the other forms is fine (and checked)
        if numel == 2:
            if call == "functional_kn" and not _cap("defect:one_byte_weight"):
                raise Unsupported(KNOWN_DEFECT_4BIT_K1)
            if case.input_requires_grad and 0 not in case.lead and not _cap("defect:one_byte_backward"):
                raise Unsupported(KNOWN_DEFECT_4BIT_K1)
        one_row = math.prod(case.lead) == 1 and not case.input_requires_grad
        if cpu and call == "functional_kn" and one_row and not (c := _cap("defect:kn_one_row")):
            raise Unsupported(f"{KNOWN_DEFECT_KN_ONE_ROW}: {c.detail}")
        kn = call == "functional_kn"
        shape = (case.in_features, case.out_features) if kn else (case.out_features, case.in_features)
        defect = dequantize_4bit_defect(case.device, shape, case.blocksize, case.quant_type, case.dtype)
        if defect is not None:
            raise Unsupported(defect)
    if isinstance(case, LoraCase) and case.base == "8bit" and cpu and not _cap("cpu_8bit_training_fp"):
        raise Unsupported(
            "8-bit LoRA on CPU: this bitsandbytes trains 8-bit layers on CPU through MatMul8bitLt, "
            "the reference models MatMul8bitFp (bitsandbytes >= 0.48)"
        )
    if isinstance(case, Linear8bitCase):
        lt = runs_8bit_lt(case)
        if lt and case.has_fp16_weights and cpu:
            # MatMul8bitLt needs int8_double_quant to form the weight gradient; no CPU kernel exists
            raise Unsupported(
                "MatMul8bitLt with has_fp16_weights on CPU: bitsandbytes::int8_double_quant has no CPU kernel"
            )
        three_d = len(case.lead) == 2 and 0 not in case.lead
        if not lt and case.has_fp16_weights and three_d and not _cap("defect:8bit_fp_3d_backward"):
            raise Unsupported(KNOWN_DEFECT_8BIT_FP_3D)
        if cpu and 0 in case.lead and not lt:
            raise Unsupported("MatMul8bitFp on CPU does not handle empty inputs (no is_empty branch)")
        k1 = case.in_features == 1 and 0 not in case.lead
        if cpu and lt and k1 and not (c := _cap("defect:int8_k1_cpu")):
            raise Unsupported(f"{KNOWN_DEFECT_INT8_K1}: {c.detail}")


def _quantized_tensor(case: Linear4bitCase | LoraCase) -> torch.Tensor:
    """The tensor a 4-bit case quantizes, in the layout it is quantized in: the [N, K] weight, or its
    [K, N] transpose for the deprecated ``functional_kn`` form (its blocks hold other elements)."""
    w = _inputs(case)["weight"]
    return w.T.contiguous() if getattr(case, "call", "module") == "functional_kn" else w


def supported_cases(cases: list[Case]) -> list[Case]:
    """The cases :func:`check_supported` lets through."""
    out = []
    for case in cases:
        try:
            check_supported(case)
        except Unsupported:
            continue
        out.append(case)
    return out


#: known bitsandbytes defects (tests_grad/test_known_defects.py pins each for the releases where it
#: reproduces); a case is skipped for one only where its probe reproduces it on this machine
KNOWN_DEFECT_8BIT_FP_3D = (
    "known bitsandbytes defect: MatMul8bitFp.backward calls A.t() on a 3-D input when the weight needs a "
    "gradient (has_fp16_weights=True, CPU training)"
)
KNOWN_DEFECT_4BIT_K1 = (
    "known bitsandbytes defect: a 4-bit weight of 2 elements packs to [1, 1], which dequantize_4bit reads "
    "as transposed, so MatMul4Bit.backward (x needs grad) and the [K, N] form fail with 'mat1 and mat2 "
    "shapes cannot be multiplied'"
)
KNOWN_DEFECT_INT8_K1 = (
    "known defect: int8_linear_matmul on CPU with one input feature (K=1) returns uninitialised memory "
    "(bitsandbytes routes it to torch._int_mm, whose CPU kernel ignores a [1, N] operand with strides (1, 1))"
)
KNOWN_DEFECT_ODD_NUMEL = (
    "known bitsandbytes defect: CPU quantize_4bit of a weight with an odd number of elements fails "
    "('The size of tensor a must match the size of tensor b')"
)
KNOWN_DEFECT_KN_ONE_ROW = (
    "known bitsandbytes defect: matmul_4bit in the [K, N] form with a one-row input that needs no gradient "
    "(the gemv_4bit inference path) fails with 'mat1 and mat2 shapes cannot be multiplied'"
)
KNOWN_DEFECT_FP4_CODES = (
    "known bitsandbytes defect on this CPU: quantize_4bit(quant_type='fp4') stores some elements as a code "
    "that is not the nearest"
)
KNOWN_DEFECT_PARTIAL_BLOCK_16BIT = (
    "known bitsandbytes defect: the CPU quantize_4bit of a 16-bit weight divides the last, partial block by "
    "its absmax in the weight's dtype, and an element of this weight's last block then takes the farther code"
)
KNOWN_DEFECT_DYNAMIC_MAP = (
    "known bitsandbytes defect: the CPU quantize_blockwise writes code[0] = -1 into the dynamic map, and a "
    "block scale of this weight lies where that changes its nested code (-0.99648 < position < -0.98594)"
)
KNOWN_DEFECT_NESTED_ONE_BLOCK = (
    "known bitsandbytes defect: nested statistics of a weight with one 4-bit block crash the process "
    "(CPU quantize_blockwise of the all-zero absmax - mean)"
)


@functools.cache
def dequantize_4bit_defect(
    device: str, shape: tuple[int, int], blocksize: int, quant_type: str, dtype: torch.dtype
) -> str | None:
    """Probe, once per configuration: does the installed bitsandbytes' ``dequantize_4bit`` decode a weight
    of this shape as the format says (:func:`reference.quantized_4bit_weight`) on this device? A message
    naming the defect where it does not (then no layer built on it can be checked), else None.

    bitsandbytes 0.50.2's CPU kernel (``cdequantize_blockwise_cpu_*``, taken for an even last dimension)
    reads the wrong block scales when the last dimension is not a multiple of ``blocksize``: a K=96, 352
    (tiny-llama's down_proj) weight with blocksize 64 comes back up to ~40 % off on an AVX-512 CPU.
    """
    import bitsandbytes  # noqa: F401  (registers the torch.ops.bitsandbytes kernels)

    if device.startswith("cuda") and not torch.cuda.is_available():
        return None
    # the kernels themselves, below the Python functions a test (or a patch) may replace
    ops = torch.ops.bitsandbytes
    w = _randn(shape, 12345, dtype, 1.0).to(device)
    with _quiet(), torch.no_grad():
        packed, absmax = ops.quantize_4bit.default(w, blocksize, quant_type, torch.uint8)
        got = ops.dequantize_4bit.default(packed, absmax, blocksize, quant_type, list(shape), dtype)
    got = got.cpu().to(torch.float64)
    want = ref.decode_4bit(packed, absmax, blocksize, quant_type, shape, dtype)
    if got.shape == want.shape and torch.equal(got, want):
        return None
    err = (got - want).norm().item() / max(want.norm().item(), 1e-30) if got.shape == want.shape else math.inf
    cpu = f" ({torch.backends.cpu.get_cpu_capability()})" if device == "cpu" else ""
    return (
        f"known bitsandbytes defect: dequantize_4bit on {device}{cpu} decodes a {shape[0]}x{shape[1]} "
        f"{quant_type} weight with blocksize {blocksize} wrongly (relative error {err:.2g}; the last "
        f"dimension is {'not ' if shape[1] % blocksize else ''}a multiple of the blocksize)"
    )


def run_4bit(case: Linear4bitCase) -> Observed:
    """Run one 4-bit case (forward and backward, through the module or a functional form) and return the
    output and gradients for comparison with the reference."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    t = _inputs(case)
    dev = case.device
    x = _leaf(t["x"], dev, case.input_requires_grad)
    b = _leaf(t["bias"], dev, True) if case.bias else None
    with _quiet():
        if case.call == "module":
            m = bnb.nn.Linear4bit(
                case.in_features,
                case.out_features,
                bias=case.bias,
                compress_statistics=case.compress_statistics,
                quant_type=case.quant_type,
            )
            m.weight = bnb.nn.Params4bit(
                t["weight"].clone(),
                requires_grad=False,
                blocksize=case.blocksize,
                compress_statistics=case.compress_statistics,
                quant_type=case.quant_type,
                module=m,
            )
            if b is not None:
                m.bias = torch.nn.Parameter(t["bias"].clone())
            m = m.to(dev)
            y = m(x)
            packed, qs = m.weight.data, m.weight.quant_state
            w64 = _weight_4bit(case, t["weight"], packed, qs)
            _backward(y, t["grad_out"])
            grad_b = _g(m.bias) if b is not None else None
        else:
            w = t["weight"].T.contiguous() if case.call == "functional_kn" else t["weight"]
            packed, qs = bnbF.quantize_4bit(
                w.to(dev),
                blocksize=case.blocksize,
                compress_statistics=case.compress_statistics,
                quant_type=case.quant_type,
            )
            arg = packed.t() if case.call == "functional_t" else packed
            y = bnb.matmul_4bit(x, arg, quant_state=qs, bias=b)
            w64 = _weight_4bit(case, w, packed, qs)
            if case.call == "functional_kn":
                w64 = w64.T
            _backward(y, t["grad_out"])
            grad_b = _g(b)
    obs = Observed(y.detach().cpu(), {"grad_input": _g(x), "grad_bias": grad_b})
    obs.expected, obs.floor = _expected_linear(case, t, w64.cpu(), act_threshold=None)
    return obs


def _weight_4bit(case: Linear4bitCase | LoraCase, original: torch.Tensor, packed: torch.Tensor, qs: object):  # type: ignore[no-untyped-def]
    """The reference weight: decoded independently, after checking codes and scales against ``original``
    and the case's configuration (never the quant_state's own idea of its type, blocksize or shape)."""
    return ref.quantized_4bit_weight(
        original,
        packed,
        qs,
        blocksize=case.blocksize,
        quant_type=case.quant_type,
        nested=case.compress_statistics,
    )


def _expected_linear(
    case: Case, t: dict[str, torch.Tensor], w64: torch.Tensor, act_threshold: float | None
) -> tuple[dict[str, tuple[torch.Tensor | None, torch.Tensor | None, int]], dict[str, float]]:
    """Reference output/gradients, plus the same computed on |operands| (the sum of |terms|), and each
    quantity's root-sum-square of its terms (computed on squared operands: every quantity here is a sum of
    products of one element of each operand, so squaring the operands squares each term). The latter is
    the size a sum of random-sign terms typically has, and the scale of the error of rounding each term's
    weight to the layer dtype (MatMul8bitFp's dequantized weight, a 4-bit weight decoded to its dtype):
    the cancellation floor, which the sum of |terms| over sqrt(K) underestimates when a few terms dominate."""

    def once(how: str) -> dict[str, torch.Tensor | None]:
        f = {"value": lambda v: v, "abs": torch.abs, "square": lambda v: v * v}[how]
        x64 = f(t["x"].to(torch.float64)).requires_grad_(case.input_requires_grad)
        b64 = f(t["bias"].to(torch.float64)).requires_grad_(True) if case.bias else None
        act = x64
        if act_threshold is not None and x64.numel():
            act = ref.int8_activation(t["x"].to(torch.float64), act_threshold).detach()
            act = f(act).requires_grad_(case.input_requires_grad)
            x64 = act
        y64 = ref.linear(act, f(w64), b64)
        _ref_backward(y64, f(t["grad_out"].to(torch.float64)))
        return {"output": y64.detach(), "grad_input": _g(x64), "grad_bias": _g(b64)}

    val, mag, sq = once("value"), once("abs"), once("square")
    rows = math.prod(case.lead)
    lengths = {"output": case.in_features, "grad_input": case.out_features, "grad_bias": rows}
    floors = {
        k: torch.linalg.vector_norm(v.clamp(min=0).sqrt()).item() for k, v in sq.items() if v is not None
    }
    return {k: (val[k], mag[k], lengths[k]) for k in val}, floors


# --- 8-bit -----------------------------------------------------------------------------------------


def run_8bit(case: Linear8bitCase) -> Observed:
    """Run one 8-bit (LLM.int8) case, forward and backward, and return the output and gradients for comparison
    with the reference."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    t = _inputs(case)
    dev = case.device
    x = _leaf(t["x"], dev, case.input_requires_grad)
    with _quiet():
        if case.call == "module":
            m = bnb.nn.Linear8bitLt(
                case.in_features,
                case.out_features,
                bias=case.bias,
                has_fp16_weights=case.has_fp16_weights,
                threshold=case.threshold,
            )
            dense = torch.nn.Linear(case.in_features, case.out_features, bias=case.bias, dtype=case.dtype)
            with torch.no_grad():
                dense.weight.copy_(t["weight"])
                if case.bias:
                    dense.bias.copy_(t["bias"])
            m.load_state_dict(dense.state_dict())
            m = m.to(dev)
            m.train(case.training)
            y = m(x)
            state, weight, bias = m.state, m.weight, m.bias
        else:
            state = bnb.MatmulLtState()
            state.has_fp16_weights = case.has_fp16_weights
            state.is_training = case.training
            if case.has_fp16_weights:
                weight = _leaf(t["weight"], dev, True)
            else:
                cb, scb, _ = bnbF.int8_vectorwise_quant(t["weight"].to(dev, torch.float16))
                state.CB, state.SCB = cb, scb
                weight = cb
            bias = _leaf(t["bias"], dev, True) if case.bias else None
            y = bnb.matmul(x, weight, state=state, threshold=case.threshold, bias=bias)
        cb = state.CB if state.CB is not None else getattr(weight, "CB", None)
        scb = state.SCB if state.SCB is not None else getattr(weight, "SCB", None)
        if scb is None and x.numel() == 0 and case.has_fp16_weights:
            # MatMul8bitLt returns an empty input's empty output before it quantizes an fp16 weight (CUDA):
            # no int8 state exists, and none is needed (the output and input gradient are empty)
            w64 = t["weight"].to(torch.float64)
        elif cb is None or scb is None:
            raise ref.StateMismatch("8-bit weight: no int8 rows (CB/SCB) after the forward")
        else:
            ref.check_int8_rows(t["weight"], cb, scb, "8-bit weight")  # SCB and CB from the weight itself
            w64 = ref.dequantized_8bit_weight(cb, scb).cpu()
        _backward(y, t["grad_out"])
    lt_path = runs_8bit_lt(case)
    grads = {"grad_input": _g(x), "grad_bias": _g(bias) if case.bias else None}
    obs = Observed(y.detach().cpu(), grads)
    obs.expected, obs.floor = _expected_linear(
        case, t, w64, act_threshold=case.threshold if lt_path else None
    )
    if lt_path and case.threshold > 0 and t["x"].numel():
        partial = ref.int8_partial_magnitude(t["x"], w64, case.threshold, t["bias"] if case.bias else None)
        obs.floor["output"] = max(obs.floor.get("output", 0.0), partial)
    if lt_path and case.dtype == torch.float32:
        obs.tol_dtype["output"] = torch.float16
    if case.has_fp16_weights and not lt_path:
        # straight-through weight gradient g^T x (MatMul8bitFp); MatMul8bitLt quantizes it to int8 by design
        obs.grads["grad_weight"] = _g(weight) if isinstance(weight, torch.Tensor) else None
        g64 = t["grad_out"].to(torch.float64).reshape(-1, case.out_features)
        x64 = t["x"].to(torch.float64).reshape(-1, case.in_features)
        obs.expected["grad_weight"] = (g64.T @ x64, g64.abs().T @ x64.abs(), math.prod(case.lead))
        obs.tol_dtype["grad_weight"] = case.dtype  # the module keeps an fp32 parameter; x and g carry dtype
    return obs


# --- LoRA ------------------------------------------------------------------------------------------


class _Wrapper(torch.nn.Module):
    def __init__(self, proj: torch.nn.Module) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def run_lora(case: LoraCase) -> Observed:
    """Run one LoRA-on-quantized-base case through PEFT, forward and backward, and return the output and the
    adapter gradients."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    t = _inputs(case)
    dev = case.device
    k, n, r = case.in_features, case.out_features, case.rank
    with _quiet():
        if case.base == "4bit":
            base = bnb.nn.Linear4bit(
                k, n, bias=case.bias, compress_statistics=case.compress_statistics, quant_type=case.quant_type
            )
            base.weight = bnb.nn.Params4bit(
                t["weight"].clone(),
                requires_grad=False,
                blocksize=case.blocksize,
                compress_statistics=case.compress_statistics,
                quant_type=case.quant_type,
                module=base,
            )
            if case.bias:
                base.bias = torch.nn.Parameter(t["bias"].clone())
        else:
            base = bnb.nn.Linear8bitLt(k, n, bias=case.bias, has_fp16_weights=False)
            dense = torch.nn.Linear(k, n, bias=case.bias, dtype=case.dtype)
            with torch.no_grad():
                dense.weight.copy_(t["weight"])
                if case.bias:
                    dense.bias.copy_(t["bias"])
            base.load_state_dict(dense.state_dict())
        model = get_peft_model(
            _Wrapper(base.to(dev)),
            LoraConfig(
                r=r,
                lora_alpha=case.alpha,
                lora_dropout=case.dropout,
                use_rslora=case.use_rslora,
                target_modules=["proj"],
                init_lora_weights=False,
            ),
        )
        model.train()
        layer = model.base_model.model.proj
        lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():  # seeded adapter weights: B != 0 so that A's gradient is not trivially zero
            lora_a.copy_(_randn((r, k), case.seed + 4, lora_a.dtype, 1 / math.sqrt(k)))
            lora_b.copy_(_randn((n, r), case.seed + 5, lora_b.dtype, 1 / math.sqrt(r)))
        # from the configuration, never PEFT's layer.scaling: a wrong scaling there must not pass
        scaling = ref.lora_scaling(case.alpha, r, case.use_rslora)
        x = _leaf(t["x"], dev, case.input_requires_grad)
        with torch.random.fork_rng(devices=[dev] if dev != "cpu" else []):
            torch.manual_seed(case.seed)
            y = model(x)
        _backward(y, t["grad_out"])
        base_layer = layer.base_layer
        if case.base == "4bit":
            w64 = _weight_4bit(case, t["weight"], base_layer.weight.data, base_layer.weight.quant_state)
        else:
            st_ = base_layer.state
            ref.check_int8_rows(t["weight"], st_.CB, st_.SCB, "8-bit weight")
            w64 = ref.dequantized_8bit_weight(st_.CB, st_.SCB).cpu()
        mask = None
        if case.dropout > 0:
            with torch.random.fork_rng(devices=[dev] if dev != "cpu" else []):
                torch.manual_seed(case.seed)  # the mask the layer drew: dropout of ones, same shape and dtype
                ones = torch.ones((*case.lead, k), dtype=lora_a.dtype, device=dev)
                mask = torch.nn.functional.dropout(ones, case.dropout, training=True).cpu().to(torch.float64)
    obs = Observed(
        y.detach().cpu(), {"grad_input": _g(x), "grad_lora_A": _g(lora_a), "grad_lora_B": _g(lora_b)}
    )
    lora_a_val, lora_b_val = lora_a.detach().cpu().to(torch.float64), lora_b.detach().cpu().to(torch.float64)

    def once(absolute: bool) -> dict[str, torch.Tensor | None]:
        f = torch.abs if absolute else (lambda v: v)
        x64 = f(t["x"].to(torch.float64)).requires_grad_(case.input_requires_grad)
        # fresh leaves per pass: requires_grad_ on the shared tensors would make the |terms| pass
        # accumulate its gradient into the value pass's (and make abs(A) a non-leaf with no gradient)
        a64 = f(lora_a_val.clone()).requires_grad_(True)
        b64 = f(lora_b_val.clone()).requires_grad_(True)
        bias64 = f(t["bias"].to(torch.float64)) if case.bias else None
        # the 8-bit base runs MatMul8bitFp on CPU in training (no activation quantization), Lt on CUDA
        act = x64
        if case.base == "8bit" and case.device != "cpu" and x64.numel():
            act = ref.int8_activation(x64, 0.0)
            act = act.abs() if absolute else act
        y64 = ref.linear(act, f(w64), bias64) + scaling * (
            ((x64 * mask if mask is not None else x64) @ a64.T) @ b64.T
        )
        _ref_backward(y64, f(t["grad_out"].to(torch.float64)))
        return {"output": y64.detach(), "grad_input": _g(x64), "grad_lora_A": _g(a64), "grad_lora_B": _g(b64)}

    val, mag = once(False), once(True)
    rows = math.prod(case.lead)
    # reduction length of the whole chain: grad_B = g^T (x A^T) sums over rows and K, grad_A over rows and N
    lengths = {"output": k + r, "grad_input": n + r, "grad_lora_A": rows + n, "grad_lora_B": rows + k}
    obs.expected = {q: (val[q], mag[q], lengths[q]) for q in val}
    if case.base == "8bit" and case.device != "cpu" and case.dtype == torch.float32:
        # MatMul8bitLt on CUDA dequantizes the int32 product to fp16 before the cast back (as run_8bit)
        obs.tol_dtype["output"] = torch.float16
    return obs


# --- the properties --------------------------------------------------------------------------------


def run(case: Case, patch: Patch | None = None) -> Observed:
    """Run ``case`` through the library (whatever is patched right now) and its reference.

    State the library derived that contradicts the case's configuration (a block scale, a code, a row
    scale) is a :class:`GradMismatch` here, before any numbers are compared."""
    check_supported(case)
    try:
        if isinstance(case, Linear4bitCase):
            return run_4bit(case)
        if isinstance(case, Linear8bitCase):
            return run_8bit(case)
        return run_lora(case)
    except ref.StateMismatch as exc:
        raise GradMismatch(f"{exc} | {_where(case, patch)}") from None


def _where(case: Case, patch: Patch | None) -> str:
    return f"{case.describe()} | patch={patch.name if patch else 'none'}"


def _floor(magnitude: torch.Tensor | None, k: int) -> float:
    """Cancellation floor for the denominator: ||sum of |terms||| / sqrt(K), the size a result of K
    random-sign terms typically has. Only matters when the true result cancels far below that."""
    if magnitude is None or magnitude.numel() == 0:
        return 0.0
    return torch.linalg.vector_norm(magnitude).item() / math.sqrt(max(k, 1))


def assert_matches_reference(case: Case, obs: Observed, patch: Patch | None = None) -> None:
    """Output and every gradient within tolerance of the float64 reference; gradients present exactly
    where the reference has one. Reports the worst quantity (and how many others failed) in one line."""
    failures: list[tuple[float, str]] = []
    got_all = {"output": obs.output, **obs.grads}
    for name, (expected, magnitude, k) in obs.expected.items():
        got = got_all.get(name)
        if expected is None and got is None:
            continue
        if expected is None or got is None:
            what = "missing" if got is None else "unexpected"
            failures.append(
                (
                    math.inf,
                    f"{name}: {what} gradient (reference has {'one' if expected is not None else 'none'})",
                )
            )
            continue
        if tuple(got.shape) != tuple(expected.shape):
            failures.append(
                (math.inf, f"{name}: shape {tuple(got.shape)} != reference {tuple(expected.shape)}")
            )
            continue
        err = relative_error(got, expected, floor=max(_floor(magnitude, k), obs.floor.get(name, 0.0)))
        tol = tolerance(obs.tol_dtype.get(name, got.dtype), k)
        if not err <= tol:
            failures.append((err / tol, f"{name}: rel err {err:.3g} > tol {tol:.3g} (K={k})"))
    if failures:
        failures.sort(key=lambda f: -f[0])
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        raise GradMismatch(f"{failures[0][1]}{more} | {_where(case, patch)}")


def assert_dtypes_and_shapes(case: Case, obs: Observed, patch: Patch | None = None) -> None:
    """Output in the input's dtype and ``[*lead, N]``; the input gradient has the input's dtype and shape."""
    x_shape = (*case.lead, case.in_features)
    problems = []
    if obs.output.dtype != case.dtype or tuple(obs.output.shape) != (*case.lead, case.out_features):
        problems.append(f"output {obs.output.dtype} {tuple(obs.output.shape)}")
    gx = obs.grads.get("grad_input")
    if case.input_requires_grad and (gx is None or gx.dtype != case.dtype or tuple(gx.shape) != x_shape):
        problems.append("grad_input " + ("missing" if gx is None else f"{gx.dtype} {tuple(gx.shape)}"))
    if not case.input_requires_grad and gx is not None:
        problems.append("grad_input present although x.requires_grad=False")
    gb = obs.grads.get("grad_bias")
    if gb is not None and (gb.dtype != case.dtype or tuple(gb.shape) != (case.out_features,)):
        problems.append(f"grad_bias {gb.dtype} {tuple(gb.shape)}")
    if problems:
        raise GradMismatch(
            f"dtype/shape: {'; '.join(problems)} (want {case.dtype} x{x_shape}) | {_where(case, patch)}"
        )


def assert_identical(case: Case, a: Observed, b: Observed, what: str, patch: Patch | None = None) -> None:
    """Bit-for-bit equality of outputs and gradients (determinism; memory-only patches)."""
    for name, ta in {"output": a.output, **a.grads}.items():
        tb = b.output if name == "output" else b.grads.get(name)
        if (ta is None) != (tb is None):
            raise GradMismatch(f"{what}: {name} present in one run only | {_where(case, patch)}")
        if ta is not None and not torch.equal(ta, tb):
            diff = (ta.double() - tb.double()).abs().max().item() if ta.shape == tb.shape else math.nan
            raise GradMismatch(f"{what}: {name} differs (max abs diff {diff:.3g}) | {_where(case, patch)}")


def check(case: Case, patch: Patch | None = None) -> Observed:
    """All properties of one case: reference match, dtypes/shapes, and -- with ``patch`` -- the patched
    run against the reference and (for memory-only patches) bit-identical to the unpatched run."""
    obs = run(case)
    assert_dtypes_and_shapes(case, obs)
    assert_matches_reference(case, obs)
    if patch is not None:
        with patch.apply():
            patched = run(case, patch)
        assert_dtypes_and_shapes(case, patched, patch)
        assert_matches_reference(case, patched, patch)
        if patch.claims_memory_only:
            assert_identical(case, obs, patched, "patched != unpatched bit-for-bit", patch)
    return obs


def check_deterministic(case: Case) -> None:
    """Two runs of the same case (same seed) are bit-identical."""
    assert_identical(case, run(case), run(case), "not deterministic")
