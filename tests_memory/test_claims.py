"""The seeds' memory claims, measured: the loss in bf16 (transformers PR 45769) and torch.no_grad()
around the dequantize + F.linear of bitsandbytes' forward (bitsandbytes PR 1935)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from memhelpers import BATCH, SEQ, need, release
from test_bnb_layers import IN, linear4bit, linear8bit

from vramguard.grad import capabilities, patches
from vramguard.measure.meters import SavedLimit, assert_within_budget, measure, report_section
from vramguard.model.layers import logits_fp32_bytes

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


def _forward_under_test(no_grad: bool, monkeypatch):  # type: ignore[no-untyped-def]
    """(context manager factory, description, call counter) for the MatMul4Bit.forward the claim is about: the
    installed one where it still calls F.linear (bitsandbytes <= 0.49; the PR's no_grad is the registered
    patch), else the old forward re-created (the installed one has no F.linear left to wrap)."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    patch = patches.get("no-grad-linear:4bit")
    if patch.applies():
        import bitsandbytes.functional as bnbF

        original = bnbF.dequantize_4bit
        calls = {"n": 0}

        def counting(*args, **kw):  # type: ignore[no-untyped-def]
            calls["n"] += 1  # the installed forward dequantizes once per call (backward is not run yet)
            return original(*args, **kw)

        monkeypatch.setattr(bnbF, "dequantize_4bit", counting)
        what = "installed MatMul4Bit.forward (dequantize + F.linear)"
        return (patch.apply if no_grad else contextlib.nullcontext), what, lambda: calls["n"]
    old_forward = _old_matmul4bit_forward(no_grad)
    monkeypatch.setattr(MatMul4Bit, "forward", old_forward)
    what = "old MatMul4Bit.forward re-created (the installed one does not call F.linear)"
    return contextlib.nullcontext, what, lambda: old_forward.__func__.calls


@pytest.mark.parametrize("no_grad", [False, True], ids=["as-is", "PR-1935-no_grad"])
def test_no_grad_claim_4bit(device: str, qlora, no_grad: bool, request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Inside autograd.Function.forward grad mode is off: F.linear saves nothing either way."""
    applied, what, calls = _forward_under_test(no_grad, monkeypatch)
    what += " + PR 1935 no_grad" if no_grad else ""
    model = linear4bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    with applied():
        m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert calls() == 1, "the forward under test did not run"  # else 0 B is vacuous
    assert_within_budget(m, SavedLimit(what, 0), request)
    need("transformers_4bit", device)
    q = qlora(device)
    batch = q.batch(0)
    with applied():
        mq, out = measure(
            lambda: q.model(**batch), model=q.model, device=device, roots=lambda o: o.loss, inputs=batch
        )
    assert calls() > 1, "the QLoRA model's 4-bit layers did not run the forward under test"
    assert not [k for k in mq.kept if k.kind == "weight-copy"], mq.table()
    report_section(
        request,
        "no_grad claim",
        f"QLoRA model saved bytes, {what}: {mq.ledger_bytes()} B; weight copies: 0 B",
    )
    request.node.user_properties.append(("saved_bytes", mq.ledger_bytes()))
    out.loss.backward()
    release(q.model)


def _grads(model: torch.nn.Module, x: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if x is not None and x.grad is not None:
        out["input"] = x.grad.detach().clone()
    return out


def test_no_grad_patch_4bit_measured(device: str, qlora, request) -> None:  # type: ignore[no-untyped-def]
    """bitsandbytes PR 1935 applied to the installed MatMul4Bit.forward (where it still calls F.linear:
    0.49.x and older): saved bytes with and without it are equal (grad mode is off inside
    Function.forward), and outputs and gradients are bit-identical."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    patch = patches.get("no-grad-linear:4bit")
    if not (can := patch.applies()):
        pytest.skip(f"nothing to measure: {can.reason}; test_no_grad_claim_4bit measures the old forward")
    original_code = MatMul4Bit.forward.__code__
    rows = []
    model = linear4bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    g = torch.randn(BATCH, SEQ, model.layer.out_features, dtype=torch.bfloat16, device=device)
    runs = {}
    for patched in (False, True):
        x.grad = None
        with patch.apply() if patched else contextlib.nullcontext():
            assert (MatMul4Bit.forward.__code__ is not original_code) == patched, (
                "the patch did not take effect"
            )
            m, y = measure(lambda: model(x), model=model, device=device, inputs=x)
            y.backward(g)
        runs[patched] = (m, y.detach().clone(), _grads(model, x))
    (m0, y0, g0), (m1, y1, g1) = runs[False], runs[True]
    assert m0.ledger_bytes() == m1.ledger_bytes() and m0.tracker_bytes() == m1.tracker_bytes(), (
        m0.table(),
        m1.table(),
    )
    assert torch.equal(y0, y1) and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    rows.append(
        f"Linear4bit: {m0.ledger_bytes()} B -> {m1.ledger_bytes()} B, output and grad_input bit-identical"
    )
    if capabilities.get("transformers_4bit"):
        q = qlora(device)
        batch = q.batch(0)
        qruns = {}
        for patched in (False, True):
            release(q.model)
            with patch.apply() if patched else contextlib.nullcontext():
                mq, out = measure(
                    lambda: q.model(**batch),
                    model=q.model,
                    device=device,
                    roots=lambda o: o.loss,
                    inputs=batch,
                )
                out.loss.backward()
            qruns[patched] = (mq, out.loss.detach().clone(), _grads(q.model))
        release(q.model)
        (q0, l0, qg0), (q1, l1, qg1) = qruns[False], qruns[True]
        assert q0.ledger_bytes() == q1.ledger_bytes() and q0.tracker_bytes() == q1.tracker_bytes()
        assert not [k for k in q0.kept + q1.kept if k.kind == "weight-copy"]
        assert torch.equal(l0, l1) and qg0.keys() == qg1.keys() and qg0
        assert all(torch.equal(qg0[k], qg1[k]) for k in qg0), "a LoRA gradient changed under the patch"
        rows.append(
            f"QLoRA tiny-llama: {q0.ledger_bytes()} B -> {q1.ledger_bytes()} B saved for backward, "
            f"weight copies 0 B, loss and {len(qg0)} LoRA gradients bit-identical"
        )
    text = (
        f"bitsandbytes {capabilities.bnb_version()}, PR 1935 no_grad on the installed forward: "
        + "; ".join(rows)
    )
    report_section(request, "no_grad claim (PR 1935, installed forward)", text)
    request.node.user_properties.append(("no_grad_claim", text))


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
