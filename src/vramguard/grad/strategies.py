"""Hypothesis strategies for the space of quantized-linear calls a QLoRA user can hit.

Why: the library's own tests use 2-D inputs, one dtype and loose tolerances, so bugs that only show
for 3-D inputs, fp4, nested statistics or one dtype slip through. Each strategy draws a frozen *case*
(plain data: shapes, dtypes, quant settings, call form, seed) that :mod:`vramguard.grad.runner` turns into
tensors and a layer; cases print as one readable line, so a failure names its example.

Strategies are values, composable like hypothesis' own (``linear4bit_cases(dtypes=[torch.bfloat16])``,
``.filter(...)``, ``st.one_of(...)``).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")
BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256)
#: 4-bit call forms: the module; matmul_4bit with the packed weight as stored, transposed (what
#: older callers pass), and quantized from a [K, N] weight (deprecated, takes a dequantize+F.linear path)
CALLS_4BIT: tuple[str, ...] = ("module", "functional", "functional_t", "functional_kn")
#: 8-bit call forms: the module (Linear8bitLt) and bnb.matmul with a prepared MatmulLtState
CALLS_8BIT: tuple[str, ...] = ("module", "functional")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shapes(case: Linear4bitCase | Linear8bitCase | LoraCase) -> str:
    """``x(*lead,K) W(N,K) dtype``: the part of a case's description every kind of case shares."""
    x = "x" + str(tuple(case.lead) + (case.in_features,)).replace(" ", "")
    return f"{x} W({case.out_features},{case.in_features}) {_dt(case.dtype)}"


def _grad_seed_device(case: Linear4bitCase | Linear8bitCase | LoraCase) -> str:
    """The end of a case's description: whether x needs a gradient, the seed and the device."""
    return f"x.requires_grad={case.input_requires_grad} seed={case.seed} {case.device}"


@dataclass(frozen=True)
class Linear4bitCase:
    """One call of a 4-bit linear: ``x[*lead, K] -> y[*lead, N]`` with a [N, K] weight."""

    lead: tuple[int, ...]
    in_features: int
    out_features: int
    blocksize: int
    dtype: torch.dtype
    quant_type: str
    compress_statistics: bool
    bias: bool
    call: str
    input_requires_grad: bool
    seed: int
    device: str = "cpu"

    def describe(self) -> str:
        """The 4-bit case on one line with every parameter that decides it (shown when the property fails,
        to reproduce it)."""
        return (
            f"4bit {self.call} {_shapes(self)} {self.quant_type} bs={self.blocksize} "
            f"nested={self.compress_statistics} bias={self.bias} {_grad_seed_device(self)}"
        )


@dataclass(frozen=True)
class Linear8bitCase:
    """One call of an LLM.int8() linear; ``training`` picks MatMul8bitFp (CPU) vs MatMul8bitLt."""

    lead: tuple[int, ...]
    in_features: int
    out_features: int
    dtype: torch.dtype
    threshold: float
    outlier_cols: tuple[int, ...]
    has_fp16_weights: bool
    bias: bool
    call: str
    training: bool
    input_requires_grad: bool
    seed: int
    device: str = "cpu"

    def describe(self) -> str:
        """The 8-bit case on one line, threshold and outlier columns included (shown when the property
        fails, to reproduce it)."""
        return (
            f"8bit {self.call} {_shapes(self)} threshold={self.threshold:g} "
            f"outlier_cols={list(self.outlier_cols)} has_fp16_weights={self.has_fp16_weights} "
            f"bias={self.bias} training={self.training} {_grad_seed_device(self)}"
        )


@dataclass(frozen=True)
class LoraCase:
    """A PEFT LoRA adapter over a 4-bit (``base="4bit"``) or 8-bit (``"8bit"``) base layer."""

    base: str
    lead: tuple[int, ...]
    in_features: int
    out_features: int
    dtype: torch.dtype
    rank: int
    alpha: int
    dropout: float
    quant_type: str
    compress_statistics: bool
    blocksize: int
    bias: bool
    input_requires_grad: bool
    seed: int
    device: str = "cpu"
    use_rslora: bool = False

    def describe(self) -> str:
        """The LoRA case on one line: its base's quantization, rank, alpha, dropout and the rest (shown when
        the property fails, to reproduce it)."""
        quant = (
            f"{self.quant_type} bs={self.blocksize} nested={self.compress_statistics}"
            if self.base == "4bit"
            else "int8"
        )
        return (
            f"lora/{self.base} {_shapes(self)} {quant} r={self.rank} alpha={self.alpha}"
            f"{' rslora' if self.use_rslora else ''} dropout={self.dropout:g} bias={self.bias} "
            f"{_grad_seed_device(self)}"
        )


# --- building blocks ---------------------------------------------------------------------------


def leading_dims(*, max_rows: int = 6, allow_empty: bool = True) -> st.SearchStrategy[tuple[int, ...]]:
    """Batch dims of the input: 2-D (``(M,)``), 3-D (``(B, T)``, batch > 1 included) and empty."""
    shapes = [
        st.tuples(st.integers(1, max_rows)),
        st.tuples(st.integers(1, 3), st.integers(1, max_rows)),
    ]
    if allow_empty:
        shapes.append(st.sampled_from([(0,), (2, 0), (0, 3)]))
    return st.one_of(*shapes)


def features(blocksize: int, *, max_size: int = 160) -> st.SearchStrategy[int]:
    """A feature count that is a multiple of ``blocksize`` or, as often, not."""
    multiples = st.integers(1, max(1, max_size // blocksize)).map(lambda m: m * blocksize)
    return st.one_of(multiples, st.integers(1, max_size))


seeds = st.integers(0, 2**16 - 1)


@st.composite
def linear4bit_cases(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    quant_types: tuple[str, ...] = QUANT_TYPES,
    calls: tuple[str, ...] = CALLS_4BIT,
    device: str = "cpu",
) -> Linear4bitCase:
    """Every 4-bit combination: shapes, blocksizes, dtypes, nf4/fp4, nested stats, bias, call form."""
    blocksize = draw(st.sampled_from(BLOCKSIZES))
    k = draw(features(blocksize))
    n = draw(st.integers(1, 96))
    call = draw(st.sampled_from(calls))
    if call == "functional_kn" and k == n:
        n += 1  # square weights are read as [N, K]: the deprecated [K, N] form needs K != N
    return Linear4bitCase(
        lead=draw(leading_dims()),
        in_features=k,
        out_features=n,
        blocksize=blocksize,
        dtype=draw(st.sampled_from(dtypes)),
        quant_type=draw(st.sampled_from(quant_types)),
        compress_statistics=draw(st.booleans()),
        bias=draw(st.booleans()),
        call=call,
        input_requires_grad=draw(st.booleans()),
        seed=draw(seeds),
        device=device,
    )


@st.composite
def linear8bit_cases(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    calls: tuple[str, ...] = CALLS_8BIT,
    device: str = "cpu",
) -> Linear8bitCase:
    """LLM.int8(): threshold 0 and > 0 with generated outlier columns, has_fp16_weights on/off."""
    k = draw(st.integers(1, 160))
    threshold = draw(st.sampled_from([0.0, 0.0, 3.0, 6.0]))
    outliers: tuple[int, ...] = ()
    if threshold > 0:
        outliers = tuple(sorted(draw(st.sets(st.integers(0, k - 1), min_size=0, max_size=min(3, k)))))
    return Linear8bitCase(
        lead=draw(leading_dims()),
        in_features=k,
        out_features=draw(st.integers(1, 96)),
        dtype=draw(st.sampled_from(dtypes)),
        threshold=threshold,
        outlier_cols=outliers,
        has_fp16_weights=draw(st.booleans()),
        bias=draw(st.booleans()),
        call=draw(st.sampled_from(calls)),
        training=draw(st.booleans()),
        input_requires_grad=draw(st.booleans()),
        seed=draw(seeds),
        device=device,
    )


@st.composite
def lora_cases(
    draw: st.DrawFn,
    *,
    bases: tuple[str, ...] = ("4bit", "8bit"),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    device: str = "cpu",
) -> LoraCase:
    """LoRA (rank, alpha, dropout 0 and > 0 under a fixed seed) over a 4-bit or 8-bit base layer."""
    blocksize = draw(st.sampled_from(BLOCKSIZES))
    return LoraCase(
        base=draw(st.sampled_from(bases)),
        lead=draw(leading_dims(allow_empty=True)),
        in_features=draw(features(blocksize, max_size=128)),
        out_features=draw(st.integers(1, 64)),
        dtype=draw(st.sampled_from(dtypes)),
        rank=draw(st.sampled_from([1, 2, 4, 8, 16])),
        alpha=draw(st.sampled_from([1, 8, 16, 32])),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
        quant_type=draw(st.sampled_from(QUANT_TYPES)),
        compress_statistics=draw(st.booleans()),
        blocksize=blocksize,
        bias=draw(st.booleans()),
        input_requires_grad=draw(st.booleans()),
        seed=draw(seeds),
        device=device,
        use_rslora=draw(st.booleans()),
    )


# --- covering examples ---------------------------------------------------------------------------
#
# Why: hypothesis draws are not a uniform sample of the axes. Which code path runs is decided by a few
# categorical axes together (input rank x call form x x.requires_grad for 4-bit; the 3-D examples of a
# 60-example run were all the deprecated [K, N] call, which never reaches MatMul4Bit, or had
# x.requires_grad=False), so a bug on one such path can go unseen by a whole run. These lists hold
# every combination of the path-deciding axes once (run as explicit ``@example``s before the generated
# ones); the remaining axes are drawn from a fixed-seed generator so that each of their values appears.

#: input batch dims standing for 2-D, 3-D (batch > 1) and empty inputs
COVER_LEADS: tuple[tuple[int, ...], ...] = ((4,), (2, 3), (0,), (2, 0))


def covering_4bit_cases(
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    quant_types: tuple[str, ...] = QUANT_TYPES,
    calls: tuple[str, ...] = CALLS_4BIT,
    device: str = "cpu",
) -> list[Linear4bitCase]:
    """Input rank x call form x x.requires_grad, each combination once (other axes rotated)."""
    rnd = random.Random(4)
    out = []
    for lead, call, rg in itertools.product(COVER_LEADS, calls, (True, False)):
        blocksize = rnd.choice(BLOCKSIZES)
        k = blocksize * rnd.randint(1, 2) if rnd.random() < 0.5 else rnd.randint(3, 150)
        n = rnd.randint(2, 40)
        if call == "functional_kn" and k == n:
            n += 1
        out.append(
            Linear4bitCase(
                lead=lead,
                in_features=k,
                out_features=n,
                blocksize=blocksize,
                dtype=rnd.choice(dtypes),
                quant_type=rnd.choice(quant_types),
                compress_statistics=rnd.random() < 0.5,
                bias=rnd.random() < 0.5,
                call=call,
                input_requires_grad=rg,
                seed=rnd.randrange(2**16),
                device=device,
            )
        )
    return out


def covering_8bit_cases(
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    calls: tuple[str, ...] = CALLS_8BIT,
    device: str = "cpu",
) -> list[Linear8bitCase]:
    """Input rank x call form x training x has_fp16_weights x x.requires_grad x outliers, each once."""
    rnd = random.Random(8)
    out = []
    leads = COVER_LEADS[:3]
    for lead, call, training, fp16w, rg, thr in itertools.product(
        leads, calls, (True, False), (True, False), (True, False), (0.0, 6.0)
    ):
        k = rnd.randint(3, 150)
        outliers = tuple(sorted(rnd.sample(range(k), min(2, k)))) if thr > 0 else ()
        out.append(
            Linear8bitCase(
                lead=lead,
                in_features=k,
                out_features=rnd.randint(2, 40),
                dtype=rnd.choice(dtypes),
                threshold=thr,
                outlier_cols=outliers,
                has_fp16_weights=fp16w,
                bias=rnd.random() < 0.5,
                call=call,
                training=training,
                input_requires_grad=rg,
                seed=rnd.randrange(2**16),
                device=device,
            )
        )
    return out


def covering_lora_cases(
    *,
    bases: tuple[str, ...] = ("4bit", "8bit"),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    device: str = "cpu",
) -> list[LoraCase]:
    """Base x input rank x x.requires_grad x dropout (0 / > 0), each once (other axes rotated)."""
    rnd = random.Random(16)
    rslora = random.Random(17)  # its own generator: the other axes keep their values
    out = []
    for base, lead, rg, dropout in itertools.product(bases, COVER_LEADS[:3], (True, False), (0.0, 0.1)):
        blocksize = rnd.choice(BLOCKSIZES)
        out.append(
            LoraCase(
                base=base,
                lead=lead,
                in_features=rnd.randint(3, 128),
                out_features=rnd.randint(2, 40),
                dtype=rnd.choice(dtypes),
                rank=rnd.choice([1, 2, 4, 8]),
                alpha=rnd.choice([1, 8, 16, 32]),
                dropout=dropout,
                quant_type=rnd.choice(QUANT_TYPES),
                compress_statistics=rnd.random() < 0.5,
                blocksize=blocksize,
                bias=rnd.random() < 0.5,
                input_requires_grad=rg,
                seed=rnd.randrange(2**16),
                device=device,
                use_rslora=rslora.random() < 0.5,
            )
        )
    return out


def on_device(case: Linear4bitCase | Linear8bitCase | LoraCase, device: str):  # type: ignore[no-untyped-def]
    """The same case on another device (the ``gpu`` variants reuse the CPU strategies)."""
    return replace(case, device=device)
