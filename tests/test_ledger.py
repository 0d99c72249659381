"""Known-answer tests of the saved-tensor ledger: every byte count is derived from the shapes
and dtypes built in the test."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import bitsandbytes as bnb
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramguard.measure.decoder import decoder_layer
from vramguard.measure.ledger import OUTSIDE, LedgerReport, SavedRecord, SavedTensorLedger

F32, I64 = 4, 8


def _only(records: list[SavedRecord]) -> SavedRecord:
    assert len(records) == 1, [r.describe() for r in records]
    return records[0]


def _by_attr(report: LedgerReport) -> dict[str | None, SavedRecord]:
    return {r.attribute: r for r in report.records}


# -- custom autograd Functions used as probes -----------------------------------------------


class KeepOnCtx(torch.autograd.Function):
    """Keeps a new tensor as a plain ctx attribute: invisible to saved_tensors_hooks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.kept = x * 2
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3


class KeepNested(torch.autograd.Function):
    """Keeps tensors in a tuple, a list, a QuantState-like object (two levels) and too deep."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        ctx.pair = (torch.zeros(n), [torch.zeros(2 * n)])
        ctx.state = SimpleNamespace(
            absmax=torch.zeros(3 * n), state2=SimpleNamespace(code=torch.zeros(4 * n)), blocksize=64
        )
        ctx.deep = SimpleNamespace(a=SimpleNamespace(b=SimpleNamespace(t=torch.zeros(5 * n))))
        ctx._private = torch.zeros(6 * n)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class DequantMatmul(torch.autograd.Function):
    """x @ dequant(w_int8)^T that keeps the fp32 dequantized weight for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, on_ctx: bool
    ) -> torch.Tensor:
        dq = w.float() * scale
        if on_ctx:
            ctx.dq = dq
        else:
            ctx.save_for_backward(dq)
        ctx.on_ctx = on_ctx
        return x @ dq.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        dq = ctx.dq if ctx.on_ctx else ctx.saved_tensors[0]
        return g @ dq, None, None, None


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, on_ctx: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.on_ctx = in_features, out_features, on_ctx
        w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.register_buffer("scale", torch.rand(out_features, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DequantMatmul.apply(x, self.weight, self.scale, self.on_ctx)


class Apply(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# -- the acceptance cases -------------------------------------------------------------------


def test_trainable_linear_saves_its_input_and_weight_is_resident() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rep = ledger.report
    rec = _only(rep.records)
    assert (rec.module, rec.node, rec.shape, rec.dtype, rec.bytes, rec.source, rec.kind) == (
        "0",
        "AddmmBackward0",
        (4, 16),
        "float32",
        4 * 16 * F32,
        "hook",
        "activation",
    )
    res = _only(rep.resident)  # weight.t(), saved for x's gradient
    assert (res.owner, res.bytes, res.kind, res.shape) == ("0.weight", 8 * 16 * F32, "resident", (16, 8))
    assert (rep.saved_bytes, rep.activation_bytes, rep.weight_copy_bytes, rep.resident_bytes) == (
        4 * 16 * F32,
        4 * 16 * F32,
        0,
        8 * 16 * F32,
    )


def test_frozen_linear_saves_nothing_for_a_weight_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    assert ledger.report.records == []
    assert ledger.report.saved_bytes == 0
    res = _only(ledger.report.resident)
    assert (res.owner, res.bytes) == ("0.weight", 8 * 16 * F32)


def test_custom_function_keeping_a_tensor_on_ctx_is_found() -> None:
    model = nn.Sequential(nn.Identity(), Apply(KeepOnCtx.apply))
    x = torch.randn(6, 5, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rec = _only(ledger.report.records)
    assert (rec.module, rec.node, rec.source, rec.attribute, rec.shape, rec.bytes, rec.kind) == (
        "1",
        "KeepOnCtxBackward",
        "ctx",
        "kept",
        (6, 5),
        6 * 5 * F32,
        "activation",
    )
    assert ledger.report.bytes_by("hook") == 0 and ledger.report.bytes_by("ctx") == 6 * 5 * F32


def test_an_output_nested_five_deep_is_a_root_of_the_walk_and_no_kept_storage() -> None:
    """The model's output is found at any depth: as the root of the ctx walk (a flattener that stopped
    4 levels deep lost the ctx-kept tensor) and, in ``measure``, as an output rather than a kept storage."""
    from vramguard.measure.meters import measure

    def nest(t: torch.Tensor) -> Any:
        return [[[[[t]]]]]  # 5 lists deep

    model = nn.Sequential(nn.Identity(), Apply(KeepOnCtx.apply), Apply(nest))
    x = torch.randn(6, 5, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)
    assert out[0][0][0][0][0].shape == (6, 5)
    assert [(r.source, r.attribute, r.bytes) for r in ledger.report.records] == [("ctx", "kept", 6 * 5 * F32)]
    m, _ = measure(lambda: model(x), model=model, inputs=x)
    assert m.output_bytes == 6 * 5 * F32  # x * 3
    assert [(k.source, k.bytes) for k in m.kept] == [("ctx", 6 * 5 * F32)]


def test_one_tensor_saved_by_two_ops_is_counted_once() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorLedger() as ledger:
        h = x * 2  # by a Python scalar: saves nothing
        out = h.sin() + h.cos()  # both save h
        ledger.add_roots(out)
    rec = _only(ledger.report.records)
    assert (rec.bytes, rec.shape, rec.module) == (8 * 16 * F32, (8, 16), OUTSIDE)
    assert {rec.node, *rec.also_saved_by} == {"SinBackward0", "CosBackward0"}
    assert len(rec.also_saved_by) == 1


def test_views_of_an_activation_count_its_whole_storage_once() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorLedger() as ledger:
        h = x * 2
        out = h[:, :4].sin().sum() + h[2:].cos().sum()  # two different views of h are saved
        ledger.add_roots(out)
    rec = _only(ledger.report.records)
    assert rec.bytes == 8 * 16 * F32  # not 8*4*4 + 6*16*4: the whole storage, once
    assert len(rec.also_saved_by) == 1


def test_a_view_of_a_parameter_is_resident() -> None:
    class RowScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w[1]

    model = nn.Sequential(RowScale())
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rec = _only(ledger.report.records)  # x, for w's gradient
    assert (rec.shape, rec.bytes, rec.kind) == ((3, 8), 3 * 8 * F32, "activation")
    res = _only(ledger.report.resident)  # w[1], for x's gradient: the whole parameter, resident
    assert (res.owner, res.shape, res.bytes, res.kind) == ("0.w", (8,), 4 * 8 * F32, "resident")
    assert ledger.report.saved_bytes == 3 * 8 * F32


class ChangesItsResidents(nn.Module):
    """A forward that changes what is resident, one way per ``how``, and saves the new storage for backward
    (``x * new``): resident at the block's end, not saved."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(8), requires_grad=False)
        self.w.qs = SimpleNamespace(scale=torch.ones(1))  # as Params4bit.quant_state
        self.state = SimpleNamespace(cache=None)  # as Linear8bitLt.state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = torch.full((8,), 2.0)
        if self.how == "data":  # bitsandbytes' Linear4bit casts its bias so on its first call
            self.w.data = new
        elif self.how == "object":  # an object the walk looks into gets a tensor
            self.state.cache = new
        elif self.how == "param-attribute":  # a parameter's attribute set to a new object
            self.w.qs = SimpleNamespace(scale=new)
        elif self.how == "buffer":
            self.register_buffer("extra", new)
        return x * new


@pytest.mark.parametrize("how", ["data", "object", "param-attribute", "buffer"])
def test_a_storage_the_forward_makes_resident_is_resident_not_saved(how: str) -> None:
    model = ChangesItsResidents(how)
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841
    owner = {"data": "w", "object": "state.cache", "param-attribute": "w.qs.scale", "buffer": "extra"}[how]
    res = [r for r in ledger.report.resident if r.shape == (8,)]
    assert [(r.owner, r.bytes) for r in res] == [(owner, 8 * F32)]
    assert res[0].key in ledger.resident_keys
    assert ledger.report.saved_bytes == 0  # x is not saved: new needs no gradient


@pytest.mark.parametrize("on_ctx", [False, True], ids=["save_for_backward", "ctx-attribute"])
def test_function_saving_a_dequantized_weight_is_a_weight_copy(on_ctx: bool) -> None:
    torch.manual_seed(0)
    out_f, in_f, rows = 12, 20, 5
    model = nn.Sequential(Int8Linear(in_f, out_f, on_ctx))
    x = torch.randn(rows, in_f, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rec = _only(ledger.report.records)
    assert (rec.kind, rec.shape, rec.dtype, rec.bytes, rec.module) == (
        "weight-copy",
        (out_f, in_f),
        "float32",
        out_f * in_f * F32,
        "0",
    )
    assert (rec.source, rec.attribute) == (("ctx", "dq") if on_ctx else ("hook", None))
    assert ledger.report.weight_copy_bytes == out_f * in_f * F32
    assert ledger.report.activation_bytes == 0


# -- bitsandbytes ---------------------------------------------------------------------------


class LoraLike(nn.Module):
    """A frozen 4-bit base layer plus a trainable low-rank path, as PEFT builds it."""

    def __init__(self, in_f: int, out_f: int, r: int) -> None:
        super().__init__()
        self.base_layer = bnb.nn.Linear4bit(
            in_f, out_f, bias=False, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True
        ).to("cpu")
        self.lora_A = nn.Linear(in_f, r, bias=False)
        self.lora_B = nn.Linear(r, out_f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_linear4bit_in_normal_use_saves_no_weight_copy_and_its_quant_state_is_resident() -> None:
    """rows == out_features on purpose: lora_A's saved input then has the base weight's logical
    shape (32, 64) and must still count as an activation (it was passed into the layer)."""
    torch.manual_seed(0)
    in_f, out_f, r, rows = 64, 32, 4, 32
    model = nn.Sequential(LoraLike(in_f, out_f, r))
    x = torch.randn(rows, in_f, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rep = ledger.report
    assert rep.weight_copy_bytes == 0
    got = {(r_.module, r_.shape, r_.bytes, r_.kind) for r_ in rep.records}
    assert got == {
        ("0.lora_A", (rows, in_f), rows * in_f * F32, "activation"),  # x, for lora_A's weight grad
        ("0.lora_B", (rows, r), rows * r * F32, "activation"),  # lora_A's output
    }
    blocks = out_f * in_f // 64  # blocksize 64 (bnb's default for 4-bit)
    resident = {res.owner: res.bytes for res in rep.resident}
    assert resident == {
        "0.base_layer.weight": out_f * in_f // 2,  # two 4-bit codes per byte
        "0.base_layer.weight.quant_state.absmax": blocks * 1,  # double-quantized: uint8
        "0.base_layer.weight.quant_state.code": 16 * F32,  # the NF4 table
        "0.base_layer.weight.quant_state.offset": F32,
        "0.base_layer.weight.quant_state.state2.absmax": -(-blocks // 256) * F32,
        "0.base_layer.weight.quant_state.state2.code": 256 * F32,
        "0.lora_A.weight": r * in_f * F32,  # lora_A.weight.t() for x's gradient
        "0.lora_B.weight": out_f * r * F32,
    }
    by_owner = {res.owner: res for res in rep.resident}
    packed = by_owner["0.base_layer.weight"]
    assert (packed.source, packed.attribute, packed.module) == ("ctx", "tensors[1]", "0.base_layer")
    assert (by_owner["0.base_layer.weight.quant_state.absmax"].attribute) == "state.absmax"


class DequantizingLinear4bit(bnb.nn.Linear4bit):
    """A broken layer on purpose: dequantizes outside the matmul Function, so autograd keeps
    the full-precision weight for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = bnb.functional.dequantize_4bit(self.weight, self.weight.quant_state).to(x.dtype)
        return F.linear(x, w, self.bias)


def test_bnb_layer_that_saves_its_dequantized_weight_is_flagged() -> None:
    torch.manual_seed(0)
    in_f, out_f, rows = 64, 32, 5
    model = nn.Sequential(
        DequantizingLinear4bit(in_f, out_f, bias=False, compute_dtype=torch.float32).to("cpu")
    )
    x = torch.randn(rows, in_f, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rec = _only(ledger.report.records)
    assert (rec.kind, rec.bytes, rec.module, rec.source) == ("weight-copy", out_f * in_f * F32, "0", "hook")
    assert set(rec.shape) == {out_f, in_f}
    assert ledger.report.weight_copy_bytes == out_f * in_f * F32


@pytest.mark.parametrize("rows", [4, 32])  # 32 == out_features: the input has the weight's shape
def test_8bit_cpu_path_keeps_the_input_on_ctx_only_the_ctx_probe_sees_it(rows: int) -> None:
    torch.manual_seed(0)
    in_f, out_f = 64, 32
    model = nn.Sequential(bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False).to("cpu"))
    x = torch.randn(rows, in_f, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rep = ledger.report
    rec = _only(rep.records)
    assert (rec.node, rec.source, rec.attribute, rec.module) == ("MatMul8bitFpBackward", "ctx", "A", "0")
    assert (rec.shape, rec.bytes, rec.kind) == ((rows, in_f), rows * in_f * F32, "activation")
    assert rep.bytes_by("hook") == 0
    resident = {res.owner: (res.bytes, res.attribute) for res in rep.resident}
    assert resident == {
        "0.weight": (out_f * in_f, "state.CB"),  # int8: 1 byte per weight
        "0.weight.SCB": (out_f * F32, "state.SCB"),  # one fp32 scale per row
    }


def test_ctx_walk_into_tuples_lists_and_objects_with_a_depth_limit() -> None:
    model = nn.Sequential(Apply(KeepNested.apply))
    n = 7
    x = torch.randn(n, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    found = {attr: r.bytes for attr, r in _by_attr(ledger.report).items()}
    assert found == {
        "pair[0]": n * F32,
        "pair[1][0]": 2 * n * F32,
        "state.absmax": 3 * n * F32,
        "state.state2.code": 4 * n * F32,  # two object levels: found
    }  # "deep.a.b.t" (three object levels) and "_private" are not walked
    assert all(r.source == "ctx" and r.module == "0" for r in ledger.report.records)


# -- attribution ----------------------------------------------------------------------------


def test_records_carry_the_innermost_module_and_outside_ops_are_outside() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 6)), nn.Sequential(nn.Identity(), Apply(KeepOnCtx.apply))
    )
    x = torch.randn(3, 8)
    with SavedTensorLedger(model) as ledger:
        out = model(x)
        loss = (out**2).sum()  # pow saves out, outside any module
        outside_ctx = KeepOnCtx.apply(out[:1] + 1)  # ctx Function outside the model: needs a root
    got = {(r.module, r.source, r.bytes) for r in ledger.report.records}
    assert got == {
        ("0.0", "hook", 3 * 8 * F32),  # x, saved by the Linear for its weight gradient
        ("1.1", "ctx", 3 * 6 * F32),  # KeepOnCtx inside the model
        (OUTSIDE, "hook", 3 * 6 * F32),  # out, saved by pow
    }
    with SavedTensorLedger(model) as ledger:
        out = model(x)
        loss = (out**2).sum()
        outside_ctx = KeepOnCtx.apply(out[:1] + 1)
        ledger.add_roots(loss, {"extra": [outside_ctx]})
    outside = {(r.source, r.bytes) for r in ledger.report.records if r.module == OUTSIDE}
    assert outside == {("hook", 3 * 6 * F32), ("ctx", 1 * 6 * F32)}
    del loss


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("base_model.model.model.layers.3.mlp.down_proj.lora_A.default", "base_model.model.model.layers.3"),
        ("model.layers.12", "model.layers.12"),
        ("model.layers.0.self_attn", "model.layers.0"),
        ("layers.2.mlp", "layers.2"),  # a bare LlamaModel given to the ledger
        ("model.norm", None),
        ("model.layers", None),
        ("model.sublayers.3.mlp", None),
        ("lm_head", None),
        (OUTSIDE, None),
        ("", None),
    ],
)
def test_decoder_layer(name: str, layer: str | None) -> None:
    assert decoder_layer(name) == layer


# -- lifetime -------------------------------------------------------------------------------


def test_the_ledger_does_not_extend_any_tensors_lifetime() -> None:
    """Saved inputs, saved outputs (exp keeps its result) and ctx-held tensors die by reference
    counting as soon as the graph is dropped, while the ledger object is still alive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Apply(KeepOnCtx.apply))
    x = torch.randn(4, 8)
    gc.collect()
    gc.disable()
    try:
        with SavedTensorLedger(model) as ledger:
            h = model(x)
            e = h.exp()  # saves its result
            loss = e.sum()
            ledger.add_roots(loss)
        storages = {"h": h, "e": e, "x": x}
        refs = {k: weakref.ref(t.untyped_storage()) for k, t in storages.items()}
        kept = h.grad_fn.kept  # type: ignore[union-attr]
        refs["ctx.kept"] = weakref.ref(kept.untyped_storage())
        assert {r.bytes for r in ledger.report.records} == {4 * 8 * F32}  # x, h (via ctx), e
        assert ledger.report.saved_bytes == 3 * 4 * 8 * F32
        del storages, kept, h, e, loss
        # control: x is ours, so it lives; everything else only lived for the graph
        assert refs["x"]() is not None
        dead = {k for k, r in refs.items() if r() is None}
        assert dead == {"h", "e", "ctx.kept"}
        assert ledger.report.saved_bytes == 3 * 4 * 8 * F32  # the report keeps numbers, not tensors
    finally:
        gc.enable()


def test_the_lifetime_check_can_fail() -> None:
    """Negative control of the check above: a leaked alias keeps the storage alive."""
    t = torch.randn(4)
    ref = weakref.ref(t.untyped_storage())
    alias = t.detach()
    del t
    assert ref() is not None
    del alias
    assert ref() is None


def test_released_saved_tensors_are_not_reported() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    with SavedTensorLedger() as ledger:
        h = x * 2
        y = h.sin().sum()
        y.backward()  # frees the saved h before the report is built
        z = h.cos().sum()
        ledger.add_roots(z)
    rec = _only(ledger.report.records)
    assert (rec.node, rec.also_saved_by) == ("CosBackward0", ())


# -- the tiny QLoRA model -------------------------------------------------------------------


def _tiny_shapes(q: Any) -> dict[str, int]:
    f = q.spec.fields
    return {
        "b": q.config.batch,
        "s": q.config.seq_len,
        "T": q.config.batch * q.config.seq_len,  # tokens
        "h": f["hidden_size"],
        "i": f["intermediate_size"],
        "a": f["num_attention_heads"],
        "kv": f["num_key_value_heads"],
        "d": q.spec.head_dim,
        "r": q.config.lora_rank,
        "V": f["vocab_size"],
    }


@pytest.fixture(scope="module")
def tiny_report(tiny_qlora: Any) -> LedgerReport:
    q = tiny_qlora
    with SavedTensorLedger(q.model) as ledger:
        out = q.model(**q.batch(0))
        ledger.add_roots(out.loss)
    return ledger.report


def test_tiny_qlora_layer_budget_is_known_exactly(tiny_qlora: Any, tiny_report: LedgerReport) -> None:
    """What one decoder layer keeps for backward (fp32 everywhere: prepare_model_for_kbit_training
    upcasts the norms and the residual stream; LoRA r on all 7 projections; sdpa attention)."""
    z = _tiny_shapes(tiny_qlora)
    T, h, i, a, kv, d, r, b, s = (z[k] for k in ("T", "h", "i", "a", "kv", "d", "r", "b", "s"))
    assert (T, h, r, b, s) == (128, 128, 8, 2, 64)  # the example of the issue
    rmsnorm = T * h * F32 + T * F32  # fp32 input (pow and mul) + rsqrt
    normed_for_qkv_lora_a = T * h * F32  # one tensor shared by q/k/v lora_A
    normed_for_gate_up_lora_a = T * h * F32
    lora_b_inputs = 7 * T * r * F32
    sdpa = (T * a * d + 2 * T * kv * d + T * a * d) * F32 + b * a * s * F32  # q, k, v, out, logsumexp
    mlp = 4 * T * i * F32  # silu input, both mul operands, down_proj lora_A input
    layer = 2 * rmsnorm + normed_for_qkv_lora_a + normed_for_gate_up_lora_a + lora_b_inputs + sdpa + mlp
    cos_sin = 2 * s * d * F32  # shared by all layers, attributed to the first that saves them
    layer0 = layer - rmsnorm + cos_sin  # the embedding output needs no grad: input norm saves nothing
    assert layer == 1_211_392

    prefix = "base_model.model.model.layers"
    per_layer = {
        k: sum(x.bytes for x in v) for k, v in tiny_report.group(lambda x: decoder_layer(x.module)).items()
    }
    assert per_layer == {f"{prefix}.0": layer0, f"{prefix}.1": layer}
    assert tiny_report.under(f"{prefix}.0.input_layernorm") == []
    assert sum(x.bytes for x in tiny_report.under(f"{prefix}.1.input_layernorm")) == rmsnorm
    mlp_subtree = (
        mlp + normed_for_gate_up_lora_a + 3 * T * r * F32
    )  # gate_proj's lora_A saves the normed input
    assert sum(x.bytes for x in tiny_report.under(f"{prefix}.1.mlp")) == mlp_subtree

    final_norm = rmsnorm
    loss = T * z["V"] * F32 + T * I64 + F32  # log_softmax output, targets, total_weight
    assert tiny_report.saved_bytes == layer0 + layer + final_norm + loss


def test_tiny_qlora_has_no_weight_copy_and_everything_is_fp32_activation(tiny_report: LedgerReport) -> None:
    assert tiny_report.weight_copy_bytes == 0
    assert {r.kind for r in tiny_report.records} == {"activation"}
    assert {r.dtype for r in tiny_report.records} == {"float32", "int64"}
    assert {r.dtype for r in tiny_report.records if r.dtype != "float32"} == {"int64"}
    # the packed 4-bit weights and their quant state are seen (ctx.tensors, ctx.state) as resident
    owners = {r.owner for r in tiny_report.resident}
    q_proj = "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"
    assert {q_proj, q_proj + ".quant_state.absmax", q_proj + ".quant_state.state2.code"} <= owners


def test_offloaded_storages_freed_in_the_forward_stay_separate_records():
    """Under activation offloading the saved tensor's own storage may die during the forward (the offloader
    holds a copy) and a later storage be allocated at its address: a storage key is unique only while the
    storage lives. Keyed by address alone, the ledger merged those into one record (96 of 200 here on CPU);
    each saved storage is its own record, with or without offloading."""
    x = torch.randn(64, 64, requires_grad=True)

    def ledger_of(offload: bool) -> LedgerReport:
        # pin_memory=True on a machine without CUDA: save_on_cpu copies every saved tensor (torch.empty + copy_)
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else None
        if hooks is not None:
            hooks.__enter__()
        try:
            with SavedTensorLedger() as ledger:
                y = x
                for i in range(200):  # tanh saves its output, sin its input: one saved tensor per op
                    y = (y * 1.0001).sin() if i % 2 else y.tanh()
                ledger.add_roots(y)
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)
        return ledger.report

    plain, offloaded = ledger_of(False), ledger_of(True)
    assert len(plain.records) == 200
    assert len(offloaded.records) == len(plain.records)
    assert offloaded.saved_bytes == plain.saved_bytes == 200 * x.nbytes


def test_measure_under_offloading_matches_no_dead_record_to_a_live_storage():
    """``measure`` matches ledger records to the live tracker's storages by key. Under offloading a saved
    storage dies in the forward and its address is reused: matched by address alone, 168 of 200 records were
    called pre-existing and 21 of the offloader's 200 host copies were hidden behind dead records. A record
    whose storage died has no key (its age is unknown), and every host copy is listed, once."""
    from vramguard.measure.meters import measure

    x = torch.randn(64, 64, requires_grad=True)

    def forward():
        y = x
        for i in range(200):
            y = (y * 1.0001).sin() if i % 2 else y.tanh()
        return y

    with torch.autograd.graph.save_on_cpu(pin_memory=True):  # without CUDA: a plain host copy per save
        m, _ = measure(forward, inputs=(x,))
    hooked = [r for r in m.kept if r.source == "hook"]
    copies = [r for r in m.kept if r.source == "tracker"]
    assert len(hooked) == 200 and all(r.new is not False for r in hooked)
    assert sum(r.key is None for r in hooked) >= 190  # all but those still alive (the last few)
    assert len(copies) == 200 and sum(r.bytes for r in copies) == 200 * x.nbytes


def test_an_adapters_own_cast_of_its_input_is_no_weight_copy():
    """Under bf16 autocast LoRA's A casts its input inside its own forward. With batch x seq equal to a frozen
    layer's out_features (1 x 128 = tiny-llama's hidden size, down_proj's out) that cast has the frozen
    down_proj weight's shape, was not passed into lora_A, and the ledger called it a weight copy (the H100
    audit of SFTTrainer on the 1B shape at batch 2 x seq 1024 = hidden 2048 failed on 640 MiB of them). What a
    trainable module computes is no copy of the frozen weight around it. The frozen lm_head weight that
    autocast does cast to bf16 and keep for backward stays a weight copy: that one is real."""
    from vramguard.workload.models import QLoRAConfig, build_qlora

    q = build_qlora(QLoRAConfig(model="tiny-llama", seq_len=128, batch=1))
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorLedger(q.model) as ledger:
        loss = q.model(**q.batch(0)).loss
        ledger.add_roots(loss)
    copies = [r for r in ledger.report.records if r.kind == "weight-copy"]
    assert not [r for r in copies if ".lora_" in r.module], copies
    assert [(r.module.rsplit(".", 1)[-1], r.shape, r.dtype) for r in copies] == [
        ("lm_head", (128, 512), "bfloat16")
    ]
    lora_inputs = [
        r
        for r in ledger.report.records
        if r.module.endswith("down_proj.lora_A.default") and r.shape == (128, 352)
    ]
    assert len(lora_inputs) == 2 and all(r.kind == "activation" for r in lora_inputs), lora_inputs


def test_doras_dequantized_weight_is_a_weight_copy():
    """PEFT DoRA with dropout (``base_result=None``) dequantizes the 4-bit base weight inside its magnitude
    module and keeps it for backward: a weight copy. The magnitude module trains (a 1-D weight), and the rule
    that an adapter's own computation is no weight copy must not reach it (only leaf modules with a 2-D
    trainable weight, LoRA's A and B, are adapters there)."""
    from peft import LoraConfig, get_peft_model

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # .to() quantizes the weight (bitsandbytes does it on the first move)
            self.q = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to(
                "cpu"
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x)

    torch.manual_seed(0)
    model = get_peft_model(One(), LoraConfig(r=4, target_modules=["q"], use_dora=True, lora_dropout=0.1))
    model.train()
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)
    del out
    copies = [r for r in ledger.report.records if r.kind == "weight-copy"]
    assert [(r.shape, r.bytes) for r in copies] == [((64, 32), 64 * 32 * 4)], ledger.report.records


class _NativeDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, 0.5, True)[0]  # CUDA's dropout: a boolean mask saved


class _DropThenLinear(nn.Module):
    """A frozen weight of its own behind a dropout module, as a 4-bit layer holds its weight and LoRA's dropout
    sits in it before the A matrix: ``nn.Dropout`` (PEFT's ``lora_dropout``; on the CPU and on meta torch
    multiplies by a mask in the input's dtype) or CUDA's ``native_dropout`` (a boolean mask)."""

    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16), requires_grad=False)
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.drop(x), self.weight)


@pytest.mark.parametrize(("drop", "dtype"), [(_NativeDropout, "bool"), (lambda: nn.Dropout(0.5), "float32")])
def test_a_dropout_mask_with_a_weights_shape_is_no_weight_copy(drop: Any, dtype: str) -> None:
    """Dropout's mask of 8 x 16 rows (a tiny model's batch x seq equal to a weight's rows) has the frozen
    weight's shape, but a mask is never "the dequantized weight saved for backward": an activation, boolean
    (CUDA's) or a float (the CPU's and meta's)."""
    model = nn.Sequential(_DropThenLinear(drop())).train()
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841  (the graph, and what it saved, lives while out does)
    rec = _only(ledger.report.records)
    assert (rec.shape, rec.dtype, rec.kind) == ((8, 16), dtype, "activation")
    assert ledger.report.weight_copy_bytes == 0
