"""The suite can fail: each fault is injected by a fixture, must be caught by the budget check that
guards against it (and by the probe named), and the same check passes again once it is removed."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from memhelpers import BATCH, RANK, SEQ, release
from test_bnb_layers import IN, linear4bit
from test_lora_adapters import lora

from vramguard.measure.meters import SavedLimit, check_limit, measure
from vramguard.model.layers import checkpointed_layer_bytes, logits_fp32_bytes, lora_adapter_bytes

LAYERS = "base_model.model.model.layers"


def _matmul4bit_fault(keep: str):  # type: ignore[no-untyped-def]
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[no-untyped-def]
            w = bnb.functional.dequantize_4bit(B.view(-1, 1), quant_state).to(A.dtype)
            if keep == "save_for_backward":
                ctx.save_for_backward(w)
            else:
                ctx.w_cache = w
            return original(ctx, A, B, out, bias, quant_state)

        MatMul4Bit.forward = staticmethod(forward)
        try:
            yield
        finally:
            MatMul4Bit.forward = staticmethod(original)

    return inject


@pytest.fixture
def dequant_saved_for_backward():  # type: ignore[no-untyped-def]
    return _matmul4bit_fault("save_for_backward")


@pytest.fixture
def dequant_in_ctx_attribute():  # type: ignore[no-untyped-def]
    return _matmul4bit_fault("ctx")


@pytest.mark.parametrize(
    ("fault", "probe"), [("dequant_saved_for_backward", "hook"), ("dequant_in_ctx_attribute", "ctx")]
)
def test_4bit_weight_copy_is_caught(device: str, fault: str, probe: str, request) -> None:  # type: ignore[no-untyped-def]
    inject = request.getfixturevalue(fault)
    model = linear4bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    budget = SavedLimit("Linear4bit", 0)
    with inject():
        m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    v = check_limit(m, budget)
    assert not v.ok and (f"via {probe}" in v.failures[0] or "via ctx.w_cache" in v.failures[0]), v.failures
    assert [k.kind for k in m.kept] == ["weight-copy"] and m.kept[0].source == probe
    if probe == "ctx":
        assert m.hook_bytes == 0, "hooks alone would have passed it: the ctx probe is needed"
    m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert check_limit(m, budget).ok


@pytest.fixture
def matmul4bit_keeps_its_input():  # type: ignore[no-untyped-def]
    """bitsandbytes' "QLoRA memory bug" (Feb 2023 until 0.43.2): MatMul4Bit.forward kept its input A in
    ``ctx.tensors = (A, B)`` for a backward that never reads it (the 4-bit weight is frozen, so there is no
    grad_B): one activation per 4-bit layer, 10.1 GB per sequence at 70B by bitsandbytes' changelog."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[no-untyped-def]
            output = original(ctx, A, B, out, bias, quant_state)
            if isinstance(getattr(ctx, "tensors", None), tuple) and any(ctx.needs_input_grad[:2]):
                ctx.tensors = (A, *ctx.tensors[1:])  # as before 0.43.2
            return output

        MatMul4Bit.forward = staticmethod(forward)
        try:
            yield
        finally:
            MatMul4Bit.forward = staticmethod(original)

    return inject


def test_kept_input_activation_is_caught(device: str, matmul4bit_keeps_its_input) -> None:  # type: ignore[no-untyped-def]
    """The pre-0.43.2 MatMul4Bit fails the 4-bit layer's budget (it keeps nothing): its input, found in ctx."""
    model = linear4bit(device)
    x = torch.randn(BATCH, SEQ, IN, dtype=torch.bfloat16, device=device, requires_grad=True)
    budget = SavedLimit("Linear4bit", 0)

    def forward():  # type: ignore[no-untyped-def]
        return model(x * 2)  # the layer's input is an activation of the step, as in a model

    with matmul4bit_keeps_its_input():
        m, _ = measure(forward, model=model, device=device, inputs=x)
    v = check_limit(m, budget)
    assert not v.ok and "via ctx.tensors[0]" in v.failures[0], v.failures
    assert [(k.kind, k.source, k.bytes) for k in m.kept] == [("activation", "ctx", BATCH * SEQ * IN * 2)]
    m, _ = measure(forward, model=model, device=device, inputs=x)
    assert check_limit(m, budget).ok


def test_bisect_probe_sees_the_kept_input(device: str, matmul4bit_keeps_its_input) -> None:  # type: ignore[no-untyped-def]
    """tests/probes/bnb_matmul4bit_keeps_input.py, the probe of the 0.43.2 find-fix recipe (docs/bisect.md),
    tells the pre-0.43.2 MatMul4Bit (bad) from the installed one (good)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "probes" / "bnb_matmul4bit_keeps_input.py"
    spec = importlib.util.spec_from_file_location("bnb_matmul4bit_keeps_input", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.kept_input_bytes(device) == 0
    with matmul4bit_keeps_its_input():
        assert probe.kept_input_bytes(device) == 80 * 128 * 2  # its bf16 input, (80, 128)


@pytest.fixture
def layer_keeps_input_copy(qlora, device):  # type: ignore[no-untyped-def]
    """A decoder layer's MLP stashes a private copy of its input on itself (no autograd involved)."""

    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        mlp = qlora(device).model.base_model.model.model.layers[1].mlp
        handle = mlp.register_forward_pre_hook(
            lambda mod, args: setattr(mod, "stash", args[0].detach().clone())
        )
        try:
            yield
        finally:
            handle.remove()
            mlp.__dict__.pop("stash", None)

    return inject


_CACHE: list[torch.Tensor] = []


@pytest.fixture
def growing_module_cache(qlora, device):  # type: ignore[no-untyped-def]
    """A module-level cache that grows by one hidden state every forward."""

    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        norm = qlora(device).model.base_model.model.model.norm
        handle = norm.register_forward_hook(lambda mod, args, out: _CACHE.append(out.detach().clone()))
        try:
            yield
        finally:
            handle.remove()
            _CACHE.clear()

    return inject


def _model_check(q, budget: SavedLimit):  # type: ignore[no-untyped-def]
    batch = q.batch(0)
    m, out = measure(
        lambda: q.model(**batch), model=q.model, device=q.config.device, roots=lambda o: o.loss, inputs=batch
    )
    del out
    return check_limit(m, budget)


@pytest.mark.parametrize("fault", ["layer_keeps_input_copy", "growing_module_cache"])
def test_stray_copy_is_caught_by_tracker(device: str, qlora, fault: str, request) -> None:  # type: ignore[no-untyped-def]
    q = qlora(device)
    inject = request.getfixturevalue(fault)
    budget = SavedLimit("whole model", 1 << 40)
    with inject():
        v = _model_check(q, budget)
    T, h = BATCH * SEQ, q.spec.fields["hidden_size"]
    assert not v.ok and "no saved-tensor hook or ctx holds" in v.failures[0], v.failures
    assert v.unexplained_bytes == T * h * 4
    assert _model_check(q, budget).ok


def test_growing_cache_is_caught_across_steps(device: str, qlora, growing_module_cache) -> None:  # type: ignore[no-untyped-def]
    from test_steps import run

    q = qlora(device)
    with growing_module_cache():
        retained = run(q, 3).retained
    assert len(set(retained)) == 3, f"a growing cache must show as growing retained bytes: {retained}"
    retained = run(q, 3).retained
    assert len(set(retained)) == 1


@pytest.fixture
def checkpointing_silently_off(qlora, device):  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def inject() -> Iterator[None]:
        layers = qlora(device, gradient_checkpointing=True).model.base_model.model.model.layers
        for layer in layers:
            layer.gradient_checkpointing = False
        try:
            yield
        finally:
            for layer in layers:
                layer.gradient_checkpointing = True

    return inject


def test_disabled_checkpointing_is_caught(device: str, qlora, checkpointing_silently_off) -> None:  # type: ignore[no-untyped-def]
    q = qlora(device, gradient_checkpointing=True)
    expected = checkpointed_layer_bytes(BATCH, SEQ, q.spec.fields["hidden_size"], 4)
    budget = SavedLimit("checkpointed layer 1", int(expected * 1.05), prefix=f"{LAYERS}.1")
    with checkpointing_silently_off():
        assert not _model_check(q, budget).ok
    assert _model_check(q, budget).ok


@pytest.fixture
def loss_keeps_extra_fp32_logits():  # type: ignore[no-untyped-def]
    def loss(out, labels):  # type: ignore[no-untyped-def]
        logits32 = out.logits.float().clone()  # "just to be safe"
        z = torch.logsumexp(logits32, -1).pow(2).mean() * 1e-4  # a z-loss that keeps its input
        return out.loss + z

    return loss


def _loss_check(q, loss_fn):  # type: ignore[no-untyped-def]
    batch = q.batch(0)
    T, V = BATCH * SEQ, q.spec.fields["vocab_size"]

    def fn():  # type: ignore[no-untyped-def]
        out = q.model(**batch)
        return out, (loss_fn(out, batch["labels"]) if loss_fn else out.loss)

    m, res = measure(fn, model=q.model, device=q.config.device, inputs=batch)
    del res
    rest = {id(k) for k in m.kept if not k.module.startswith(LAYERS) and "norm" not in k.module}
    budget = SavedLimit(
        "lm_head + loss", logits_fp32_bytes(BATCH, SEQ, V) + 8 * T + 64, predicate=lambda k: id(k) in rest
    )
    return check_limit(m, budget)


def test_extra_logits_copy_is_caught(device: str, qlora, loss_keeps_extra_fp32_logits) -> None:  # type: ignore[no-untyped-def]
    q = qlora(device)
    assert not _loss_check(q, loss_keeps_extra_fp32_logits).ok
    assert _loss_check(q, None).ok


@pytest.fixture
def lora_copies_its_input():  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def inject(model: torch.nn.Module) -> Iterator[None]:
        handles = [
            mod.register_forward_pre_hook(lambda mod, args: (args[0].clone(),))
            for name, mod in model.named_modules()
            if name.endswith("lora_A.default")
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    return inject


def test_lora_input_copy_is_caught(device: str, lora_copies_its_input) -> None:  # type: ignore[no-untyped-def]
    model = lora(linear4bit(device), 0.0)
    x = torch.randn(BATCH, SEQ, IN, device=device, requires_grad=True)
    new = lora_adapter_bytes(BATCH * SEQ, IN, RANK, 4, False, 4)
    budget = SavedLimit("LoRA new bytes", new, new_only=True)
    with lora_copies_its_input(model):
        m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert not check_limit(m, budget).ok
    m, _ = measure(lambda: model(x), model=model, device=device, inputs=x)
    assert check_limit(m, budget).ok
    release(model)
