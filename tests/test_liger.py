"""``use_liger_kernel`` (``estimate --use-liger-kernel``): Liger applied on meta as transformers' Trainer applies it,
priced by liger-kernel's own Python with its Triton launches skipped (vramguard.estimate.liger); the one-line
refusals (no liger extra, a CPU target); the audit naming it not priced.

The priced runs need the ``liger`` extra (``pip install -c constraints.txt -e ".[liger]"``: liger-kernel and
Triton, which import on a machine without a GPU); without it those tests skip and say so. Every expected number
here is computed from the shapes, independently of Liger's code and of vramguard's."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

from vramguard.cli import main
from vramguard.workload.models import ModelSpec, QLoRAConfig, packed_lengths

ROOT = Path(__file__).resolve().parents[1]
HAS_LIGER = all(importlib.util.find_spec(name) is not None for name in ("liger_kernel", "triton"))
# .ci/run installs the liger extra and sets VRAMGUARD_REQUIRE_LIGER=1: there a missing liger-kernel fails, never
# skips (a CI that skipped every priced run would still pass)
needs_liger = pytest.mark.skipif(
    not HAS_LIGER and os.environ.get("VRAMGUARD_REQUIRE_LIGER") != "1",
    reason='liger-kernel is not installed: the liger extra (pip install -c constraints.txt -e ".[liger]")',
)

# tiny-llama: vocab 512, hidden 128. At batch 1 x seq 100 the fused cross-entropy's chunk of logits (32 x 512) has
# a size no other tensor of the step has, and several chunks are run (the last one short)
CONFIG = QLoRAConfig(batch=1, seq_len=100)


def _next_power_of_2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk of tokens, from its description (fused_linear_cross_entropy_forward): the logits of a chunk
    are bounded by tokens x hidden elements, ``next_power_of_2(cdiv(BT, cdiv(V, H)))``, at most BT."""
    inc = -(-vocab // hidden)
    return min(_next_power_of_2(-(-tokens // inc)), tokens)


def _liger(module: str) -> Any:
    """A module of the liger extra (a guarded import: the extra is optional, needs_liger skips without it)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(
            f"{module} does not import (VRAMGUARD_REQUIRE_LIGER=1 or needs_liger let this run): {exc}"
        )


def _estimate(config: QLoRAConfig, events: Any = None) -> Any:
    from vramguard.estimate.run import run_estimate

    return run_estimate(config, steps=2, target="cuda", events=events)


def _activations(report: Any) -> list[dict[str, Any]]:
    return [r for r in report.records if r["kind"] == "activation"]


@pytest.fixture(scope="module")
def fp32_runs() -> dict[bool, Any]:
    """The step without and with Liger (fp32 activations, no autocast: CUDA's path reuses one logits buffer),
    each with its allocation log."""
    from vramguard.measure.events import AllocationLog

    runs = {}
    for liger in (False, True):
        events = AllocationLog()
        report = _estimate(dataclasses.replace(CONFIG, use_liger_kernel=liger), events=events)
        runs[liger] = (report, events)
    return runs


@needs_liger
def test_the_fused_cross_entropy_keeps_grad_input_not_the_fp32_logits(fp32_runs: dict[bool, Any]) -> None:
    plain, _ = fp32_runs[False]
    liger, _ = fp32_runs[True]
    spec = ModelSpec.load(CONFIG.model)
    vocab, hidden = spec.fields["vocab_size"], spec.fields["hidden_size"]
    tokens = CONFIG.batch * CONFIG.seq_len
    # without Liger: transformers' loss keeps fp32 log-softmaxed logits, tokens x vocab
    assert any(r["shape"][-1] == vocab and r["bytes"] == tokens * vocab * 4 for r in _activations(plain)), (
        "the plain step keeps no tokens x vocab logits: the comparison below would prove nothing"
    )
    # with Liger: nothing x vocab is kept; its Function keeps grad_input, tokens x hidden, in the hidden dtype (fp32)
    assert not [r for r in _activations(liger) if r["shape"][-1] == vocab]
    kept = [r for r in _activations(liger) if r["node"] == "LigerFusedLinearCrossEntropyFunctionBackward"]
    assert [(tuple(r["shape"]), r["bytes"]) for r in kept] == [((tokens, hidden), tokens * hidden * 4)]
    saved = plain.totals.saved_bytes - liger.totals.saved_bytes
    assert saved >= tokens * vocab * 4 - tokens * hidden * 4, (
        plain.totals.saved_bytes,
        liger.totals.saved_bytes,
    )
    assert liger.estimate.allocator_peak_bytes < plain.estimate.allocator_peak_bytes
    line = next(f.message for f in liger.verdict.findings if f.kind == "liger")
    assert "liger-kernel 0.8.5's own code" in line and "not run" in line and "not validated on a GPU" in line


@needs_liger
def test_the_chunk_of_logits_follows_liger_s_rule_and_cuda_reuses_one_buffer(
    fp32_runs: dict[bool, Any],
) -> None:
    """CUDA's path (``_can_use_mm_out``: fp32 input and weight, no autocast) allocates one chunk x vocab buffer per
    forward and reuses it for every chunk; the whole tokens x vocab logits are never made."""
    spec = ModelSpec.load(CONFIG.model)
    vocab, hidden = spec.fields["vocab_size"], spec.fields["hidden_size"]
    tokens = CONFIG.batch * CONFIG.seq_len
    chunk = liger_chunk(tokens, vocab, hidden)
    assert (chunk, -(-tokens // chunk)) == (32, 4)  # several chunks, the last one short
    chunk_bytes = chunk * vocab * 4

    def forward_allocs(events: Any, size: int) -> int:
        return sum(
            1 for alloc, a, _ in events.events if alloc and a.size == size and a.context[0] == "forward"
        )

    _, plain_events = fp32_runs[False]
    liger, liger_events = fp32_runs[True]
    assert forward_allocs(plain_events, chunk_bytes) == 0  # the size is the chunk's alone
    assert forward_allocs(liger_events, chunk_bytes) == 2  # one per step (2 steps)
    assert forward_allocs(plain_events, tokens * vocab * 4) >= 2  # the plain step's whole logits
    assert forward_allocs(liger_events, tokens * vocab * 4) == 0
    line = next(f.message for f in liger.verdict.findings if f.kind == "liger")
    assert f"{chunk} x {vocab} float32 logits" in line and "one buffer reused" in line


@needs_liger
def test_under_autocast_each_chunk_gets_its_own_bf16_logits() -> None:
    """With Trainer's bf16 autocast the input is fp32 and autocast's matmul gives bf16 logits, so CUDA's
    ``_can_use_mm_out`` says no: every chunk computes its own chunk x vocab bf16 logits."""
    from vramguard.estimate.liger import liger_kernel
    from vramguard.estimate.meta import build_meta, forced_decisions
    from vramguard.measure.tracker import MemoryTracker, StorageTracker
    from vramguard.workload.training import make_optimizer, run_steps

    config = dataclasses.replace(CONFIG, mixed_precision="bf16", use_liger_kernel=True)
    q = build_meta(config)
    source = StorageTracker(None)
    source.device = "meta"
    with (
        forced_decisions("cuda", autocast=True),
        liger_kernel(q.model, "cuda", q.host_labels()) as ran,
        MemoryTracker("meta", model=q.model, source=source) as tracker,
    ):
        run_steps(q, 1, tracker, optimizer=make_optimizer(q))
    spec = ModelSpec.load(CONFIG.model)
    tokens = CONFIG.batch * CONFIG.seq_len
    chunk = liger_chunk(tokens, spec.fields["vocab_size"], spec.fields["hidden_size"])
    rows = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    assert ran["mm_out"] == [False]
    assert ran["logits_chunks"] == [((n, spec.fields["vocab_size"]), torch.bfloat16) for n in rows]


def _count_run(config: QLoRAConfig) -> dict[str, Any]:
    from vramguard.estimate.liger import liger_kernel
    from vramguard.estimate.meta import build_meta, forced_decisions
    from vramguard.measure.tracker import MemoryTracker, StorageTracker
    from vramguard.workload.training import make_optimizer, run_steps

    q = build_meta(config)
    source = StorageTracker(None)
    source.device = "meta"
    with (
        forced_decisions("cuda", one_sequence_per_row=q.one_sequence_per_row),
        liger_kernel(q.model, "cuda", q.host_labels()) as ran,
        MemoryTracker("meta", model=q.model, source=source) as tracker,
    ):
        run_steps(q, 1, tracker, optimizer=make_optimizer(q))
    return ran


@needs_liger
def test_the_item_is_answered_with_the_batch_s_non_ignored_token_count() -> None:
    """``target_mask.sum().item()``: every token but each sequence's first is a target (the shift); TRL's
    padding-free collator ignores the first label of every sequence, so packing two sequences per row changes
    the answer."""
    rows = QLoRAConfig(batch=2, seq_len=64, use_liger_kernel=True)
    packed = QLoRAConfig(batch=2, seq_len=64, padding_free=True, packing=True, use_liger_kernel=True)
    plain_ran, packed_ran = _count_run(rows), _count_run(packed)
    tokens = 2 * 64
    assert plain_ran["item_answers"] == [tokens - 2]  # two rows, one sequence each
    sequences = 2 * len(packed_lengths(64, True))
    assert sequences == 4
    assert packed_ran["item_answers"] == [tokens - sequences]
    assert plain_ran["answered"] == packed_ran["answered"] == {"item": 1, "equal": 1}


@needs_liger
def test_the_triton_launcher_and_the_patched_modules_are_restored_also_after_an_error() -> None:
    from transformers.models.llama import modeling_llama

    from vramguard.estimate.liger import liger_kernel, triton_launches_skipped
    from vramguard.estimate.meta import build_meta

    flce = _liger("liger_kernel.ops.fused_linear_cross_entropy")
    KernelInterface = _liger("triton.runtime.jit").KernelInterface

    launcher = KernelInterface.__dict__["__getitem__"]
    before = {
        "rope": modeling_llama.apply_rotary_pos_emb,
        "norm": modeling_llama.LlamaRMSNorm,
        "mlp": modeling_llama.LlamaMLP,
        "forward": flce.fused_linear_cross_entropy_forward,
        "mm_out": flce._can_use_mm_out,
    }

    def now() -> dict[str, Any]:
        return {
            "rope": modeling_llama.apply_rotary_pos_emb,
            "norm": modeling_llama.LlamaRMSNorm,
            "mlp": modeling_llama.LlamaMLP,
            "forward": flce.fused_linear_cross_entropy_forward,
            "mm_out": flce._can_use_mm_out,
        }

    with triton_launches_skipped():
        assert KernelInterface.__dict__["__getitem__"] is not launcher
    assert KernelInterface.__dict__["__getitem__"] is launcher
    with pytest.raises(RuntimeError, match="inside"), triton_launches_skipped():
        raise RuntimeError("inside")
    assert KernelInterface.__dict__["__getitem__"] is launcher

    q = build_meta(QLoRAConfig(use_liger_kernel=True))
    with pytest.raises(RuntimeError, match="inside"), liger_kernel(q.model, "cuda", q.host_labels()):
        changed = now()
        assert changed["rope"] is not before["rope"] and changed["forward"] is not before["forward"]
        assert KernelInterface.__dict__["__getitem__"] is not launcher
        raise RuntimeError("inside")
    assert now() == before
    assert KernelInterface.__dict__["__getitem__"] is launcher


def test_refused_in_one_line_where_liger_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Made absent here whether or not it is installed: one line, exit 2, naming the extra, before anything
    is built."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    assert main(["estimate", "--use-liger-kernel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "liger_kernel" in err[0] and ".[liger]" in err[0], err


def test_refused_in_one_line_on_a_cpu_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--use-liger-kernel", "--target", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0], err
    assert main(["estimate", "--use-liger-kernel", "--world-size", "2", "--sharding", "fsdp2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "on one device" in err[0], err


def test_the_audit_names_it_not_priced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The audit runs on the host, where Triton cannot: measured without Liger, and said so."""
    pytest.importorskip("trl")
    from vramguard.workload.models import presets
    from vramguard.workload.run_config import load_run_config

    data = {
        "model_name_or_path": str(presets()["tiny-llama-hf"]),
        "per_device_train_batch_size": 1,
        "max_length": 16,
        "use_peft": True,
        "load_in_4bit": True,
        "bf16": False,
        "dtype": "bfloat16",
        "use_liger_kernel": True,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    run = load_run_config(path)
    assert run.values["use_liger_kernel"] is True
    assert "use_liger_kernel=true" in run.lines()[0] and not run.named("not-priced")
    assert main(["audit", "--config", str(path), "--steps", "2", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "NOT PRICED: use_liger_kernel=true" in err and "vramguard estimate prices it" in err


def test_liger_is_declared_in_its_extra_and_pinned() -> None:
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(Requirement(r).name for r in extras["liger"]) == ["liger-kernel", "triton"]
    assert not {"liger-kernel", "triton"} & {Requirement(r).name for r in extras["test"]}
    pins = {
        line.split("==")[0]: line.split("==")[1].strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    assert pins.get("liger-kernel") == "0.8.5" and pins.get("triton") == "3.9.0"
    ci = (ROOT / ".ci" / "run").read_text()
    assert '".[liger]"' in ci and "VRAMGUARD_REQUIRE_LIGER=1" in ci and "tests/test_liger.py" in ci
