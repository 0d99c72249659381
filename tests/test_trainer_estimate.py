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
    audited = run_trainer_audit(config, "sft", tmp_path, steps=2)
    estimated = run_trainer_estimate(config, "sft", steps=2, target="cpu")
    assert figures(estimated) == figures(audited)
    assert estimated.device == "meta" and estimated.estimate is not None


def test_the_trainer_step_on_meta_equals_its_audit(tmp_path: Path) -> None:
    config = QLoRAConfig(model="tiny-llama", device="cpu", gradient_checkpointing=True)
    audited = run_trainer_audit(config, "trainer", tmp_path, steps=2)
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
    assert [s["loss"] for s in e["steps"]] == [None, None]  # meta holds no values (not .item()'s answer)
    assert e["config"]["model"] == a["config"]["model"] == "tiny-llama"  # as given


def test_fp16_on_the_cpu_target_is_refused_through_the_trainer_too(capsys) -> None:
    """As the loop's estimate and accelerate for Trainer refuse it: one line, exit 2, before anything is built."""
    argv = ["estimate", "--trainer", "sft", "--fp16", "--target", "cpu", "--seq-len", "16", "--batch", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp16 mixed precision runs on a GPU only" in err


@pytest.mark.parametrize(
    ("flags", "recipe", "defaults"),
    [
        ([], "recipe: trl sft ", "defaults: trl sft "),  # estimate's default: what trl sft runs
        (["--trainer", "loop"], "recipe: vramguard's loop (", "defaults: vramguard loop's"),
        (["--method", "lora"], "recipe: vramguard's loop (", "defaults: trl sft "),
        (["--sharding", "fsdp2"], "recipe: vramguard's loop (", "defaults: trl sft "),
    ],
)
def test_the_recipe_is_the_first_line_of_the_detail(capsys, flags: list[str], recipe: str, defaults: str) -> None:
    """The recipe and whose defaults filled the flags not given; where SFTTrainer's step does not run on meta
    (LoRA on a bf16 base, sharded ranks), the loop prices the same run (TRL's defaults) and the line says why.
    On one device the answer comes first (issue 47), the recipe right after it; a sharded run's has no answer line
    yet."""
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "16", "--batch", "1", "--target", "cpu"]
    assert main([*argv, "--steps", "1", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    answered = lines[0].endswith("expected of the host's memory")
    assert answered != ("--sharding" in flags), lines[0]
    first = lines[1] if answered else lines[0]
    assert first.startswith(recipe) and defaults in first, first
    why = {"--method": "method lora", "--sharding": "--world-size / --sharding"}.get(flags[0] if flags else "")
    if why:
        assert f"(ran instead of sft's own step, which does not run {why} yet)" in first


def _estimate_json(tmp_path: Path, name: str, argv: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["estimate", *argv, "--target", "cpu", "--steps", "1", "--quiet", "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())


def test_flags_a_trl_yaml_and_the_same_settings_as_flags_give_the_same_bytes(tmp_path: Path) -> None:
    """estimate with flags alone prices what trl sft runs with them, TRL's defaults filling the rest: the bytes
    of the TRL YAML with the same keys, and of every default TRL fills given as a flag (vramguard's loop, with
    its own defaults, gives others)."""
    yaml = tmp_path / "sft.yaml"
    yaml.write_text("max_length: 48\nper_device_train_batch_size: 1\nuse_peft: true\nload_in_4bit: true\n")
    shape = ["--model", "tiny-llama", "--seq-len", "48", "--batch", "1"]
    trl_defaults_as_flags = [
        *("--lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --target-modules peft-default --no-double-quant".split()),
        *("--compute-dtype fp32 --bf16 --activation-checkpointing --optim adamw_torch_fused".split()),
        *("--gradient-accumulation-steps 1 --attn-implementation sdpa --trainer sft".split()),
    ]
    runs = {
        "flags": _estimate_json(tmp_path, "flags", shape),
        "yaml": _estimate_json(tmp_path, "yaml", ["--config", str(yaml), "--model", "tiny-llama"]),
        "settings": _estimate_json(tmp_path, "settings", [*shape, *trl_defaults_as_flags]),
    }

    def bytes_of(report: dict) -> tuple:
        return (
            report["estimate"]["total_bytes"],
            report["totals"]["saved_bytes"],
            {k: v["peak_bytes"] for k, v in report["phases"].items()},
            {k: v for k, v in report["config"].items() if k != "recipe"},
        )

    assert bytes_of(runs["flags"]) == bytes_of(runs["yaml"]) == bytes_of(runs["settings"])
    assert all(r["config"]["recipe"].startswith("recipe: trl sft ") for r in runs.values())
    loop = _estimate_json(tmp_path, "loop", [*shape, "--trainer", "loop"])
    assert loop["estimate"]["total_bytes"] != runs["flags"]["estimate"]["total_bytes"]


@pytest.mark.parametrize("flags", [["--world-size", "2", "--sharding", "fsdp2"]])  # (--fit runs: test_fit_recommender)
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


def test_flags_alone_take_trl_sfts_defaults_read_from_its_dataclasses() -> None:
    """No run: the config of flags alone is TRL's SFTConfig/ModelConfig defaults (with use_peft and load_in_4bit)
    for every flag not given, the flags on top; --no-bf16 turns TRL's autocast off; --trainer loop keeps the
    loop's defaults."""
    import argparse
    import dataclasses

    from trl import ModelConfig, SFTConfig

    from vramguard.cli import estimate
    from vramguard.cli.options import qlora_config

    parser = argparse.ArgumentParser()
    estimate.register(parser.add_subparsers())

    def config(*argv: str) -> QLoRAConfig:
        return qlora_config(parser.parse_args(["estimate", *argv]), device="cpu")[0]

    sft, model = SFTConfig("unused", use_cpu=True), ModelConfig()
    trl = config("--lora-alpha", "7")
    assert (trl.batch, trl.seq_len, trl.gradient_checkpointing) == (
        sft.per_device_train_batch_size,
        sft.max_length,
        sft.gradient_checkpointing,
    )
    assert (trl.lora_rank, trl.lora_dropout, trl.double_quant) == (
        model.lora_r,
        model.lora_dropout,
        model.use_bnb_nested_quant,
    )
    assert trl.mixed_precision == ("bf16" if sft.bf16 else "no") and trl.lora_alpha == 7 and trl.method == "qlora"
    assert config("--no-bf16").mixed_precision == "no"
    assert config("--trainer", "loop") == dataclasses.replace(QLoRAConfig(), device="cpu").resolved()


FIXTURES = Path(__file__).parent.parent / "fixtures" / "configs"


@pytest.mark.parametrize(
    ("name", "target"),
    [("axolotl-llama-3-qlora.yml", "cuda"), ("llamafactory-llama3-qlora-sft-otfq.yaml", "cpu")],
)
def test_axolotl_and_llama_factory_configs_estimate_with_a_per_key_account(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, name: str, target: str
) -> None:
    """The notes wrap at the console's width (80 columns where COLUMNS says so, as under some xdist runs and
    CI runners: "own code is not\nrun"): read with the wraps undone, at a width fixed here."""
    monkeypatch.setenv("COLUMNS", "80")
    path = tmp_path / name
    path.write_text((FIXTURES / name).read_text() + "made_up_key: 3\n")
    argv = ["estimate", "--config", str(path), "--model", "tiny-llama", "--seq-len", "128", "--target", target]
    assert main([*argv, "--steps", "1"]) in (0, 1)
    out = " ".join(capsys.readouterr().out.split())
    assert f"config {name}: priced: " in out and f"config {name}: changes no byte: " in out
    assert "own code is not run" in out  # the framework's patches and trainer subclass: said
    assert "made_up_key" in out and "Traceback" not in out


@pytest.mark.parametrize("command", [["estimate", "--device", "cpu"], ["audit", "--trainer", "sft", "--steps", "1"]])
def test_a_config_trls_trainer_refuses_is_one_line(tmp_path: Path, capsys, command: list[str]) -> None:
    """padding_free without packing at a max_length: SFTTrainer's own check refuses it, as the user's `trl sft`
    run would be refused; one line naming TRL's way out, where it was an internal error."""
    yaml = tmp_path / "pf.yaml"
    yaml.write_text(
        "per_device_train_batch_size: 2\nmax_length: 64\nuse_peft: true\nload_in_4bit: true\npadding_free: true\n"
    )
    assert main([*command, "--config", str(yaml), "--model", "tiny-llama"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("vramguard:")]
    assert len(errors) == 1 and "TRL's SFTTrainer refuses this config" in errors[0] and "packing" in errors[0], errors


@pytest.mark.parametrize("value", ["unsloth", "offload"])
def test_axolotls_own_checkpointing_is_checkpointing_with_its_offload_not_priced(value: str) -> None:
    """Axolotl's gradient_checkpointing: unsloth / offload checkpoint too (they were refused as "must be true or
    false" under a key the user never wrote); the host offload of its own is named NOT PRICED."""
    from vramguard.workload.framework_configs import AXOLOTL, translate

    trl, names, other = translate(AXOLOTL, {"gradient_checkpointing": value, "adapter": "qlora"})
    assert trl["gradient_checkpointing"] is True and names["gradient_checkpointing"] == "gradient_checkpointing"
    assert [(k, v) for k, v, why in other if "not priced" not in why and why != "no-byte"] == [
        ("gradient_checkpointing", value)
    ]
