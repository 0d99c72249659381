"""``vramguard estimate --trainer sft|trainer``: the real SFTTrainer's / Trainer's step on meta, equal to the
audit of the same trainer on the CPU, and TRL's differences from vramguard's loop priced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramguard.cli.app import main
from vramguard.estimate.run import run_estimate
from vramguard.estimate.trainer import run_trainer_estimate
from vramguard.integrations.trainer_audit import run_trainer_audit
from vramguard.workload.models import QLoRAConfig

pytest.importorskip("trl")


def figures(report) -> tuple[dict[str, int], int, list[int]]:
    """Each phase's peak, the saved bytes and each step's retained bytes."""
    return (
        {name: p.peak_bytes for name, p in report.phases.items()},
        report.totals.saved_bytes,
        [s.retained_bytes for s in report.steps],
    )


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(
            {"gradient_checkpointing": True, "mixed_precision": "bf16", "gradient_accumulation_steps": 2},
            id="checkpointing-autocast-accumulation",
        ),
        pytest.param({"padding_free": True, "packing": True, "optimizer": "adamw-8bit"}, id="packing-8bit"),
        pytest.param({"use_dora": True, "mixed_precision": "bf16"}, id="dora-autocast"),
    ],
)
def test_the_sft_step_on_meta_equals_its_audit(tmp_path: Path, settings: dict) -> None:
    config = QLoRAConfig(model="tiny-llama", device="cpu", **settings)
    audited = run_trainer_audit(config, 2, "sft", tmp_path)
    estimated = run_trainer_estimate(config, "sft", steps=2, target="cpu")
    assert figures(estimated) == figures(audited)
    assert estimated.device == "meta" and estimated.estimate is not None


def test_the_trainer_step_on_meta_equals_its_audit(tmp_path: Path) -> None:
    config = QLoRAConfig(model="tiny-llama", device="cpu", gradient_checkpointing=True)
    audited = run_trainer_audit(config, 2, "trainer", tmp_path)
    assert figures(run_trainer_estimate(config, "trainer", steps=2, target="cpu")) == figures(audited)


def test_trls_differences_from_the_loop_are_priced() -> None:
    """SFTTrainer skips prepare_model_for_kbit_training (norms stay bf16: fewer frozen bytes), casts the adapters
    of a 4-bit model to bf16 (half the loop's fp32 adapters) and takes its loss from chunked log-probs (no
    batch x seq x vocab fp32 logits saved, where the loop keeps them)."""
    config = QLoRAConfig(model="tiny-llama", device="cpu")
    loop = run_estimate(config, steps=1, target="cpu")
    sft = run_trainer_estimate(config, "sft", steps=1, target="cpu")
    assert loop.estimate is not None and sft.estimate is not None
    assert sft.estimate.weights_bytes < loop.estimate.weights_bytes  # the loop's norms upcast to fp32
    assert 2 * sft.estimate.trainable_bytes == loop.estimate.trainable_bytes  # bf16 adapters
    vocab = 512

    def logits(report) -> int:
        return sum(r["bytes"] for r in report.records if r["shape"][-1:] == [vocab] and r["kind"] == "activation")

    assert logits(loop) >= 2 * 128 * vocab * 4  # batch x seq x vocab fp32
    assert logits(sft) < logits(loop)
    assert sft.estimate.step_peak_bytes != loop.estimate.step_peak_bytes


def _yaml(tmp_path: Path) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(
        "per_device_train_batch_size: 2\nmax_length: 128\nuse_peft: true\nload_in_4bit: true\n"
        "gradient_checkpointing: true\nuse_dora: true\n"
    )
    return path


def test_a_trl_yaml_runs_sftTrainer_in_estimate_and_audit(tmp_path: Path, capsys) -> None:
    path = _yaml(tmp_path)
    common = ["--config", str(path), "--model", "tiny-llama", "--steps", "2", "--quiet"]
    assert main(["estimate", *common, "--target", "cpu", "--json", str(tmp_path / "e.json")]) == 0
    assert main(["audit", *common, "--device", "cpu", "--json", str(tmp_path / "a.json")]) == 0
    e, a = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ea")
    assert e["config"]["recipe"].startswith("recipe: trl sft ")
    assert "defaults: trl sft" in e["config"]["recipe"]
    assert e["config"]["recipe"] == a["config"]["recipe"]
    assert {k: v["peak_bytes"] for k, v in e["phases"].items()} == {
        k: v["peak_bytes"] for k, v in a["phases"].items()
    }
    assert e["totals"]["saved_bytes"] == a["totals"]["saved_bytes"]


def test_the_recipe_is_the_first_line(capsys) -> None:
    assert main(["estimate", "--model", "tiny-llama", "--target", "cpu", "--steps", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("recipe: vramguard's loop") and "defaults: vramguard's" in first


@pytest.mark.parametrize("flags", [["--fit", "1GiB"], ["--world-size", "2", "--sharding", "fsdp2"]])
def test_what_the_trainer_on_meta_does_not_run_is_one_line(capsys, flags: list[str]) -> None:
    assert main(["estimate", "--model", "tiny-llama", "--trainer", "sft", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trainer loop" in err[0]


def test_trls_spellings_are_the_same_flags() -> None:
    """--max-length, --per-device-train-batch-size, --lora-r, --optim (TRL's names), --activation-checkpointing."""
    import argparse

    from vramguard.cli import estimate
    from vramguard.cli.options import qlora_config

    parser = argparse.ArgumentParser()
    estimate.register(parser.add_subparsers())
    trl = parser.parse_args(
        ["estimate", "--model", "tiny-llama", "--max-length", "64", "--per-device-train-batch-size", "3",
         "--lora-r", "4", "--optim", "adamw_torch_fused", "--activation-checkpointing"]
    )
    ours = parser.parse_args(
        ["estimate", "--model", "tiny-llama", "--seq-len", "64", "--batch", "3", "--lora-rank", "4",
         "--optimizer", "adamw-fused", "--gradient-checkpointing"]
    )
    assert qlora_config(trl, device="cpu")[0] == qlora_config(ours, device="cpu")[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["estimate", "--optim", "sgd"])


FIXTURES = Path(__file__).parent.parent / "fixtures" / "configs"


@pytest.mark.parametrize(
    ("name", "target"),
    [("axolotl-llama-3-qlora.yml", "cuda"), ("llamafactory-llama3-qlora-sft-otfq.yaml", "cpu")],
)
def test_axolotl_and_llama_factory_configs_estimate_with_a_per_key_account(
    tmp_path: Path, capsys, name: str, target: str
) -> None:
    path = tmp_path / name
    path.write_text((FIXTURES / name).read_text() + "made_up_key: 3\n")
    argv = ["estimate", "--config", str(path), "--model", "tiny-llama", "--seq-len", "128", "--target", target]
    assert main([*argv, "--steps", "1"]) in (0, 1)
    out = capsys.readouterr().out
    assert f"config {name}: priced: " in out and f"config {name}: changes no byte: " in out
    assert "own code is not run" in out  # the framework's patches and trainer subclass: said
    assert "made_up_key" in out and "Traceback" not in out
