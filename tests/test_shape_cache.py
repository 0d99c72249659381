"""The meta step's shape cache (:class:`vramguard.estimate.meta.ShapeCache`) answers as the kernels.

A repeat of an op it caches (a pointwise op, or any op whose schema writes and aliases nothing) on the same
metadata gets the first result's shape, strides and dtype; whatever the
key leaves out must not change them. Each property compares the cache's answers with torch's own meta kernels.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vramguard.estimate.meta import ShapeCache
from vramguard.workload.models import QLoRAConfig

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
BINARY = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "sub": lambda a, b: torch.sub(a, b) if a.dtype != torch.bool and b.dtype != torch.bool else a & b,
    "maximum": torch.maximum,
    "where": lambda a, b: torch.where(a > 0, a, b),
}
UNARY = {
    "neg": lambda a: -a if a.dtype != torch.bool else ~a,
    "sqrt": torch.sqrt,
    "silu": lambda a: torch.nn.functional.silu(a.float()),
    "mul-int": lambda a: a * 3,
    "mul-float": lambda a: a * 0.5,
    "pow-2": lambda a: a.pow(2),
}


def _meta(shape: tuple[int, ...], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.transpose(0, 1) if transposed and t.dim() >= 2 else t


def _metadata(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.device.type, t.untyped_storage().nbytes())


@st.composite
def operands(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Two meta tensors whose shapes broadcast (a dim of 1 or a missing leading dim), any dtype and layout."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    other = [1 if draw(st.booleans()) else n for n in shape][draw(st.integers(0, len(shape) - 1)) :]
    return (
        _meta(tuple(shape), draw(st.sampled_from(DTYPES)), draw(st.booleans())),
        _meta(tuple(other), draw(st.sampled_from(DTYPES)), draw(st.booleans())),
    )


@settings(max_examples=60, deadline=None)
@given(ab=operands(), op=st.sampled_from(sorted(BINARY)), unary=st.sampled_from(sorted(UNARY)))
def test_every_answer_has_the_kernels_shape_strides_and_dtype(
    ab: tuple[torch.Tensor, torch.Tensor], op: str, unary: str
) -> None:
    """Each op twice under the cache (the second a repeat) against the kernel alone: broadcasting, transposed
    strides, type promotion by the other tensor and by an int or float scalar."""
    a, b = ab
    calls = [
        lambda: BINARY[op](a, b),
        lambda: BINARY[op](b, a),
        lambda: UNARY[unary](a),
        lambda: UNARY[unary](b),
    ]
    for call in calls:
        try:
            want = _metadata(call())
        except RuntimeError:  # the kernel refuses (e.g. sqrt of bool): the cache must refuse too
            with ShapeCache(), pytest.raises(RuntimeError):
                call()
            continue
        cache = ShapeCache()
        with cache:
            first, repeat = _metadata(call()), _metadata(call())
        assert first == repeat == want
        assert cache.hits >= 1


def test_a_transposed_operand_is_not_answered_with_a_contiguous_ones_strides() -> None:
    """The same shape and dtype with other strides is another key: ``t + t`` of a transposed ``t`` keeps its
    column-major strides, as the kernel gives them."""
    a = torch.empty(4, 8, device="meta")
    t = torch.empty(8, 4, device="meta").t()
    with ShapeCache() as cache:
        contiguous, transposed = a + a, t + t
    assert contiguous.stride() == (8, 1) and transposed.stride() == (1, 4)
    assert cache.hits == 0


def test_a_scalars_type_decides_the_dtype() -> None:
    """``aten.mul.Scalar(ints, 2)`` stays int64 and ``(ints, 2.5)`` is float32: a float scalar's type is part
    of the key (``ints * 2`` reaches the kernel as a 0-d tensor, whose dtype is in the key anyway)."""
    ints = torch.empty(3, dtype=torch.int64, device="meta")
    mul = torch.ops.aten.mul.Scalar
    with ShapeCache() as cache:
        assert mul(ints, 2).dtype == torch.int64
        assert mul(ints, 2.5).dtype == torch.float32
        assert mul(ints, 7.0).dtype == torch.float32  # a repeat of the float one: answered from the cache
    assert cache.hits == 1


def test_the_default_dtype_is_part_of_the_key() -> None:
    """An int tensor's ``sqrt`` is of torch's default dtype: a repeat after ``set_default_dtype`` follows
    it."""
    ints = torch.empty(3, dtype=torch.int64, device="meta")
    before = torch.get_default_dtype()
    with ShapeCache():
        try:
            assert ints.sqrt().dtype == torch.float32
            torch.set_default_dtype(torch.float64)
            assert ints.sqrt().dtype == torch.float64
        finally:
            torch.set_default_dtype(before)


def test_an_in_place_op_returns_its_tensor_and_a_real_tensors_op_runs() -> None:
    """An in-place repeat on meta is its own first argument, as the kernel returns it; an in-place op on a
    real tensor (Adam's step counter on the host) runs every time."""
    a, b = torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta")
    step = torch.zeros(())
    with ShapeCache():
        assert a.mul_(b) is a and a.mul_(b) is a
        for _ in range(3):
            step += 1
    assert step.item() == 3


def test_an_estimate_is_the_same_with_the_cache_and_answers_most_ops_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole QLoRA estimate for CUDA (checkpointing, the foreach AdamW step: new and in-place pointwise ops)
    is byte for byte the estimate of the kernels alone, and most of its pointwise ops were repeats."""
    from vramguard.estimate import meta
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=32, batch=2, gradient_checkpointing=True)
    counts = _count_caches(monkeypatch)
    monkeypatch.setattr(meta, "PROCESS_ANSWERS", {})  # nothing answered yet in this process
    cached = run_estimate(config, steps=2, target="cuda")
    (cache,) = counts
    assert cache.hits > 2 * cache.misses > 0
    monkeypatch.setattr(meta.ShapeCache, "_kind", lambda self, func: 0)  # every op to its kernel
    kernels = run_estimate(config, steps=2, target="cuda")
    assert counts[1].hits == 0  # the second run answered nothing from the cache
    assert _document(cached) == _document(kernels)


def test_a_second_estimate_in_the_process_answers_from_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta step keeps its answers for the process (``--fit`` and the cheaper changes run estimate after
    estimate): the same estimate again computes no pointwise result anew and is byte for byte the first."""
    from vramguard.estimate import meta
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=32, batch=2)
    counts = _count_caches(monkeypatch)
    monkeypatch.setattr(meta, "PROCESS_ANSWERS", {})
    first = run_estimate(config, steps=2, target="cuda")
    second = run_estimate(config, steps=2, target="cuda")
    assert counts[0].misses > 0 and counts[1].misses == 0 and counts[1].hits > 0
    assert _document(first) == _document(second)


FOREACH = {  # the foreach ops of CUDA's AdamW step, and an out-of-place one with a scalar
    "sqrt": lambda a, b: torch._foreach_sqrt(a),
    "mul-float": lambda a, b: torch._foreach_mul(a, 0.5),
    "add-list": lambda a, b: torch._foreach_add(a, b),
    "lerp_": lambda a, b: torch._foreach_lerp_(a, b, 0.1),
    "addcmul_": lambda a, b: torch._foreach_addcmul_(a, b, b, value=0.01),
    "addcdiv_": lambda a, b: torch._foreach_addcdiv_(a, b, b, [0.5] * len(a)),
}


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(operands(), min_size=1, max_size=3), op=st.sampled_from(sorted(FOREACH)),
       same=st.booleans())
def test_a_foreach_ops_answers_are_its_kernels(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], op: str, same: bool
) -> None:
    """A foreach op of a pointwise op on lists of meta tensors (any shapes, dtypes, strides; the second list
    the first's shapes, or broadcasting ones the kernel refuses), twice under the cache: a new list of the
    kernel's results, or for an in-place op nothing, and the tensors as the kernel leaves them."""
    a = [x for x, _ in pairs]
    b = [y for _, y in pairs]
    if same:  # the first list's shapes and strides, the second's dtypes
        b = [torch.empty_strided(x.shape, x.stride(), dtype=y.dtype, device="meta") for x, y in pairs]

    def call(written: list[torch.Tensor]) -> Any:
        out = FOREACH[op](written, b)
        return [_metadata(t) for t in written], None if out is None else [_metadata(t) for t in out]

    copies = [[t.clone() for t in a] for _ in range(4)]  # an in-place op writes its own copy each time
    try:
        want = call(copies[0])
    except RuntimeError:
        with ShapeCache(), pytest.raises(RuntimeError):
            call(copies[1])
        return
    cache = ShapeCache()
    with cache:
        first, repeat = call(copies[2]), call(copies[3])
    assert first == repeat == want
    assert cache.hits == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: torch.ops.aten.clamp_min_.Tensor(a, b),
        lambda a, b: torch.ops.aten._foreach_maximum_.List([a], [b]),
        lambda a, b: torch.ops.aten._foreach_clamp_max_.List([a], [b]),
    ],
    ids=["clamp_min_", "_foreach_maximum_", "_foreach_clamp_max_"],
)
def test_an_in_place_op_that_resizes_what_it_writes_is_its_kernels_every_time(call: Any) -> None:
    """On meta, these in-place ops resize a 0-d first argument to the broadcast shape (with a deprecation
    warning): a repeat on the same metadata must resize it too, which only the kernel does."""

    def resized() -> tuple[int, ...]:
        a, b = torch.empty((), device="meta"), torch.empty(3, 4, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(a, b)
        return tuple(a.shape)

    want = resized()
    with ShapeCache():
        assert resized() == resized() == want == (3, 4)


def test_an_op_of_no_argument_passes_through() -> None:
    """``torch.backends.nnpack.is_available()`` (what RNN modules ask) is an op of no argument."""
    want = torch.backends.nnpack.is_available()
    with ShapeCache():
        assert torch.backends.nnpack.is_available() == want


def test_a_foreach_op_on_host_tensors_runs() -> None:
    """Adam's step counters on the host go through ``_foreach_add_``: their values count, the kernel runs
    every time."""
    steps = [torch.zeros(()), torch.zeros(())]
    with ShapeCache() as cache:
        for _ in range(3):
            torch._foreach_add_(steps, 1)
    assert [s.item() for s in steps] == [3, 3] and cache.hits == 0


def _count_caches(monkeypatch: pytest.MonkeyPatch) -> list[ShapeCache]:
    """The :class:`ShapeCache` objects made from now on (the meta steps'), in order."""
    from vramguard.estimate import meta

    counts: list[ShapeCache] = []
    original = meta.ShapeCache.__init__

    def counted(self: ShapeCache, *args: Any) -> None:
        original(self, *args)
        counts.append(self)

    monkeypatch.setattr(meta.ShapeCache, "__init__", counted)
    return counts


def _document(report: Any) -> str:
    """The report as JSON, without its wall time."""
    doc = report.to_dict()
    doc.pop("elapsed_s", None)
    return json.dumps(doc, sort_keys=True, default=str)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_native_dropout_is_answered_as_its_kernel(dtype: torch.dtype, transposed: bool) -> None:
    """CUDA's dropout on meta (``native_dropout``: the output and its bool mask) repeats from the first
    call's metadata, its results as its Python meta kernel makes them (strides of a transposed input, the
    mask's bool dtype), each a storage of its own; ``p``'s value decides no shape."""
    x = torch.empty(8, 4, dtype=dtype, device="meta")
    x = x.t() if transposed else x
    kernel = torch.native_dropout(x, 0.1, True)
    with ShapeCache() as cache:
        first = torch.native_dropout(x, 0.1, True)
        again = torch.native_dropout(x, 0.3, True)
    assert cache.hits == 1 and cache.misses == 1
    for made in (first, again):
        assert type(made) is tuple and len(made) == 2
        for ours, theirs in zip(made, kernel):
            assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
        assert made[0].untyped_storage()._cdata != made[1].untyped_storage()._cdata


def test_an_estimate_with_lora_dropout_is_the_same_with_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA estimate with LoRA dropout (``native_dropout`` in every adapter's forward) answers its dropouts
    from the cache and is byte for byte the estimate of the kernels alone."""
    from vramguard.estimate import meta
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=32, batch=2, lora_dropout=0.05)
    dropouts = []
    original = meta.ShapeCache._remember

    def remember(self: ShapeCache, kind: int, key: Any, args: Any, out: Any) -> None:
        dropouts.append(key[0] is torch.ops.aten.native_dropout.default and key in self._shapes)
        original(self, kind, key, args, out)
        dropouts[-1] = key[0] is torch.ops.aten.native_dropout.default and key in self._shapes

    monkeypatch.setattr(meta.ShapeCache, "_remember", remember)
    monkeypatch.setattr(meta, "PROCESS_ANSWERS", {})
    cached = run_estimate(config, steps=2, target="cuda")
    assert any(dropouts)  # native_dropout's answers were kept
    monkeypatch.setattr(meta.ShapeCache, "_kind", lambda self, func: 0)  # every op to its kernel
    kernels = run_estimate(config, steps=2, target="cuda")
    assert _document(cached) == _document(kernels)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: torch.linalg.vector_norm(x, 2.0),
        lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1),
        lambda x: torch.linalg.vector_norm(x, 2.0, dim=(0,), keepdim=True),
        lambda x: torch.linalg.vector_norm(x, 2.0, dtype=torch.float32),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_norm_is_answered_as_its_kernel(call: Any, dtype: torch.dtype) -> None:
    """``linalg_vector_norm`` (``clip_grad_norm_``'s per-gradient norm) repeats from the first call's metadata:
    its result as the kernel makes it, for each ``dim``, ``keepdim``, ``dtype`` and order."""
    x = torch.empty(6, 4, dtype=dtype, device="meta")
    kernel = call(x)
    with ShapeCache() as cache:
        first, again = call(x), call(x)
    assert cache.hits == 1 and cache.misses == 1
    for ours in (first, again):
        assert (ours.shape, ours.stride(), ours.dtype) == (kernel.shape, kernel.stride(), kernel.dtype)


def test_a_trainer_estimate_is_the_same_with_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's step on meta (gradient clipping: a ``linalg_vector_norm`` per LoRA gradient; LoRA dropout) answers
    those from the cache and is byte for byte the estimate of the kernels alone."""
    from vramguard.estimate import meta
    from vramguard.estimate.trainer import run_trainer_estimate

    config = QLoRAConfig(seq_len=32, batch=1, lora_dropout=0.05)
    answered = _answered_from_the_cache(monkeypatch)
    cached = run_trainer_estimate(config, "sft", steps=2, target="cuda")
    assert torch.ops.aten.linalg_vector_norm.default in answered
    assert torch.ops.aten.native_dropout.default in answered
    monkeypatch.setattr(meta.ShapeCache, "_kind", lambda self, func: 0)  # every op to its kernel
    kernels = run_trainer_estimate(config, "sft", steps=2, target="cuda")
    assert _document(cached) == _document(kernels)


FRESH = {  # ops whose schema neither writes nor aliases: one new result (kind 6) or several (kind 7)
    "mm": lambda x: x @ x.t(),
    "mean": lambda x: x.mean(-1, keepdim=True),
    "sum": lambda x: x.sum(0),
    "amax": lambda x: x.amax(1),
    "cat": lambda x: torch.cat([x, x.t().t()], 1),
    "stack": lambda x: torch.stack([x, x]),
    "layer_norm": lambda x: torch.native_layer_norm(x, (x.shape[-1],), None, None, 1e-6),
    "max-dim": lambda x: torch.max(x, 1),
    "softmax": lambda x: x.softmax(-1),
    "zeros-like": torch.zeros_like,
    "to-bf16": lambda x: x.to(torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(FRESH))
@pytest.mark.parametrize("transposed", [False, True])
def test_an_op_of_new_results_is_answered_as_its_kernel(name: str, transposed: bool) -> None:
    """An op whose schema writes and aliases nothing repeats from its first result's metadata, each result a
    storage of its own of the kernel's size; the kernel alone gives the same (a transposed input's strides
    too)."""
    x = torch.empty(6, 4, device="meta")
    x = x.t() if transposed else x
    call = FRESH[name]
    want = call(x)
    with ShapeCache() as cache:
        first, again = call(x), call(x)
    assert cache.hits >= 1
    for made in (first, again):
        ours = (made,) if isinstance(made, torch.Tensor) else tuple(made)
        theirs = (want,) if isinstance(want, torch.Tensor) else tuple(want)
        assert [_metadata(t) for t in ours] == [_metadata(t) for t in theirs]
        assert len({t.untyped_storage()._cdata for t in (*ours, x)}) == len(ours) + 1


def test_a_float_that_decides_a_shape_is_keyed_by_value() -> None:
    """``interpolate``'s scale factor and ``arange``'s float bounds decide the result's shape: an op of new
    results keys its floats by value (a pointwise op's by type), so 1.5 and 2.0 are two keys."""
    x = torch.empty(1, 1, 6, 4, device="meta")
    interpolate = torch.nn.functional.interpolate
    with ShapeCache():
        assert interpolate(x, scale_factor=1.5).shape == (1, 1, 9, 6)
        assert interpolate(x, scale_factor=2.0).shape == (1, 1, 12, 8)
        assert torch.arange(0.0, 3.0, 0.5, device="meta").shape == (6,)
        assert torch.arange(0.0, 3.0, 1.5, device="meta").shape == (2,)


def test_a_host_tensor_whose_value_decides_a_shape_runs_the_kernel() -> None:
    """``repeat_interleave`` of a meta tensor by a host scalar tensor (the scalar's value sets the length) and
    ``index`` by a host boolean mask (its count of True sets it; two masks of one shape, strides and dtype, the
    case that holds the rule: ``repeat_interleave``'s repeats reach ``index_select`` as indices of another
    length): an op of new results given a real tensor is not answered from the cache."""
    x = torch.empty(6, 4, device="meta")
    with ShapeCache() as cache:
        assert torch.repeat_interleave(x, torch.tensor(2), dim=0).shape == (12, 4)
        assert torch.repeat_interleave(x, torch.tensor(3), dim=0).shape == (18, 4)
        # a host boolean mask of one shape selects as many rows as it holds True: its metadata is not its answer
        assert x[torch.tensor([True, False, False, False, False, True])].shape == (2, 4)
        assert x[torch.tensor([True] * 6)].shape == (6, 4)
    assert cache.hits == 0


def test_a_result_sharing_its_inputs_storage_is_the_kernels_every_time() -> None:
    """``_unsafe_view`` shares its input's storage with no alias in its schema: its first result is not a new
    storage, so every call with that key runs the kernel (a repeat shares the storage too)."""
    x = torch.empty(6, 4, device="meta")
    with ShapeCache() as cache:
        for _ in range(2):
            view = torch.ops.aten._unsafe_view(x, [24])
            assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 0


def test_a_vision_language_estimate_is_the_same_with_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2-VL estimate for the CPU (its vision tower's LayerNorms: ``native_layer_norm``'s three
    results, their statistics then made as the CPU makes them above the cache; 4-bit ``gemm_4bit``) answers
    those from the cache and is byte for byte the estimate of the kernels alone."""
    from pathlib import Path

    from vramguard.estimate import meta
    from vramguard.estimate.run import run_estimate

    vlm = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm" / "tiny-qwen2-vl.json"
    config = QLoRAConfig(
        model=str(vlm), seq_len=64, batch=1, image_size="56x56", target_modules="all-linear"
    )
    answered = _answered_from_the_cache(monkeypatch)
    cached = run_estimate(config, steps=2, target="cpu")
    assert {torch.ops.aten.native_layer_norm.default, torch.ops.aten.mm.default} <= answered
    assert torch.ops.bitsandbytes.gemm_4bit.default in answered
    monkeypatch.setattr(meta.ShapeCache, "_kind", lambda self, func: 0)  # every op to its kernel
    kernels = run_estimate(config, steps=2, target="cpu")
    assert _document(cached) == _document(kernels)


def test_an_op_whose_meta_kernel_the_step_registers_runs_it_every_time() -> None:
    """``_grouped_mm``'s Meta kernel in the step (:func:`vramguard.estimate.meta.target_decisions`) answers fp32
    experts and counts each call (the report's ``forced_decisions``): its schema writes and aliases nothing, yet
    a repeat on the same metadata is the kernel's too, so every call is counted."""
    from vramguard.estimate.meta import forced_decisions

    a = torch.empty(16, 16, device="meta")
    b = torch.empty(4, 16, 32, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    with forced_decisions("cpu") as taken:
        for _ in range(3):
            assert torch._grouped_mm(a, b, offs=offs).shape == (16, 32)
    assert taken["grouped_mm"] == 3


def _answered_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> set[Any]:
    """The ops the shape cache answers from now on (an empty process cache to start from), as a set filled in."""
    from vramguard.estimate import meta

    answered: set[Any] = set()
    original = meta.ShapeCache.__torch_dispatch__

    def dispatch(self: ShapeCache, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        hits = self.hits
        out = original(self, func, types, args, kwargs)
        if self.hits > hits:
            answered.add(func)
        return out

    monkeypatch.setattr(meta.ShapeCache, "__torch_dispatch__", dispatch)
    monkeypatch.setattr(meta, "PROCESS_ANSWERS", {})
    return answered
