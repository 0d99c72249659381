"""`vramguard audit`: the measurement, its JSON document, its verdict and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramguard.audit import run_audit
from vramguard.cli import main
from vramguard.models import QLoRAConfig
from vramguard.report import SCHEMA_VERSION, AuditReport

SMALL = QLoRAConfig(seq_len=32, batch=1)


@pytest.fixture(scope="module")
def report() -> AuditReport:
    return run_audit(SMALL, steps=3)


def test_measured_activations_equal_the_analytic_model_on_cpu(report: AuditReport) -> None:
    # Storage tracking on CPU is exact, and so is the per-layer formula for sdpa: no band needed.
    assert report.budget.measured_activation_bytes == report.budget.analytic_activation_bytes
    for row in report.layers:
        assert row.saved_bytes == row.analytic_bytes, row.name
    assert report.totals.outside_layers_bytes == report.budget.analytic_outside_layers_bytes


def test_lora_training_bytes_are_16_per_parameter(report: AuditReport) -> None:
    b = report.budget
    counters = 4 * 2 * 14  # Adam keeps one fp32 step counter per LoRA tensor (A and B of 14 layers)
    assert b.measured_lora_training_bytes == b.analytic_lora_training_bytes + counters


def test_quantized_weights_match_the_exact_storage_formula(report: AuditReport) -> None:
    buffers = 2 * 16 * 4  # rotary inv_freq and original_inv_freq (head_dim / 2 fp32 each)
    assert report.budget.measured_weights_bytes == report.budget.analytic_weights_bytes + buffers


def test_verdict_ok_without_weight_copies_or_growth(report: AuditReport) -> None:
    assert report.verdict.ok, report.verdict.line
    assert report.totals.weight_copy_bytes == 0
    assert report.leak_bytes == 0
    assert len({s.retained_bytes for s in report.steps}) == 1
    assert report.verdict.line.startswith("OK:")


def test_json_document_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    code = main(["audit", "--seq-len", "16", "--batch", "1", "--steps", "2", "--quiet", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["environment"]["packages"]["bitsandbytes"]
    assert data["config"]["seq_len"] == 16
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert set(data["phases"]) == {"forward", "backward", "optimizer"}
    assert data["records"] and all(r["source"] in ("hook", "ctx") for r in data["records"])
    assert AuditReport.from_dict(data).to_dict() == data


def test_json_of_another_schema_is_rejected() -> None:
    with pytest.raises(ValueError, match="schema_version"):
        AuditReport.from_dict({"schema_version": SCHEMA_VERSION + 1})


def test_a_saved_weight_copy_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit forward that keeps its dequantized weight on ctx: hooks cannot see it, the ctx walk can."""
    import bitsandbytes.functional as bnbF
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.forward

    def leaky_forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[no-untyped-def]
        ctx.dequantized = bnbF.dequantize_4bit(B, quant_state).to(A.dtype)
        return original(ctx, A, B, out, bias, quant_state)

    monkeypatch.setattr(MatMul4Bit, "forward", staticmethod(leaky_forward))
    report = run_audit(SMALL, steps=1)
    assert not report.verdict.ok
    assert "weight copies" in report.verdict.line
    # each (out, in) copy in bf16; 7 projections per layer, except layer 0's q/k/v: their input
    # (normed embeddings, frozen norm) needs no grad, so autograd builds no node to keep a ctx
    h, i, kv = 128, 352, 2 * 32
    qkv = h * h + 2 * h * kv
    per_layer = (qkv + h * h + 3 * h * i) * 2
    assert report.totals.weight_copy_bytes == 2 * per_layer - qkv * 2
    assert report.totals.ctx_bytes == report.totals.weight_copy_bytes


def test_growth_across_steps_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module-level cache that grows each step: invisible to the ledger, caught by the tracker."""
    from transformers.models.llama import modeling_llama

    cache: list[torch.Tensor] = []
    original = modeling_llama.LlamaMLP.forward

    def caching_forward(self, x):  # type: ignore[no-untyped-def]
        out = original(self, x)
        cache.append(out.detach().clone())
        return out

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", caching_forward)
    report = run_audit(SMALL, steps=3)
    assert not report.verdict.ok
    per_step = 2 * 32 * 128 * 4  # two layers' MLP outputs, (1, 32, 128) fp32 each
    assert report.leak_bytes == 2 * per_step
    assert "grew" in report.verdict.line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "0"], "must be positive"),
        (["--batch", "x"], "not an integer"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--lora-dropout", "1.5"], "dropout must be in [0, 1)"),
        (["--device", "tpu"], "not a device: 'tpu'"),
        (["--device", "meta"], "device must be cpu or cuda"),
        (["--quant-type", "int4"], "invalid choice"),
        (["--json", "/dev/null/report.json"], "cannot write --json"),  # checked before the run
    ],
)
def test_bad_options_give_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramguard: error:") and message in err
    assert len(err.splitlines()) == 1


def test_bad_model_file_gives_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    assert main(["audit", "--model", str(bad)]) == 2
    assert "cannot read model config" in capsys.readouterr().err
    bad.write_text(json.dumps({"hidden_size": 64}))
    assert main(["audit", "--model", str(bad)]) == 2
    assert "lacks" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ({"num_key_value_heads": 3}, "num_attention_heads is not a multiple of num_key_value_heads"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a positive number"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"head_dim": 3}, "head_dim must be even"),
    ],
)
def test_inconsistent_model_config_gives_one_line(
    override: dict[str, object], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Values transformers would reject with a traceback (or fail on mid-forward) are caught up front."""
    from vramguard.models import presets

    fields = {**json.loads(presets()["tiny-llama"].read_text()), **override}
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(fields))
    assert main(["audit", "--model", str(bad), "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramguard: error:") and message in err and len(err.splitlines()) == 1


def test_console_script_error_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramguard", "audit", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["vramguard: error: argument --steps: must be positive: '0'"]


@pytest.mark.parametrize(
    "variant",
    [
        {"gradient_checkpointing": True},
        {"attn_implementation": "eager", "lora_dropout": 0.2, "seq_len": 20},
        {"lora_dropout": 0.1, "batch": 2, "seq_len": 24, "lora_rank": 4},
        {"compute_dtype": "fp16", "quant_type": "fp4", "double_quant": False},
    ],
    ids=["checkpointing", "eager+dropout", "dropout-batch2", "fp16-fp4-single-quant"],
)
def test_analytic_model_is_exact_for_every_variant_on_cpu(variant: dict[str, object]) -> None:
    config = QLoRAConfig(**{"seq_len": 32, "batch": 1, **variant})  # type: ignore[arg-type]
    r = run_audit(config, steps=1)
    assert [row.saved_bytes for row in r.layers] == [row.analytic_bytes for row in r.layers]
    assert r.totals.outside_layers_bytes == r.budget.analytic_outside_layers_bytes
    if config.gradient_checkpointing:
        tokens_x_hidden_fp32 = 32 * 128 * 4
        assert [row.saved_bytes for row in r.layers] == [tokens_x_hidden_fp32] * 2
