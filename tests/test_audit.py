"""`vramguard audit`: the measurement, its JSON document, its verdict and its errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramguard.audit import run as audit
from vramguard.audit.run import run_audit
from vramguard.cli import audit as audit_cli
from vramguard.cli.app import library_noise_hidden, main
from vramguard.errors import UsageError
from vramguard.model.analytic import planned_expectation
from vramguard.step.report import SCHEMA_VERSION, AuditReport
from vramguard.view.console import UNWRAPPED_WIDTH
from vramguard.workload.models import ModelSpec, QLoRAConfig, build_qlora, parse_dtype

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


def _same_budget(report: AuditReport, config: QLoRAConfig) -> None:
    """The analytic model from the config alone (what the memory check uses before building)
    equals the one computed on the built model."""
    plan, b = planned_expectation(config, ModelSpec.load(config.model)), report.budget
    assert (plan.quantized_params, plan.other_params, plan.lora_params) == (
        b.quantized_params,
        b.other_params,
        b.lora_params,
    )
    assert plan.weights_bytes == b.analytic_weights_bytes
    assert plan.lora_training_bytes == b.analytic_lora_training_bytes
    assert plan.activation_bytes == b.analytic_activation_bytes
    assert plan.layer_bytes == [row.analytic_bytes for row in report.layers]


def test_planned_budget_equals_the_built_models(report: AuditReport) -> None:
    _same_budget(report, SMALL)


def test_planned_budget_counts_tied_embeddings_once(tmp_path: Path) -> None:
    from vramguard.model.analytic import qlora_expectation
    from vramguard.workload.models import presets

    path = tmp_path / "tied.json"
    path.write_text(
        json.dumps({**json.loads(presets()["tiny-llama"].read_text()), "tie_word_embeddings": True})
    )
    config = QLoRAConfig(model=str(path), seq_len=16, batch=1, lora_rank=4)
    q = build_qlora(config)
    built = qlora_expectation(
        q.model, q.spec, batch=1, seq_len=16, lora_rank=4, compute_dtype=parse_dtype(config.compute_dtype)
    )
    plan = planned_expectation(config, q.spec)
    assert (plan.other_params, plan.weights_bytes, plan.lora_params) == (
        built.other_params,
        built.weights_bytes,
        built.lora_params,
    )
    assert plan.other_params == 512 * 128 + 5 * 128  # one embedding matrix, 2 norms per layer + final


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
        (["--seed", str(2**70)], "seed must be in [-2**63, 2**64 - 1]"),  # was a traceback
        (["--seed", "2**70"], "invalid int value"),
        (["--quiet", "--verbose"], "not allowed with argument"),
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


def test_binary_model_file_gives_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 16)
    assert main(["audit", "--model", str(binary)]) == 2  # was a UnicodeDecodeError traceback
    err = capsys.readouterr().err.strip()
    assert err == f"vramguard: error: cannot read model config {binary}: not UTF-8 text (a binary file?)"


def test_huge_seq_len_is_refused_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A billion tokens: the analytic model says what it would take, nothing is allocated."""

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built for a run that cannot fit")

    monkeypatch.setattr(audit, "build_qlora", must_not_build)
    assert main(["audit", "--seq-len", "1000000000"]) == 2
    err = capsys.readouterr().err.strip()
    need = planned_expectation(QLoRAConfig(seq_len=10**9), ModelSpec.load("tiny-llama")).total_bytes
    assert need > 4 * 2 * 10**9 * 512  # the fp32 logits alone: 4 B x 2e9 tokens x 512 vocab
    assert len(err.splitlines()) == 1
    assert err.startswith("vramguard: error: tiny-llama at batch 2 x seq 1000000000 needs at least ")
    assert f"({need:,} B by the analytic model: weights " in err
    assert "of RAM is available; lower --seq-len or --batch" in err
    with pytest.raises(UsageError, match="needs at least"):  # the API refuses too
        run_audit(QLoRAConfig(seq_len=10**9, batch=1))


def test_the_memory_check_refuses_only_above_what_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    config = QLoRAConfig(seq_len=64, batch=2)
    need = planned_expectation(config, ModelSpec.load(config.model)).total_bytes
    monkeypatch.setattr(audit, "available_memory", lambda device: (need, "of RAM is available"))
    assert audit.check_fits(config).total_bytes == need
    monkeypatch.setattr(audit, "available_memory", lambda device: (need - 1, "of RAM is available"))
    with pytest.raises(UsageError, match=rf"needs at least .*\({need:,} B by the analytic model"):
        audit.check_fits(config)


def test_piped_output_does_not_wrap(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal (a CI log): one line per table row, the verdict on one greppable line."""
    monkeypatch.delenv("COLUMNS", raising=False)
    argv = ["audit", "--seq-len", "16", "--batch", "1", "--steps", "2"]
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and out.startswith("OK: no weight copies") and len(out) > 81, out
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == out.strip()
    for layer in ("layers.0", "layers.1"):  # the top-modules cell is not folded into a second line
        (row,) = [line for line in lines if f" {layer} " in line]
        assert row.count("KiB") == 6, row  # saved, activations, analytic and three modules
    (note,) = [line for line in lines if line.startswith("note: activations are fp32")]
    assert note.endswith("(2x the bytes; TRL's SFTTrainer skips it: --trainer sft)")  # one line, not wrapped


def test_a_set_columns_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert audit_cli.stdout_console().width == 100
    monkeypatch.delenv("COLUMNS")
    assert audit_cli.stdout_console().width == UNWRAPPED_WIDTH


def test_only_the_known_library_line_is_hidden(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    noise = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ..."
    with caplog.at_level(logging.WARNING), library_noise_hidden() as hidden:
        log.warning(noise, "No module named 'kernels'")
        log.warning(noise, "No module named 'kernels'")
        log.warning("another bitsandbytes warning")
        logging.getLogger("bitsandbytes.functional").warning(noise, "elsewhere")
    assert [r.getMessage() for r in caplog.records] == [
        "another bitsandbytes warning",
        noise % "elsewhere",  # the filter is on the one logger that says it, not on bitsandbytes
    ]
    assert hidden == [noise % "No module named 'kernels'"]  # once
    caplog.clear()
    log.warning(noise, "x")  # the filter is gone after the block
    assert len(caplog.records) == 1


def test_library_noise_stays_out_of_the_commands_output(tmp_path: Path) -> None:
    """``--verbose`` notes what a library logged once, in vramguard's words: a real estimate in a fresh
    process (bitsandbytes warns at import, before anything of vramguard runs) writes its JSON report and
    notes the line. Without ``--verbose`` a real audit in a fresh process prints nothing on stderr: that run
    is the wheel install's in tests/test_models.py, which runs the installed console script. This is also the
    default run's one estimate in a fresh process (the estimate benchmark's runs only where numbers are kept):
    it needs nothing the test session imported first."""
    raw = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = tmp_path / "estimate.json"
    argv = [sys.executable, "-m", "vramguard", "estimate", "--seq-len", "8", "--batch", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv += ["--json", str(report), "--verbose"]
    verbose = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert verbose.returncode == 0, verbose.stderr
    estimate = json.loads(report.read_text())["estimate"]
    assert estimate["total_bytes"] > estimate["allocator_peak_bytes"] > 0
    if "gemm_4bit_forward" not in raw.stderr:
        pytest.skip("bitsandbytes logs no kernels-community warning on this machine: nothing to note")
    note = "vramguard: note: a library logged (hidden without --verbose): "
    # (DeepSpeed, where the distributed extra is installed, is imported by the audit's Trainer path, not here)
    assert verbose.stderr.splitlines() == [note + raw.stderr.strip()]


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
    from vramguard.workload.models import presets

    fields = {**json.loads(presets()["tiny-llama"].read_text()), **override}
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(fields))
    assert main(["audit", "--model", str(bad), "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vramguard: error:") and message in err and len(err.splitlines()) == 1


def test_console_script_error_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramguard", "audit", "--steps", "0"],
        check=False,
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
    _same_budget(r, config)
    assert [row.saved_bytes for row in r.layers] == [row.analytic_bytes for row in r.layers]
    assert r.totals.outside_layers_bytes == r.budget.analytic_outside_layers_bytes
    if config.gradient_checkpointing:
        tokens_x_hidden_fp32 = 32 * 128 * 4
        assert [row.saved_bytes for row in r.layers] == [tokens_x_hidden_fp32] * 2


def test_a_full_size_preset_that_cannot_be_built_here_is_refused_with_the_figure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The audit builds the model once in fp32 on the host: 8B parameters need 32 GB of RAM and disk.
    Refused before anything is built, with the figure (was: the kernel's OOM killer mid-build)."""

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built although it cannot fit")

    monkeypatch.setattr(audit, "build_qlora", must_not_build)
    plan = planned_expectation(QLoRAConfig(model="llama-3.1-8b"), ModelSpec.load("llama-3.1-8b"))
    params = plan.quantized_params + plan.other_params
    assert 7.9e9 < params < 8.1e9  # Llama-3.1-8B: 8.03e9
    monkeypatch.setattr(audit, "available_memory", lambda device: (4 * params - 1, "of RAM is available"))
    assert main(["audit", "--model", "llama-3.1-8b", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(
        f"vramguard: error: llama-3.1-8b has {params:,} parameters: the audit builds them once"
    )
    assert "of RAM is available; audit a smaller preset" in err
    monkeypatch.setattr(audit, "available_memory", lambda device: (10**15, "of RAM is available"))
    monkeypatch.setattr(audit.shutil, "disk_usage", lambda path: shutil_usage(4 * params - 1))
    assert main(["audit", "--model", "llama-3.1-8b", "--seq-len", "16"]) == 2
    assert "free on " in capsys.readouterr().err


def shutil_usage(free: int) -> object:
    import shutil

    return shutil._ntuple_diskusage(10**15, 10**15 - free, free)  # type: ignore[attr-defined]


def test_the_verdict_is_one_line_even_with_columns_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """COLUMNS=80 (pytest-xdist workers set it, so do some CI runners): tables may wrap, the verdict not."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["audit", "--seq-len", "8", "--batch", "1", "--steps", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and len(out.splitlines()) == 1 and len(out) > 80, out


def test_a_verdict_whose_ok_disagrees_with_its_problems_is_not_read() -> None:
    """ok is derived from the problems; a document where the two disagree is refused, not flipped."""
    from vramguard.step.report import Verdict

    good = Verdict.from_dict({"ok": False, "line": "PROBLEM: x", "problems": ["x"], "notes": []})
    assert not good.ok and good.problems == ["x"]
    with pytest.raises(ValueError, match="ok=False"):
        Verdict.from_dict({"ok": False, "line": "PROBLEM: x", "problems": [], "notes": []})
