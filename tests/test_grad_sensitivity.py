"""The gradient properties must catch each deliberately broken backward, and pass without it.

Each injection replaces one bitsandbytes backward through ``monkeypatch`` (undone after the test) with
one that is wrong in a way a real patch could be; the same strategies and :func:`gradcheck.check` that
``tests_grad`` uses must then report a :class:`GradMismatch` with a one-line message.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from bitsandbytes.autograd import _functions as bnbfn
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from vramguard.grad import runner as gradcheck
from vramguard.grad import strategies

FAST = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failure is enough here
    report_multiple_bugs=False,  # stop at the first failing explicit example too
    suppress_health_check=list(HealthCheck),
)


def _run_properties(strategy: st.SearchStrategy[gradcheck.Case], examples: list[gradcheck.Case]) -> None:
    """What tests_grad runs: the covering examples first (explicit phase; those this bitsandbytes cannot run
    here are assumed away, as tests_grad's ``covering`` leaves them), then generated cases."""

    def prop(case: gradcheck.Case) -> None:
        try:
            gradcheck.check_supported(case)
        except gradcheck.Unsupported:
            assume(False)
        gradcheck.check(case)

    for case in reversed(examples):
        prop = example(case=case)(prop)
    FAST(given(case=strategy)(prop))()


def _wrap_backward(cls: type, edit: Callable[[object, tuple], tuple]) -> Callable:
    original = cls.backward

    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        return edit(ctx, tuple(original(ctx, grad_output)))

    return staticmethod(backward)


def _scale_grad_a(factor: float, when: Callable[[object], bool] = lambda ctx: True):
    def edit(ctx, grads):  # type: ignore[no-untyped-def]
        if grads[0] is not None and when(ctx):
            grads = (grads[0] * factor, *grads[1:])
        return grads

    return edit


def _zero_bias(ctx, grads):  # type: ignore[no-untyped-def]
    return grads if grads[3] is None else (*grads[:3], torch.zeros_like(grads[3]), grads[4])


def _fp4_as_nf4_backward(ctx, grad_output):  # type: ignore[no-untyped-def]
    import bitsandbytes.functional as F

    if ctx.is_empty:
        return bnbfn.MatMul4Bit.__dict__["_vg_original"].__func__(ctx, grad_output)
    state = copy.copy(ctx.state)
    state.quant_type = "nf4"
    grad_a = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.matmul(grad_output, F.dequantize_4bit(ctx.tensors[1], state).to(grad_output.dtype))
    grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias) if ctx.needs_input_grad[3] else None
    return grad_a, None, None, grad_bias, None


def _8bit_missing_127(ctx, grads):  # type: ignore[no-untyped-def]
    if grads[0] is None:
        return grads
    return (grads[0] * 127.0, *grads[1:])  # CB * SCB instead of CB * SCB / 127


CPU4 = (strategies.linear4bit_cases(), strategies.covering_4bit_cases())
CPU8 = (strategies.linear8bit_cases(), strategies.covering_8bit_cases())
INJECTIONS = {
    "grad_A scaled by 1.01 (4-bit)": (
        bnbfn.MatMul4Bit,
        lambda: _wrap_backward(bnbfn.MatMul4Bit, _scale_grad_a(1.01)),
        CPU4,
    ),
    "bias gradient zeroed (4-bit)": (
        bnbfn.MatMul4Bit,
        lambda: _wrap_backward(bnbfn.MatMul4Bit, _zero_bias),
        CPU4,
    ),
    "fp4 backward uses the nf4 code": (bnbfn.MatMul4Bit, lambda: staticmethod(_fp4_as_nf4_backward), CPU4),
    "error only for 3-D inputs": (
        bnbfn.MatMul4Bit,
        lambda: _wrap_backward(bnbfn.MatMul4Bit, _scale_grad_a(1.01, lambda ctx: ctx.dim3)),
        CPU4,
    ),
    "error only with nested statistics": (
        bnbfn.MatMul4Bit,
        lambda: _wrap_backward(
            bnbfn.MatMul4Bit, _scale_grad_a(1.01, lambda ctx: not ctx.is_empty and ctx.state.nested)
        ),
        CPU4,
    ),
    "8-bit grad missing the 1/127 factor": (
        bnbfn.MatMul8bitFp,
        lambda: _wrap_backward(bnbfn.MatMul8bitFp, _8bit_missing_127),
        CPU8,
    ),
}


@pytest.fixture
def remember_3d(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let injected backwards know whether the input was 3-D (ctx.dim3), as a real bug would."""
    original = bnbfn.MatMul4Bit.forward

    def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[no-untyped-def]
        ctx.dim3 = A.dim() == 3
        return original(ctx, A, B, out, bias, quant_state)

    monkeypatch.setattr(bnbfn.MatMul4Bit, "forward", staticmethod(forward))


@pytest.mark.parametrize("name", list(INJECTIONS))
def test_broken_backward_is_reported(name: str, monkeypatch: pytest.MonkeyPatch, remember_3d: None) -> None:
    cls, make, (strategy, examples) = INJECTIONS[name]
    monkeypatch.setattr(cls, "_vg_original", cls.__dict__["backward"], raising=False)
    monkeypatch.setattr(cls, "backward", make())
    with pytest.raises(gradcheck.GradMismatch) as info:
        _run_properties(strategy, examples)
    message = str(info.value)
    assert "\n" not in message, message
    assert " > tol " in message or "missing" in message or "dtype/shape" in message, message
    assert "| patch=none" in message and "seed=" in message, message


@pytest.mark.parametrize("name", ["grad_A scaled by 1.01 (4-bit)", "8-bit grad missing the 1/127 factor"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_one_percent_error_fails_in_every_dtype(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, make, _ = INJECTIONS[name]
    if name.startswith("grad_A"):
        strategy, examples = (
            strategies.linear4bit_cases(dtypes=(dtype,)),
            strategies.covering_4bit_cases(dtypes=(dtype,)),
        )
    else:
        strategy, examples = (
            strategies.linear8bit_cases(dtypes=(dtype,)),
            strategies.covering_8bit_cases(dtypes=(dtype,)),
        )
    monkeypatch.setattr(cls, "backward", make())
    with pytest.raises(gradcheck.GradMismatch):
        _run_properties(strategy, examples)


@pytest.mark.parametrize("family", [CPU4, CPU8], ids=["4bit", "8bit"])
def test_properties_pass_without_injection(
    family: tuple[st.SearchStrategy[gradcheck.Case], list[gradcheck.Case]],
) -> None:
    _run_properties(*family)


# --- faults in the state the library derives (the references must not read it on trust) ---------------
#
# Each of these is consistent between the layer's forward and backward, so a reference that took the
# state from the object under test (PEFT's layer.scaling, bitsandbytes' quant_state / SCB, its
# dequantize_4bit) would agree with it and pass. The reference computes it from the configuration.


def _squared_lora_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    from peft.tuners.lora.layer import LoraLayer

    original = LoraLayer.update_layer

    def update_layer(self, adapter_name, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(self, adapter_name, *args, **kwargs)
        self.scaling[adapter_name] = self.scaling[adapter_name] ** 2  # PEFT computing alpha/r squared
        return out

    monkeypatch.setattr(LoraLayer, "update_layer", update_layer)


def _rslora_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from peft.tuners.lora.layer import LoraLayer

    original = LoraLayer.update_layer

    def update_layer(self, adapter_name, r, lora_alpha, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(self, adapter_name, r, lora_alpha, *args, **kwargs)
        self.scaling[adapter_name] = lora_alpha / r  # use_rslora=True, but alpha / r instead of / sqrt(r)
        return out

    monkeypatch.setattr(LoraLayer, "update_layer", update_layer)


def _quantize_4bit_as(monkeypatch: pytest.MonkeyPatch, edit: Callable) -> None:  # type: ignore[type-arg]
    import bitsandbytes.functional as bnbF

    original = bnbF.quantize_4bit

    def quantize_4bit(A, *args, **kwargs):  # type: ignore[no-untyped-def]
        return edit(original, A, *args, **kwargs)

    monkeypatch.setattr(bnbF, "quantize_4bit", quantize_4bit)


def _fp4_stored_as_nf4(monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(original, A, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["quant_type"] = "nf4"  # the library ignores the requested quant_type
        return original(A, *args, **kwargs)

    _quantize_4bit_as(monkeypatch, edit)


def _4bit_absmax_one_percent_high(monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(original, A, *args, **kwargs):  # type: ignore[no-untyped-def]
        packed, state = original(A, *args, **kwargs)
        if not state.nested:
            state.absmax = state.absmax * 1.01
        return packed, state

    _quantize_4bit_as(monkeypatch, edit)


def _int8_row_scale_one_percent_high(monkeypatch: pytest.MonkeyPatch) -> None:
    import bitsandbytes.functional as bnbF

    original = bnbF.int8_vectorwise_quant

    def int8_vectorwise_quant(A, *args, **kwargs):  # type: ignore[no-untyped-def]
        cb, scb, cols = original(A, *args, **kwargs)
        return cb, scb * 1.01, cols

    monkeypatch.setattr(bnbF, "int8_vectorwise_quant", int8_vectorwise_quant)


CPU_LORA = (strategies.lora_cases(), strategies.covering_lora_cases())
STATE_FAULTS = {
    "PEFT's LoRA scaling squared": (_squared_lora_scaling, CPU_LORA, "rel err"),
    "PEFT ignores use_rslora": (_rslora_ignored, CPU_LORA, "rslora"),
    "quantize_4bit stores fp4 as nf4": (_fp4_stored_as_nf4, CPU4, "4-bit codes"),
    "4-bit block scale 1% high": (_4bit_absmax_one_percent_high, CPU4, "4-bit state: block"),
    "int8 row scale (SCB/SCA) 1% high": (_int8_row_scale_one_percent_high, CPU8, "8-bit weight: row"),
}


@pytest.mark.parametrize("name", list(STATE_FAULTS))
def test_wrong_library_state_is_reported(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inject, (strategy, examples), needle = STATE_FAULTS[name]
    inject(monkeypatch)
    with pytest.raises(gradcheck.GradMismatch) as info:
        _run_properties(strategy, examples)
    message = str(info.value)
    assert "\n" not in message and "| patch=none" in message and "seed=" in message, message
    assert needle in message, message


def test_lora_properties_pass_without_injection() -> None:
    """The LoRA family (incl. rsLoRA cases) passes with the library as installed: the faults above are
    what fails, not the reference."""
    strategy, examples = CPU_LORA
    assert any(c.use_rslora and c.rank > 1 for c in gradcheck.supported_cases(examples))
    _run_properties(strategy, examples)
