"""The seeds' memory claims, measured: the loss in bf16 (transformers PR 45769) and torch.no_grad()
around the dequantize + F.linear of bitsandbytes' forward (bitsandbytes PR 1935)."""

from __future__ import annotations

import pytest
import torch
from memhelpers import BATCH, SEQ, release
from test_bnb_layers import IN, linear4bit, linear8bit

from vramguard import patches
from vramguard.budgets import Budget, assert_within_budget, measure, report_section
from vramguard.layer_budget import logits_fp32_bytes

LAYERS = "base_model.model.model.layers"


def _loss_part(m):  # type: ignore[no-untyped-def]
    return [
        k
        for k in m.kept
        if not k.module.startswith(LAYERS) and not k.module.startswith("base_model.model.model.norm")
    ]


def _run(q, bf16_loss: bool):  # type: ignore[no-untyped-def]
    batch = q.batch(0)
    dev = torch.device(q.config.device).type

    def fn():  # type: ignore[no-untyped-def]
        if bf16_loss:  # what the PR does: autocast the forward so logits stay bf16
            with torch.autocast(dev, dtype=torch.bfloat16):
                return q.model(**batch)
        return q.model(**batch)

    return measure(fn, model=q.model, device=q.config.device, roots=lambda o: o.loss, inputs=batch)


def test_loss_keeps_fp32_logits_and_bf16_loss_saves_nothing_of_it(device: str, qlora, request) -> None:  # type: ignore[no-untyped-def]
    """The fp32 logits the loss keeps (4*b*s*V) vs the loss in bf16: the real delta, stated."""
    q = qlora(device)
    T, V, h = BATCH * SEQ, q.spec.fields["vocab_size"], q.spec.fields["hidden_size"]
    upcast = logits_fp32_bytes(BATCH, SEQ, V)
    m32, out32 = _run(q, False)
    loss32 = [k for k in _loss_part(m32) if k.shape == (T, V)]
    assert [(k.dtype, k.bytes) for k in loss32] == [("float32", upcast)], m32.table(_loss_part(m32))
    out32.loss.backward()
    m16, out16 = _run(q, True)
    assert out16.logits.dtype == torch.bfloat16  # the PR's premise holds: logits are bf16 ...
    loss16 = [k for k in _loss_part(m16) if k.shape == (T, V)]
    # ... but transformers' ForCausalLMLoss upcasts them again, and log_softmax keeps the fp32 copy
    assert [(k.dtype, k.bytes) for k in loss16] == [("float32", upcast)], m16.table(_loss_part(m16))
    # and autocast makes lm_head keep a bf16 copy of its (fp32, trainable-path) weight: +2*V*h
    delta_loss = m16.ledger_bytes(_loss_part(m16)) - m32.ledger_bytes(_loss_part(m32))
    assert delta_loss == 2 * V * h, (m32.table(_loss_part(m32)), m16.table(_loss_part(m16)))
    delta_out = out16.logits.untyped_storage().nbytes() - out32.logits.untyped_storage().nbytes()
    assert delta_out == -2 * T * V  # the only saving: the logits *output* tensor is half the size
    text = (
        f"fp32 logits kept by the loss: {upcast} B (4*T*V) with or without the bf16 loss; "
        f"saved-for-backward delta of lm_head+loss: {delta_loss:+d} B (lm_head weight copy 2*V*h); "
        f"logits output tensor delta: {delta_out:+d} B; whole-model saved delta: "
        f"{m16.ledger_bytes() - m32.ledger_bytes():+d} B (of {m32.ledger_bytes()} B)"
    )
    report_section(request, "bf16 loss (transformers PR 45769)", text)
    out16.loss.backward()
    release(q.model)


def _old_matmul4bit_forward(no_grad: bool):  # type: ignore[no-untyped-def]
    """MatMul4Bit.forward as bitsandbytes < 0.45 wrote it (dequantize + F.linear), with and without
    the PR's torch.no_grad() -- the code the claim was made about."""
    import bitsandbytes.functional as F

    def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[no-untyped-def]
        forward.calls += 1  # type: ignore[attr-defined]
        ctx.is_empty = False
        B = B.view(-1, 1)
        if no_grad:
            with torch.no_grad():
                output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        else:
            output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (None, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    forward.calls = 0  # type: ignore[attr-defined]
    return staticmethod(forward)


@pytest.mark.parametrize("no_grad", [False, True], ids=["as-is", "PR-1935-no_grad"])
def test_no_grad_claim_4bit(device: str, qlora, no_grad: bool, request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Inside autograd.Function.forward grad mode is off: F.linear saves nothing either way."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    assert not patches.get("no-grad-linear:4bit").applies(), "the installed MatMul4Bit calls F.linear again"
    old_forward = _old_matmul4bit_forward(no_grad)
    monkeypatch.setattr(MatMul4Bit, "forward", old_forward)
    model = linear4bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert old_forward.__func__.calls == 1, "the old forward under test did not run"  # else 0 B is vacuous
    assert_within_budget(m, Budget("old MatMul4Bit" + (" + no_grad" if no_grad else ""), 0), request)
    q = qlora(device)
    batch = q.batch(0)
    mq, out = measure(
        lambda: q.model(**batch), model=q.model, device=device, roots=lambda o: o.loss, inputs=batch
    )
    assert old_forward.__func__.calls > 1, "the QLoRA model's 4-bit layers did not run the old forward"
    assert not [k for k in mq.kept if k.kind == "weight-copy"], mq.table()
    report_section(
        request,
        "no_grad claim",
        f"QLoRA model saved bytes with old MatMul4Bit "
        f"{'with' if no_grad else 'without'} no_grad: {mq.ledger_bytes()} B; weight copies: 0 B",
    )
    request.node.user_properties.append(("saved_bytes", mq.ledger_bytes()))
    out.loss.backward()
    release(q.model)


def test_no_grad_claim_8bit_patch(device: str, request) -> None:  # type: ignore[no-untyped-def]
    """The registered patch (8-bit CPU path) changes the saved bytes by exactly 0 B."""
    patch = patches.get("no-grad-linear:8bit-fp")
    if not patch.applies():
        pytest.skip(f"patch does not apply to the installed bitsandbytes: {patch.applies().reason}")
    model = linear8bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    before, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    with patch.apply():
        after, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert before.ledger_bytes() == after.ledger_bytes() == x.numel() * x.element_size()
    assert before.tracker_bytes() == after.tracker_bytes()
    report_section(
        request, "no_grad claim (8-bit)", f"saved {before.ledger_bytes()} B -> {after.ledger_bytes()} B"
    )
