"""Minimal reproductions of the bitsandbytes defects the gradient suite found (skipped there per example).

Each test states the *correct* behaviour. On the versions where the defect is known (``<= 0.50.2``) it is
a strict xfail that must fail with :class:`KnownDefect` -- raised only when the library fails with the
very error message of the defect -- so an unrelated failure is still reported, and a fix upstream turns
the xfail into XPASS (strict: an error) so that ``gradcheck.check_supported`` can stop skipping the case.
On newer versions they run as ordinary tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from packaging.version import Version

BNB_VERSION = bnb.__version__
#: last version on which the defects below are known to occur (checked against 0.50.2)
LAST_KNOWN_BAD = Version("0.50.2")
KNOWN_BAD = Version(BNB_VERSION) <= LAST_KNOWN_BAD


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


def known_defect(what: str, raises: type[BaseException] = KnownDefect) -> pytest.MarkDecorator:
    return pytest.mark.xfail(
        condition=KNOWN_BAD,
        strict=True,
        raises=raises,
        reason=f"bitsandbytes {BNB_VERSION}: {what}",
    )


def _two_element_weight() -> tuple[torch.Tensor, torch.Tensor, object]:
    """W [1, 2] (N=1, K=2): 2 four-bit codes pack into one byte, packed shape [1, 1]."""
    w = torch.tensor([[0.25, -0.5]], dtype=torch.float32)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert tuple(packed.shape) == (1, 1)
    return w, packed, qs


@known_defect(
    "dequantize_4bit reads a [1, 1] packed weight (N*K == 2) as transposed and returns W.T", AssertionError
)
def test_dequantize_4bit_of_one_byte_weight_has_the_quantized_shape() -> None:
    _, packed, qs = _two_element_weight()
    w_dq = bnbF.dequantize_4bit(packed, qs)
    assert tuple(w_dq.shape) == tuple(qs.shape), (
        f"dequantize_4bit gave {tuple(w_dq.shape)}, want {tuple(qs.shape)}"
    )


@known_defect(
    "MatMul4Bit.backward with a one-byte packed weight (N*K == 2): 'mat1 and mat2 shapes cannot be multiplied'"
)
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


@known_defect(
    "matmul_4bit with a weight quantized from [K, N] and N*K == 2: 'mat1 and mat2 shapes cannot be multiplied'"
)
def test_matmul_4bit_kn_form_with_one_byte_weight() -> None:
    w = torch.tensor([[0.25], [-0.5]], dtype=torch.float32)  # [K=2, N=1], the deprecated orientation
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    with defect("mat1 and mat2 shapes cannot be multiplied"):
        y = bnb.matmul_4bit(x, packed, quant_state=qs)
    w_dq = bnbF.dequantize_4bit(packed.reshape(-1, 1), qs).reshape(tuple(qs.shape))  # [K, N]
    torch.testing.assert_close(y, x @ w_dq)


@known_defect(
    "MatMul8bitFp.backward calls A.t() on a 3-D input when has_fp16_weights=True: 't() expects a tensor with <= 2 dimensions'"
)
def test_matmul_8bit_fp_backward_with_3d_input_and_fp16_weights() -> None:
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
