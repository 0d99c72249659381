"""Trainer's bf16/fp16 autocast, priced: the audit runs the step as accelerate wraps it for Trainer, and the
meta run takes the target device's own autocast policy (:mod:`vramguard.estimate.autocast`).

With ``--target cpu`` the estimate must equal the CPU audit to the byte, as without autocast
(tests/test_estimate.py); with ``--target cuda`` it takes CUDA's policy, under which the attention's q, k, v
are cast to bf16 and a grouped-query model's sdpa runs the flash kernel instead of the math composite.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_estimate import STEPS, _above_weights

from vramguard.audit.run import run_audit
from vramguard.cli import main
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="llama"),
        pytest.param({"gradient_checkpointing": True}, id="llama-checkpointing"),
    ],
)
def test_bf16_estimate_equals_the_bf16_cpu_audit_to_the_byte(variant: dict[str, Any]) -> None:
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(**{"seq_len": 64, "batch": 2, "mixed_precision": "bf16", **variant})
    estimate = run_estimate(config, steps=STEPS, target="cpu")
    audit = run_audit(config, steps=STEPS)
    got, want = _above_weights(estimate), _above_weights(audit)
    for key in want:
        assert got[key] == want[key], key
    assert estimate.estimate is not None and estimate.estimate.forced_decisions["autocast_routed"] > 0
    # autocast changed the step: the saved bytes are not those of the same step without it
    plain = run_estimate(QLoRAConfig(**{"seq_len": 64, "batch": 2, **variant}), steps=1, target="cpu")
    assert plain.totals.saved_bytes != estimate.totals.saved_bytes


def _attention(report: Any) -> set[tuple[str, str]]:
    return {(r["node"], r["dtype"]) for r in report.records if r["module"].endswith("layers.1.self_attn")}


def test_cuda_autocast_runs_gqa_attention_in_flash() -> None:
    """tiny-llama (4 heads, 2 k/v heads): fp32 attention on CUDA is the math composite, which keeps the
    b x a x s x s probabilities; under CUDA's bf16 autocast sdpa's inputs are bf16, so flash runs and keeps
    no s x s tensor, q, k, v in bf16 and the logsumexp in fp32."""
    from vramguard.estimate.run import run_estimate

    b, a, s = 2, 4, 64
    fp32 = run_estimate(QLoRAConfig(seq_len=s, batch=b), steps=1, target="cuda")
    bf16 = run_estimate(QLoRAConfig(seq_len=s, batch=b, mixed_precision="bf16"), steps=1, target="cuda")
    assert any(r["shape"] == [b, a, s, s] for r in fp32.records), "fp32 GQA attention on CUDA is math"
    assert not any(r["shape"] == [b, a, s, s] for r in bf16.records), "the s x s probabilities were saved"
    flash = "ScaledDotProductFlashAttentionForCpuBackward0"  # the meta run's stand-in for CUDA's flash kernel
    assert _attention(bf16) >= {(flash, "bfloat16"), (flash, "float32")}
    assert bf16.estimate is not None and fp32.estimate is not None
    assert bf16.estimate.total_bytes < fp32.estimate.total_bytes


def test_fp16_on_the_cpu_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """accelerate refuses fp16 mixed precision on the CPU; so do the audit and estimate --target cpu."""
    for argv in (
        ["audit", "--fp16", "--seq-len", "16"],
        ["estimate", "--fp16", "--target", "cpu", "--seq-len", "16"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "fp16" in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_names_the_autocast_as_priced(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--bf16", "--target", "cpu", "--seq-len", "16", "--batch", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "mixed precision bf16 (Trainer's autocast): priced" in out
    assert "NOT PRICED" not in out


def test_one_line_names_the_term_that_sets_the_peak_and_the_setting_that_removes_it() -> None:
    """tiny-llama at seq 1024 on CUDA: the math attention's fp32 s x s probabilities (2 x 16 MiB) are most
    of the step's peak, and the line names --bf16; under bf16 autocast flash keeps none, and no line."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=1024, batch=1)
    fp32 = run_estimate(config, steps=1, target="cuda")
    lines = [f.message for f in fp32.verdict.findings if f.kind == "peak-term"]
    assert len(lines) == 1 and "s x s attention" in lines[0] and "--bf16" in lines[0], lines
    bf16 = run_estimate(QLoRAConfig(seq_len=1024, batch=1, mixed_precision="bf16"), steps=1, target="cuda")
    assert not [f for f in bf16.verdict.findings if f.kind == "peak-term"]


def test_flash_attention_2_saves_no_s_x_s_tensor_by_flash_attns_rules() -> None:
    """``--attn-implementation flash_attention_2`` (flash_attn is CUDA-only: priced on meta from its rules):
    transformers' flash path casts the fp32 q, k, v to bf16 and flash-attn 2 saves them in b x s x h x d, its
    padded output, the fp32 b x h x s logsumexp and a 2 x int64 rng state, and no s x s tensor; fp32 sdpa on
    CUDA (math, for this GQA model) keeps the probabilities."""
    from vramguard.estimate.run import run_estimate

    b, a, kv, s, d = 2, 4, 2, 64, 32
    flash = run_estimate(
        QLoRAConfig(seq_len=s, batch=b, attn_implementation="flash_attention_2"), steps=1, target="cuda"
    )
    saved = {
        (r["dtype"], tuple(r["shape"]))
        for r in flash.records
        if r["module"].endswith("layers.1.self_attn") and r["node"] == "FlashAttnFuncBackward"
    }
    assert saved == {
        ("bfloat16", (b, s, a, d)),  # q and the output
        ("bfloat16", (b, s, kv, d)),  # k and v, at their own heads
        ("float32", (b, a, s)),  # softmax_lse
        ("int64", (2,)),  # rng_state
    }
    assert not any(r["shape"][-2:] == [s, s] for r in flash.records)
    assert any(f.kind == "build" and "flash-attn 2" in f.message for f in flash.verdict.findings)
    # batch 1: transformers reads the position ids for packed sequences (answered: one sequence per row)
    one = run_estimate(
        QLoRAConfig(seq_len=s, batch=1, attn_implementation="flash_attention_2"), steps=1, target="cuda"
    )
    assert one.totals.saved_bytes > 0


def test_flash_attention_2_on_a_padding_free_batch_runs_the_varlen_kernel_by_its_rules() -> None:
    """TRL's padding-free batch passes the sequences' boundaries, so transformers flattens q, k, v and calls
    flash-attn's varlen kernel (refused before): it saves what ``FlashAttnVarlenFunc`` saves (an unpadded
    ``h x total`` logsumexp), and its backward allocates, per layer, dq, dk, dv, the expanded dk and dv of a
    grouped-query model and ``mha_varlen_bwd``'s fp32 ``softmax_d`` and ``dq_accum``, 128 rows more for each
    sequence: packing (two sequences a row) moves those two and nothing else."""
    import dataclasses

    from vramguard.estimate.run import run_estimate
    from vramguard.measure.events import AllocationLog

    b, a, kv, s, d = 2, 4, 2, 64, 32
    total = b * s
    base = QLoRAConfig(seq_len=s, batch=b, attn_implementation="flash_attention_2", padding_free=True)
    allocated, lines = {}, {}
    for packing, sequences in ((False, b), (True, 2 * b)):
        log = AllocationLog()
        report = run_estimate(dataclasses.replace(base, packing=packing), steps=1, target="cuda", events=log)
        saved = {
            (r["dtype"], tuple(r["shape"]))
            for r in report.records
            if r["module"].endswith("layers.1.self_attn") and r["node"] == "FlashAttnVarlenFuncBackward"
        }
        assert saved == {
            ("bfloat16", (total, a, d)),  # q and the output
            ("bfloat16", (total, kv, d)),  # k and v
            ("float32", (a, total)),  # softmax_lse, unpadded
            ("int64", (2,)),  # rng_state
        }
        rows = total + 128 * sequences
        per_layer = sorted(
            [total * a * d * 2] * 3  # dq, the expanded dk and dv (at the query heads)
            + [total * kv * d * 2] * 2  # dk, dv
            + [a * rows * 4, rows * a * 32 * 4]  # softmax_d, dq_accum (head dim 32: rounded to 32)
        )
        allocated[packing] = sorted(
            e.size
            for is_alloc, e, _ in log.events
            if is_alloc and e.context[0] == "backward" and e.context[3] == "FlashAttnVarlenFuncBackward"
        )
        assert allocated[packing] == sorted(per_layer * 2)  # tiny-llama's 2 layers
        lines[packing] = [f.message for f in report.verdict.findings if f.message.startswith("data:")]
    # what one more sequence costs, from what the two runs allocated (2 layers, b more sequences), is what the
    # data line names
    per_sequence = (sum(allocated[True]) - sum(allocated[False])) // (2 * b)
    for packing, sequences in ((False, b), (True, 2 * b)):
        (bounds,) = lines[packing]
        assert (
            f"({format_bytes(per_sequence)} a sequence, one layer's at a time): priced at {sequences} "
            in bounds
        )


@pytest.mark.parametrize(
    ("d", "padded", "rounded"),
    [(100, 104, 128), (128, 128, 128), (160, 160, 192)],  # padded to 8; rounded to 32 up to 128, to 64 above
)
def test_flash_attn_varlen_allocates_by_flash_attns_rules(d: int, padded: int, rounded: int) -> None:
    """The varlen kernel alone on meta (3 sequences, 96 tokens, 4 query and 2 k/v heads): the head dim padded to
    a multiple of 8 (q, k, v and the gradient of the output), ``dq_accum``'s columns rounded as flash-attn
    2.8's ``head_size_rounded``, and 128 rows more per sequence in ``softmax_d`` and ``dq_accum``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vramguard.estimate.flash import flash_attn_varlen_func

    made: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    makers = {"empty", "empty_like", "empty_strided", "constant_pad_nd"}

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in makers:
                made.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
            return out

    total, h, kv, sequences = 96, 4, 2, 3
    q = torch.empty(total, h, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k, v = (torch.empty(total, kv, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in "kv")
    cu = torch.empty(sequences + 1, dtype=torch.int32, device="meta")
    with Made():
        out = flash_attn_varlen_func(q, k, v, cu, cu, 32, 32, causal=True)
    forward, made[:] = list(made), []
    assert out.shape == (total, h, d)
    pads = (
        [("constant_pad_nd", (total, n, padded), torch.bfloat16) for n in (h, kv, kv)] if padded != d else []
    )
    assert forward == [
        *pads,
        ("empty", (total, h, padded), torch.bfloat16),  # out_padded
        ("empty", (h, total), torch.float32),  # softmax_lse, unpadded
        ("empty", (2,), torch.int64),  # rng_state
    ]
    grad = torch.empty_like(out)
    with Made():
        out.backward(grad)
    rows = total + 128 * sequences
    assert made == [
        ("empty_like", (total, h, padded), torch.bfloat16),  # dq
        ("empty_like", (total, kv, padded), torch.bfloat16),  # dk
        ("empty_like", (total, kv, padded), torch.bfloat16),  # dv
        *([("constant_pad_nd", (total, h, padded), torch.bfloat16)] if padded != d else []),  # dout padded
        ("empty", (h, rows), torch.float32),  # softmax_d
        ("empty", (rows, h, rounded), torch.float32),  # dq_accum
        ("empty", (total, h, padded), torch.bfloat16),  # dk expanded to the query heads
        ("empty", (total, h, padded), torch.bfloat16),  # dv expanded
    ]


def test_flash_attention_2_elsewhere_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["audit", "--attn-implementation", "flash_attention_2", "--seq-len", "16"],
        ["estimate", "--attn-implementation", "flash_attention_2", "--target", "cpu", "--seq-len", "16"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "flash_attention_2" in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_audits_bf16_step_is_the_real_trainers(tmp_path: Any) -> None:
    """The real ``Trainer`` with ``bf16=True`` on the CPU (accelerate wraps the model's forward in autocast
    and casts the outputs to fp32) keeps, layer by layer, what ``run_audit(mixed_precision="bf16")`` keeps,
    and peaks as high in the forward and the optimizer step; the lm_head's bf16 copy is a note there too."""
    import dataclasses

    from test_integrations import CONFIG, _trainer

    from vramguard.integrations.transformers import VramGuardCallback
    from vramguard.workload.models import build_qlora

    config = dataclasses.replace(CONFIG, mixed_precision="bf16")
    audit = run_audit(config, steps=2)
    cb = VramGuardCallback(table=False)
    _trainer(build_qlora(config), cb, tmp_path, bf16=True).train()
    report = cb.report
    assert report is not None and report.verdict.ok, report.verdict.line
    assert [(r.name, r.saved_bytes) for r in report.layers] == [(r.name, r.saved_bytes) for r in audit.layers]
    assert report.totals.saved_bytes == audit.totals.saved_bytes
    assert report.totals.outside_layers_bytes == audit.totals.outside_layers_bytes
    for name in ("forward", "optimizer"):
        assert report.phases[name].peak_above_start == audit.phases[name].peak_above_start, name
    plain = run_audit(CONFIG, steps=1)
    assert plain.totals.saved_bytes != audit.totals.saved_bytes  # autocast changed what is saved
    assert any(f.kind == "autocast-casts" for f in report.verdict.findings)


def test_flash_attention_2_refuses_a_padding_free_batch_whose_boundaries_went_missing() -> None:
    """Without ``cu_seq_lens`` transformers asks the position ids whether a row holds several sequences (a device
    read): for a padding-free batch of several the meta run refuses rather than price one long sequence; the
    synthetic rows (one sequence each) are answered as before."""
    import torch
    from transformers import modeling_flash_attention_utils as fa_utils

    from vramguard.errors import UsageError
    from vramguard.estimate.flash import flash_attention_2

    model = torch.nn.Linear(2, 2)
    ids = torch.empty(1, 8, dtype=torch.long, device="meta")
    with flash_attention_2(model, "cuda", one_sequence_per_row=True):
        assert fa_utils._is_packed_sequence(ids, 1) is False
    with (
        flash_attention_2(model, "cuda", one_sequence_per_row=False),
        pytest.raises(UsageError, match="cu_seq_lens"),
    ):
        fa_utils._is_packed_sequence(ids, 1)


def test_a_probes_answer_is_kept_for_the_calls_that_ask_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's autocast is asked once per distinct call (op, structure, each tensor's dtype, shape and
    stride, the other arguments): two steps of the same layers ask it the same, so at most half the routed calls
    run a probe; and the bytes are those of a step that probes every call."""
    from vramguard.estimate import autocast
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=64, batch=2, mixed_precision="bf16", gradient_checkpointing=True)
    probes = []
    probe = autocast.TargetAutocast.probe

    def counted(self: Any, *args: Any) -> Any:
        probes.append(1)
        return probe(self, *args)

    monkeypatch.setattr(autocast.TargetAutocast, "probe", counted)
    kept = run_estimate(config, steps=2, target="cuda")
    assert kept.estimate is not None
    routed = kept.estimate.forced_decisions["autocast_routed"]
    assert 0 < 2 * len(probes) <= routed
    monkeypatch.setattr(autocast, "_probe_key", lambda *args: None)  # every call probed
    every = run_estimate(config, steps=2, target="cuda")
    assert len(probes) > routed
    got, want = kept.to_dict(), every.to_dict()
    for report in (got, want):
        report.pop("elapsed_s")
    assert got == want


def test_an_index_by_slices_is_probed_once_and_by_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice is unhashable before Python 3.12: ``x[:, :4]`` left its call unkeyed and probed on every call
    (2,466 of a 70B step's 2,595 probes). Its bounds key it: the same slices are probed once, other bounds
    apart, and a slice with a tensor bound stays unkeyed (probed each time)."""
    import torch

    from vramguard.estimate import autocast
    from vramguard.estimate.meta import forced_decisions

    probed: list[Any] = []
    probe = autocast.TargetAutocast.probe
    monkeypatch.setattr(
        autocast.TargetAutocast, "probe", lambda self, func, *a: probed.append(func) or probe(self, func, *a)
    )
    x = torch.empty(8, 8, device="meta")
    with forced_decisions("cuda", autocast=True), torch.autocast("meta", dtype=torch.bfloat16):
        shapes = [tuple(x[:, :4].shape), tuple(x[:, :4].shape), tuple(x[:, 2:].shape), tuple(x[:, 2:].shape)]
        n = torch.tensor(3)
        unkeyed = [tuple(x[:n].shape), tuple(x[:n].shape)]
    assert shapes == [(8, 4), (8, 4), (8, 6), (8, 6)] and unkeyed == [(3, 8), (3, 8)]
    assert len(probed) == 2 + 2


def test_a_tensor_given_twice_is_not_answered_as_two_tensors() -> None:
    """The kept answer names the inputs a cast is made of by place: ``mm(x, x)`` probed first must not answer
    ``mm(x, y)`` (x cast twice, y left in fp32); each gets its own probe, and both inputs of ``mm(x, y)`` are
    cast (review)."""
    import torch

    from vramguard.estimate.meta import forced_decisions

    seen: list[tuple[torch.dtype, ...]] = []

    class Kernels(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.mm.default:
                seen.append(tuple(a.dtype for a in args))
            return func(*args, **(kwargs or {}))

    x, y = (torch.empty(8, 8, device="meta") for _ in range(2))
    with forced_decisions("cuda", autocast=True), torch.autocast("meta", dtype=torch.float16), Kernels():
        torch.mm(x, x)
        torch.mm(x, y)
    assert seen == [(torch.float16, torch.float16)] * 2


def test_the_routed_calls_flattening_is_pytrees_and_keys_each_structure_apart() -> None:
    """TargetAutocast walks plain tuples, lists and dicts itself (``_flatten``), in place of ``tree_flatten`` and
    its spec: the leaves are ``tree_flatten``'s, in its order; two structures never share a key; a named tuple or a
    ``torch.Size`` (pytree nodes) is left to ``tree_flatten``."""
    import collections

    import torch
    from torch.utils._pytree import tree_flatten

    from vramguard.estimate.autocast import _flatten

    x = torch.empty(2, 3, device="meta")
    pair = collections.namedtuple("pair", "a b")
    calls = [
        ((x, 1.0), {}),
        ((x, (1.0,)), {}),
        (((x, 1.0),), {}),
        (([x, None], slice(1, 2)), {"dim": -1}),
        ((x,), {"dim": -1, "keepdim": True}),
        ((x,), {"keepdim": True, "dim": -1}),
        ((pair(x, 2),), {}),
        ((x, torch.Size([2, 3])), {}),
    ]
    keys = []
    for args, kwargs in calls:
        leaves, key = _flatten(args, kwargs)
        want, spec = tree_flatten((args, kwargs))
        assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want, strict=True))
        keys.append(key)
        if any(isinstance(a, (pair, torch.Size)) for a in args):
            assert key == spec  # torch's own
    assert len(set(keys)) == len(keys)


def test_no_two_different_calls_share_a_probe_key() -> None:
    """Adversarial (review): slices with negative, None and bool bounds, a tensor bound, lists against
    tuples, keyword order, ints against floats and bools, dtype arguments: every pair of different calls has a
    different key (or none), and an identical call the same key."""
    import torch

    from vramguard.estimate.autocast import _flatten, _probe_key

    x = torch.empty(4, 4, device="meta")
    calls = [
        ((x, slice(None, 2)), {}),
        ((x, slice(0, 2)), {}),
        ((x, slice(-2, None)), {}),
        ((x, slice(None, -2)), {}),
        ((x, slice(None, None, -1)), {}),
        ((x, (slice(None), slice(1, None))), {}),
        ((x, [slice(None), slice(1, None)]), {}),
        ((x, 1), {}),
        ((x, 1.0), {}),
        ((x, True), {}),
        ((x,), {"dtype": torch.float16}),
        ((x,), {"dtype": torch.bfloat16}),
        ((x,), {"dim": 0, "keepdim": True}),
        ((x,), {"keepdim": True, "dim": 0}),
    ]

    def key(args: Any, kwargs: dict[str, Any]) -> Any:
        leaves, spec = _flatten(args, kwargs)
        return _probe_key(torch.Tensor.__getitem__, spec, leaves, "cuda")

    keys = [key(a, k) for a, k in calls]
    assert None not in keys and len(set(keys)) == len(keys)
    assert [key(a, k) for a, k in calls] == keys
    for bound in (True, torch.tensor(1), 1.5):  # not an int: unkeyed (probed each time), never a shared key
        assert key((x, slice(None, bound)), {}) is None
