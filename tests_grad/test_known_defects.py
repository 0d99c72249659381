"""Minimal reproductions of the bitsandbytes defects the suites found (skipped there per example).

Each test states the *correct* behaviour. On the releases where the defect is known to reproduce
(:data:`vramguard.grad.capabilities.KNOWN_DEFECTS`: a version range checked on 0.46.0 ... 0.50.2; for a
defect that depends on the processor, the probe on this machine) it is a strict xfail that must fail with
:class:`KnownDefect` -- raised only when the library fails with the very error of the defect -- so an
unrelated failure is still reported, and a fix upstream turns the xfail into XPASS (strict: an error).
Elsewhere they run as ordinary tests: a release before the range must behave correctly, and one after
it that still has the defect fails until the range is extended. A reproducer that needs a capability the
release lacks (fp4 on CPU, whole-block weights) is skipped with that capability's reason.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch

from vramguard.grad import capabilities

BNB_VERSION = bnb.__version__


class KnownDefect(RuntimeError):
    """The library failed with exactly the error of the recorded defect."""


@contextlib.contextmanager
def defect(message: str) -> Iterator[None]:
    """Turn a RuntimeError containing ``message`` into :class:`KnownDefect`; anything else propagates."""
    try:
        yield
    except RuntimeError as exc:
        if message in str(exc):
            raise KnownDefect(f"{type(exc).__name__}: {exc}") from exc
        raise


def known_defect(key: str, raises: type[BaseException] = KnownDefect) -> pytest.MarkDecorator:
    """A strict xfail where the defect is expected here. The condition is a string, which pytest evaluates
    when the test runs, not at import: a defect that depends on the processor asks this machine's probes
    (:func:`~vramguard.grad.capabilities.get`), and a worker collecting this module would otherwise wait for
    the probes' child that the root conftest starts with the run."""
    d = capabilities.KNOWN_DEFECTS[key]
    where = (
        f"on this CPU: {capabilities.cpu_description()} [{capabilities.cpu_flags()}], " if d.hardware else ""
    )
    return pytest.mark.xfail(
        condition=f"capabilities.KNOWN_DEFECTS[{key!r}].expected_here()",
        strict=True,
        raises=raises,
        reason=f"bitsandbytes {BNB_VERSION} ({where}known in {d.first}..{d.last}): {d.what}",
    )


def need(name: str) -> None:
    """Skip, naming the capability, when the installed release lacks what the reproducer needs."""
    cap = capabilities.get(name)
    if not cap:
        pytest.skip(f"bitsandbytes {BNB_VERSION} lacks {name}: {cap.detail}")


def _two_element_weight() -> tuple[torch.Tensor, torch.Tensor, object]:
    """W [1, 2] (N=1, K=2): 2 four-bit codes pack into one byte, packed shape [1, 1]."""
    need("blocksize_remainder_cpu")
    w = torch.tensor([[0.25, -0.5]], dtype=torch.float32)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert tuple(packed.shape) == (1, 1)
    return w, packed, qs


@known_defect("one_byte_weight", AssertionError)
def test_dequantize_4bit_of_one_byte_weight_has_the_quantized_shape() -> None:
    _, packed, qs = _two_element_weight()
    w_dq = bnbF.dequantize_4bit(packed, qs)
    assert tuple(w_dq.shape) == tuple(qs.shape), (
        f"dequantize_4bit gave {tuple(w_dq.shape)}, want {tuple(qs.shape)}"
    )


@known_defect("one_byte_backward")
def test_matmul_4bit_backward_with_one_byte_weight() -> None:
    _, packed, qs = _two_element_weight()
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], requires_grad=True)
    y = bnb.matmul_4bit(x, packed, quant_state=qs)
    g = torch.tensor([[1.0], [-2.0], [0.5]])
    with defect("mat1 and mat2 shapes cannot be multiplied"):
        y.backward(g)
    # correct: dL/dx = g @ W_dq, W_dq the [N, K] weight the forward multiplied by
    w_dq = bnbF.dequantize_4bit(packed.reshape(-1, 1), qs).reshape(tuple(qs.shape))
    torch.testing.assert_close(x.grad, g @ w_dq)


@known_defect("one_byte_weight")
def test_matmul_4bit_kn_form_with_one_byte_weight() -> None:
    need("blocksize_remainder_cpu")
    need("matmul_4bit:functional_kn")
    w = torch.tensor([[0.25], [-0.5]], dtype=torch.float32)  # [K=2, N=1], the deprecated orientation
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    with defect("mat1 and mat2 shapes cannot be multiplied"):
        y = bnb.matmul_4bit(x, packed, quant_state=qs)
    w_dq = bnbF.dequantize_4bit(packed.reshape(-1, 1), qs).reshape(tuple(qs.shape))  # [K, N]
    torch.testing.assert_close(y, x @ w_dq)


@known_defect("8bit_fp_3d_backward")
def test_matmul_8bit_fp_backward_with_3d_input_and_fp16_weights() -> None:
    need("cpu_8bit_training_fp")
    state = bnb.MatmulLtState()
    state.has_fp16_weights = True
    state.is_training = True  # CPU training: bnb.matmul dispatches to MatMul8bitFp
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=gen).requires_grad_(True)
    x = torch.randn(2, 3, 8, generator=gen).requires_grad_(True)
    y = bnb.matmul(x, w, state=state)
    g = torch.randn(2, 3, 4, generator=gen)
    with defect("t() expects a tensor with <= 2 dimensions"):
        y.backward(g)
    # correct: the straight-through weight gradient summed over every leading dim
    torch.testing.assert_close(w.grad, g.reshape(-1, 4).T @ x.detach().reshape(-1, 8))
    assert x.grad is not None and x.grad.shape == x.shape


@known_defect("odd_numel_4bit")
def test_quantize_4bit_of_odd_number_of_elements() -> None:
    need("blocksize_remainder_cpu")
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))  # 15 codes: the last byte is half full
    with defect("must match the size of tensor"):
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    w_dq = bnbF.dequantize_4bit(packed, qs)
    assert tuple(w_dq.shape) == (3, 5)
    torch.testing.assert_close(w_dq, w, atol=0.15 * w.abs().max().item(), rtol=0)


#: the reproducer; on the affected releases it kills its process
NESTED_ONE_BLOCK = """
import torch, bitsandbytes.functional as F
w = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
print(F.dequantize_4bit(packed, qs).isfinite().all().item())
"""


@known_defect("nested_single_block")
def test_nested_statistics_of_one_block_weight(capsys: pytest.CaptureFixture[str]) -> None:
    """In a child process where this machine's probe (the same call, in the probes' child) did not come back
    whole: a crash is the defect. Where the probe's child lived through it, in this process (a child costs the
    imports of torch and bitsandbytes again, 3 CPU s)."""
    if capabilities.get("defect:nested_single_block").ok:
        exec(NESTED_ONE_BLOCK, {})
        printed = capsys.readouterr().out
    else:
        out = subprocess.run(
            [sys.executable, "-c", NESTED_ONE_BLOCK], capture_output=True, text=True, timeout=300, check=False
        )
        if out.returncode < 0:
            raise KnownDefect(
                f"quantize_4bit(randn(1, 64), blocksize=64, compress_statistics=True) "
                f"{capabilities._describe_exit(out.returncode)}"
            )
        assert out.returncode == 0, out.stderr[-2000:]
        printed = out.stdout
    assert printed.strip().splitlines()[-1] == "True", printed


def _int8_k1_products() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """int8_linear_matmul(A[M, 1], B[N, 1]) and the exact product, for distinct nonzero inputs."""
    out = []
    for m, n, shift in ((2, 3, 0), (1, 4, 7), (5, 2, 19)):
        a = (torch.arange(1, m + 1, dtype=torch.int8) + shift).reshape(m, 1)
        b = (torch.arange(-n, 0, dtype=torch.int8) * 3).reshape(n, 1)
        out.append((bnbF.int8_linear_matmul(a, b).long(), a.long() @ b.long().T))
    return out


@known_defect("int8_k1_cpu", AssertionError)
def test_int8_linear_matmul_with_one_input_feature() -> None:
    for got, want in _int8_k1_products():
        assert torch.equal(got, want), f"int8_linear_matmul K=1: {got.tolist()} != {want.tolist()}"


@known_defect("int8_k1_cpu", AssertionError)
def test_linear8bit_inference_with_one_input_feature() -> None:
    """The user-level symptom: Linear8bitLt (inference, K=1) returns garbage on the affected CPUs."""
    layer = bnb.nn.Linear8bitLt(1, 3, bias=False, has_fp16_weights=False)
    dense = torch.nn.Linear(1, 3, bias=False, dtype=torch.float16)
    with torch.no_grad():
        dense.weight.copy_(torch.tensor([[0.5], [-1.0], [0.25]]))
    layer.load_state_dict(dense.state_dict())
    layer.eval()
    x = torch.tensor([[1.0], [2.0], [-3.0], [0.5]], dtype=torch.float16)
    for _ in range(3):
        y = layer(x)
        torch.testing.assert_close(y, dense(x), rtol=2e-2, atol=2e-2)


@known_defect("kn_one_row")
def test_matmul_4bit_kn_form_with_one_row_input_without_grad() -> None:
    """The inference path (gemv_4bit: one row, no grad) of the deprecated [K, N] orientation."""
    need("matmul_4bit:functional_kn")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 1, generator=gen)  # [K=32, N=1], the case the property test drew
    packed, qs = bnbF.quantize_4bit(w, blocksize=32, quant_type="nf4")
    x = torch.randn(1, 32, generator=gen)
    with defect("mat1 and mat2 shapes cannot be multiplied"):
        y = bnb.matmul_4bit(x, packed, quant_state=qs)
    torch.testing.assert_close(y, x @ bnbF.dequantize_4bit(packed, qs))


@known_defect("fp4_codes_cpu", AssertionError)
def test_fp4_quantization_stores_the_nearest_code() -> None:
    """Every element of an fp4 weight is stored as its nearest fp4 code (the reference decodes the
    packed bytes itself). Which CPU kernel runs, and whether it rounds right, depends on the processor."""
    need("fp4_cpu")
    from vramguard.grad import reference

    gen = torch.Generator().manual_seed(54256)
    for shape, dtype, blocksize in capabilities._FP4_CODE_CASES:
        w = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
        packed, qs = bnbF.quantize_4bit(w, blocksize=blocksize, quant_type="fp4")
        try:
            reference.check_4bit_quantization(w, packed, qs.absmax, blocksize, "fp4", nested=False)
        except reference.StateMismatch as exc:
            raise AssertionError(f"{capabilities.cpu_description()}: {exc}") from exc


@known_defect("partial_block_16bit", AssertionError)
def test_16bit_partial_block_stores_the_nearest_code() -> None:
    """A bfloat16 and a float16 weight whose last block is partial: every element of that block is stored as
    its nearest nf4 code (each is built so that dividing in its own dtype would move some to the farther code)."""
    need("blocksize_remainder_cpu")
    from vramguard.grad import reference

    for dtype in ("bfloat16", "float16"):
        w = capabilities.partial_block_traps(64, dtype)
        packed, qs = bnbF.quantize_4bit(w.reshape(1, -1), blocksize=64, quant_type="nf4")
        try:
            reference.check_4bit_quantization(w, packed, qs.absmax, 64, "nf4", nested=False)
        except reference.StateMismatch as exc:
            raise AssertionError(f"{dtype}: {exc}") from exc


@known_defect("dynamic_map_cpu", AssertionError)
def test_quantize_blockwise_leaves_its_code_map_alone() -> None:
    """``quantize_blockwise`` with the default dynamic map: the map is not changed by the call, and a value
    nearest to its most negative code (-0.99297) is stored as that code."""
    from vramguard.grad import reference

    code = bnbF.create_dynamic_map(signed=True)
    given = code.clone()
    x = torch.zeros(256)
    x[0], x[1] = 1.0, -0.99
    q, _ = bnbF.quantize_blockwise(x, code=code, blocksize=256)
    assert torch.equal(code, given), f"code[0] {given[0].item():.5f} -> {code[0].item():.5f}"
    assert given[q[1].long()].item() == pytest.approx(reference.DYNAMIC_CODE[0])
