"""Vision-language models with ``--method lora`` (issue 45 item 6, ms-swift's grounding.sh): the base in the compute
dtype, no bitsandbytes quantizer, LoRA as PEFT puts it. The meta estimate equals the same model built with random
weights on the CPU (``build_meta(device="cpu")``, the reference a text model's ``lora`` is held against), to the byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from vramguard.cli import main
from vramguard.step.report import AuditReport
from vramguard.workload.models import PRESETS_DIR, QLoRAConfig

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
STEPS = 2


def _figures(report: AuditReport) -> dict[str, Any]:
    """What a run measures, as plain data: totals, phase peaks, each step's retained bytes, the saved records."""
    return {
        "totals": report.totals,
        "phases": {k: (v.peak_bytes, v.peak_above_start) for k, v in report.phases.items()},
        "retained": [(s.retained_bytes, s.retained_after_forward, s.peak_bytes) for s in report.steps],
        "layers": [(r.name, r.saved_bytes, r.activation_bytes, r.weight_copy_bytes) for r in report.layers],
        "weights": report.budget.measured_weights_bytes,
        "lora_training": report.budget.measured_lora_training_bytes,
    }


@pytest.mark.parametrize(
    "name, options",
    [
        # ms-swift's grounding.sh: --freeze_vit true (LoRA on the language model only), gradient checkpointing
        ("qwen2-vl", {"lora_scope": "language-model", "gradient_checkpointing": True}),
        ("qwen2.5-vl", {}),  # all-linear: the tower's and the merger's linear layers get LoRA too
    ],
    ids=["qwen2-vl-frozen-tower-checkpointing", "qwen2.5-vl-all-linear"],
)
def test_lora_meta_estimate_equals_the_cpu_reference(name: str, options: dict[str, Any]) -> None:
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(
        model=str(VLM / f"tiny-{name}.json"),
        seq_len=96,
        batch=1,
        image_size="56x84",
        target_modules="all-linear",
        **options,  # type: ignore[arg-type]
    ).resolved()
    meta = run_estimate(config, steps=STEPS, method="lora", target="cpu")
    cpu = run_estimate(config, steps=STEPS, method="lora", device="cpu")
    assert meta.device == "meta" and cpu.device == "cpu"
    assert meta.totals.saved_bytes > 0
    got, want = _figures(meta), _figures(cpu)
    for key in want:
        assert got[key] == want[key], key
    assert meta.config["extra"]["method"] == "lora"


def _language_model_lora(**shape: object) -> QLoRAConfig:
    """tiny Qwen2-VL, batch 1, LoRA on all linear layers of the language model, with ``shape``'s fields."""
    return QLoRAConfig(  # type: ignore[arg-type]
        model=str(VLM / "tiny-qwen2-vl.json"), batch=1, target_modules="all-linear", lora_scope="language-model", **shape
    )


def test_lora_base_is_the_compute_dtype_without_4bit_layers() -> None:
    """No bitsandbytes layer anywhere, every base weight in bf16 (no k-bit preparation upcasting norms), LoRA only on
    the language model with ``--lora-scope language-model``, the tower frozen."""
    from vramguard.estimate.meta import build_meta

    config = _language_model_lora(seq_len=64, image_size="56x56")
    q = build_meta(config, method="lora")
    modules = dict(q.model.named_modules())
    assert not any(type(m).__name__ == "Linear4bit" for m in modules.values())
    base = {n: p.dtype for n, p in q.model.named_parameters() if "lora_" not in n}
    assert set(base.values()) == {torch.bfloat16}
    lora = [n for n in modules if n.endswith(".lora_A")]
    assert lora and not any(".visual." in n for n in lora)
    assert all(not p.requires_grad for n, p in q.model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "lora", "--vision-tower", "unquantized"], "--method lora quantizes nothing"),
        (["--method", "lora", "--llm-int8-skip-modules", "lm_head"], "--method lora quantizes nothing"),
        (["--method", "full"], "for --method qlora or lora on one device"),
    ],
)
def test_what_lora_cannot_take_is_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(VLM / "tiny-qwen2-vl.json")
    base = ["estimate", "--model", model, "--image-size", "56x56", "--seq-len", "64"]
    assert main([*base, "--target-modules", "all-linear", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_qwen2_vl_7b_preset_has_the_published_shape() -> None:
    """The Hub config.json of Qwen/Qwen2-VL-7B-Instruct (its description names the source)."""
    from vramguard.workload.vision import load_vision_config, vision_shape

    path = PRESETS_DIR / "qwen2-vl-7b.json"
    data = json.loads(path.read_text())
    assert "Qwen/Qwen2-VL-7B-Instruct" in data["description"]
    hf_config, _ = load_vision_config(path)
    shape = vision_shape(path, hf_config)
    assert shape.text["hidden_size"] == 3584 and shape.text["num_hidden_layers"] == 28
    assert shape.text["vocab_size"] == 152064
    assert hf_config.vision_config.embed_dim == 1280 and hf_config.vision_config.depth == 32


@pytest.mark.parametrize(
    "target, weight, stats",
    [
        ("cpu", torch.bfloat16, torch.bfloat16),  # the CPU kernel's statistics in the input's dtype
        ("cpu", torch.float32, torch.float32),  # a mixed call: fp32 on the CPU too
        ("cuda", torch.bfloat16, torch.float32),  # CUDA's (the meta kernel's) accumulation dtype
    ],
)
def test_layer_norm_statistics_take_the_targets_dtype(
    target: str, weight: torch.dtype, stats: torch.dtype
) -> None:
    """What autograd saves of a bf16 LayerNorm: its mean and rstd, whose dtype the device's kernel decides."""
    from vramguard.estimate.meta import target_decisions

    def native(device: str) -> tuple[torch.Tensor, ...]:
        x = torch.empty(24, 64, dtype=torch.bfloat16, device=device)
        w = torch.empty(64, dtype=weight, device=device)
        return torch.ops.aten.native_layer_norm(x, [64], w, w, 1e-6)  # type: ignore[no-any-return]

    with target_decisions(target):
        out = native("meta")
    assert [t.dtype for t in out[1:]] == [stats, stats]
    if target == "cpu":
        assert [(t.dtype, t.shape) for t in native("cpu")[1:]] == [(t.dtype, t.shape) for t in out[1:]]


def test_lora_estimate_saves_what_an_independent_count_of_the_cpu_model_saves() -> None:
    """The meta run's saved bytes against a count written without vramguard's ledger (tests/saved_count.py: a
    ``saved_tensors_hooks`` count of one forward and loss) of the CPU-built model's first step."""
    from saved_count import independent_saved_bytes

    from vramguard.estimate.meta import build_meta
    from vramguard.estimate.run import run_estimate

    config = _language_model_lora(seq_len=96, image_size="56x84", gradient_checkpointing=True).resolved()
    cpu = build_meta(config, method="lora", device="cpu")
    independent = independent_saved_bytes(cpu.model, cpu.batch())
    meta = run_estimate(config, steps=1, method="lora", target="cpu")
    assert meta.totals.saved_bytes == independent > 0


@pytest.mark.parametrize(
    "method, said", [("lora", "LoRA on the base in its compute dtype"), ("full", "every parameter trained")]
)
def test_the_loops_recipe_line_names_what_the_method_did(method: str, said: str, tmp_path: Path) -> None:
    """The loop runs ``prepare_model_for_kbit_training`` for qlora only: the recipe line of a lora or full run said
    it did (of a text model's run too)."""
    out = tmp_path / "run.json"
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "32", "--batch", "1", "--trainer", "loop"]
    assert main([*argv, "--method", method, "--json", str(out), "--quiet"]) == 0
    recipe = json.loads(out.read_text())["config"]["recipe"]
    assert f"vramguard's loop ({said}, full fp32 logits)" in recipe and "kbit" not in recipe
