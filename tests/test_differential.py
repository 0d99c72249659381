"""Random TRL configs, each through ``vramguard estimate --target cpu`` (the meta run) and ``vramguard audit``
(the CPU run): every config both accept gives the same figures to the byte. A sweep of this kind found two
disagreements the per-key tests missed (a boolean mask's inverted copy at 8k packed tokens, bitsandbytes'
8-bit quantization maps counted as a new copy), each since fixed and tested where it lives.

Slow (about 3 s a config): ``pytest -m slow tests/test_differential.py``; ``VRAMGUARD_DIFFERENTIAL_EXAMPLES``
sets how many configs (default 25, derandomized: the same ones every run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramguard.errors import UsageError
from vramguard.workload.models import presets
from vramguard.workload.run_config import load_run_config

MODELS = [
    "tiny-llama",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-olmoe",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-gpt-oss",
]

#: the keys a config may set beside the model and QLoRA itself, each with the values drawn
KEYS: dict[str, list[Any]] = {
    "packing": [True, False],
    "padding_free": [True, False],
    "gradient_checkpointing": [True, False],
    "optim": ["adamw_torch", "adamw_8bit", "paged_adamw_8bit"],
    "bf16": [True, False],
    "bnb_4bit_quant_type": ["nf4", "fp4"],
    "use_bnb_nested_quant": [True, False],
    "lora_r": [4, 8, 64],
    "lora_alpha": [8, 16],
    "lora_dropout": [0.0, 0.05],
    "lora_target_modules": ["all-linear", ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]],
    "use_dora": [True, False],
    "use_rslora": [True, False],
    "attn_implementation": ["sdpa", "eager"],
    "dtype": ["bfloat16", "float32"],
}


@st.composite
def trl_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A ``trl sft --config`` mapping: a tiny preset, QLoRA, a short batch, and a value for each of :data:`KEYS`."""
    config: dict[str, Any] = {
        "model_name_or_path": str(presets()[draw(st.sampled_from(MODELS))]),
        "use_peft": True,
        "load_in_4bit": True,
        "max_length": draw(st.sampled_from([16, 40, 64, 128, 256])),
        "per_device_train_batch_size": draw(st.sampled_from([1, 2])),
    }
    for key in sorted(KEYS):  # every key: the faults found so far each needed two or three settings at once
        config[key] = draw(st.sampled_from(KEYS[key]))
    return config


def _figures(report: Any) -> dict[str, Any]:
    return {
        "totals": report.totals,
        "layers": [(row.name, row.saved_bytes) for row in report.layers],
        "phases": {name: phase.peak_bytes for name, phase in report.phases.items()},
        "steps": [(s.peak_bytes, s.retained_bytes) for s in report.steps],
    }


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("VRAMGUARD_DIFFERENTIAL_EXAMPLES", "25")),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=trl_configs())
def test_the_meta_estimate_of_a_random_config_equals_its_cpu_audit(
    data: dict[str, Any], tmp_path: Path
) -> None:
    from vramguard.audit.run import run_audit
    from vramguard.estimate.run import run_estimate

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_run_config(path).config()
    try:
        audit = run_audit(config, steps=2)
    except (
        UsageError
    ):  # what PEFT or the CPU refuses (e.g. LoRA targets a model lacks): the estimate must too
        with pytest.raises(UsageError):
            run_estimate(config, steps=2, target="cpu")
        return
    assert _figures(run_estimate(config, steps=2, target="cpu")) == _figures(audit)
