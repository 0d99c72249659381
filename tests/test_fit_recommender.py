"""``--fit`` as a recommender (issue 47, item 3): the changes that move the peak, each offered where it applies and
the card and the trainer have it (bf16 autocast and FlashAttention-2 on compute capability 8.0 or newer,
padding-free as the trainer spells it, Liger and offloading where vramguard's loop prices them), pairs where no
single change fits, ranked by what fits, then the cost in step time, then bytes; and the first line names the best
change with its cost. The offers are each technique's own (:attr:`~vramguard.step.technique.Technique.cheaper`,
through the registry)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from vramguard.estimate import techniques
from vramguard.estimate.fit import (
    PAIR_POOL,
    by_cost,
    checkpointing_and_rank,
    cheaper_changes,
    remembered,
    search,
    single_changes,
)
from vramguard.estimate.gpus import gpu_named
from vramguard.step.technique import Place
from vramguard.workload.models import QLoRAConfig

FA2 = "--attn-implementation flash_attention_2"
BF16 = QLoRAConfig(mixed_precision="bf16")


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The changes' estimates run here, not in worker processes: the tests count the calls (a child's would be
    lost with it)."""
    from vramguard.estimate.workers import WORKERS

    monkeypatch.setenv(WORKERS, "1")


def _on(card: str, trainer: str = "loop") -> Place:
    return Place("cuda", gpu_named(card).compute_capability, trainer)


def _offered(config: QLoRAConfig, place: Place) -> list[str]:
    return [flag for flag, _ in single_changes(config, 0, place, "")]


def test_bf16_is_offered_where_the_card_runs_it_and_the_step_has_no_autocast() -> None:
    plain = QLoRAConfig()
    assert "--bf16" in _offered(plain, _on("rtx4090")) and "--bf16" in _offered(plain, Place("cpu"))
    assert "--bf16" not in _offered(plain, _on("t4"))  # Turing, compute capability 7.5: no bf16
    for already in ("bf16", "fp16"):
        assert "--bf16" not in _offered(dataclasses.replace(plain, mixed_precision=already), _on("rtx4090"))
    (changed,) = [c for flag, c in single_changes(plain, 0, _on("a10"), "") if flag == "--bf16"]
    assert changed == dataclasses.replace(plain, mixed_precision="bf16")


def test_flash_attention_2_is_offered_on_ampere_cuda_for_half_precision_attention() -> None:
    assert FA2 in _offered(BF16, _on("rtx4090"))
    assert FA2 in _offered(dataclasses.replace(BF16, attn_implementation="eager"), _on("a10"))
    assert FA2 not in _offered(BF16, _on("t4"))  # no FlashAttention-2 before Ampere
    assert FA2 not in _offered(BF16, Place("cpu"))  # flash-attn is CUDA-only
    assert FA2 not in _offered(QLoRAConfig(), _on("rtx4090"))  # fp32 attention: flash takes fp16/bf16 (--bf16 first)
    assert FA2 not in _offered(dataclasses.replace(BF16, attn_implementation="flash_attention_2"), _on("h100"))
    # a trainer's step prices it on TRL's fp32 compute dtype too (its autocast on meta is the target's)
    assert FA2 in _offered(dataclasses.replace(BF16, compute_dtype="fp32"), _on("rtx4090", "sft"))  # trl's
    assert FA2 in _offered(BF16, _on("rtx4090", "sft"))  # the loop's default compute dtype: bf16


def test_padding_free_is_offered_as_each_trainer_spells_it() -> None:
    loop = dict(single_changes(QLoRAConfig(), 0, _on("h100"), ""))
    sft = dict(single_changes(QLoRAConfig(), 0, _on("h100", "sft"), ""))
    assert loop["--padding-free"] == QLoRAConfig(padding_free=True)
    assert sft["--packing --padding-free"] == QLoRAConfig(padding_free=True, packing=True)  # TRL refuses it unpacked
    assert not any("padding-free" in f for f in _offered(QLoRAConfig(), _on("h100", "trainer")))  # no such collator
    assert not any("padding-free" in f for f in _offered(QLoRAConfig(padding_free=True), _on("h100")))


def test_offloading_and_liger_are_offered_on_cuda_where_the_loop_prices_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramguard.estimate import liger

    monkeypatch.setattr(liger, "missing", lambda: None)  # the liger extra installed (offering runs nothing of it)
    assert {"--offload-activations", "--use-liger-kernel"} <= set(_offered(QLoRAConfig(), _on("rtx4090")))
    for place in (Place("cpu"), _on("rtx4090", "sft"), _on("rtx4090", "trainer")):
        assert not {"--offload-activations", "--use-liger-kernel"} & set(_offered(QLoRAConfig(), place)), place
    monkeypatch.setattr(liger, "missing", lambda: "liger-kernel is not installed")
    assert "--use-liger-kernel" not in _offered(QLoRAConfig(), _on("rtx4090"))


def test_fewer_lora_targets_are_offered_for_all_linear_adapters() -> None:
    flag = "--target-modules peft-default"
    assert dict(single_changes(QLoRAConfig(), 0, _on("t4"), ""))[flag] == QLoRAConfig(target_modules="peft-default")
    assert flag not in _offered(QLoRAConfig(target_modules="q_proj,v_proj"), _on("t4"))
    assert flag not in _offered(QLoRAConfig(method="full"), _on("t4"))  # no adapters


def test_every_technique_offer_comes_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A technique taken off the registry is offered no more: fit.py has no ``if`` of its own for it."""
    config = QLoRAConfig()
    assert "--bf16" in _offered(config, _on("h100"))
    kept = tuple(t for t in techniques.BUILT_IN if t.name != "bf16")
    monkeypatch.setattr(techniques, "BUILT_IN", kept)
    techniques.registered.cache_clear()
    try:
        assert "--bf16" not in _offered(config, _on("h100"))
    finally:
        monkeypatch.undo()
        techniques.registered.cache_clear()


def _saving(config: QLoRAConfig) -> int:
    """A stand-in step: 100 bytes, less what each change saves (this is the search's logic, not pricing)."""
    base = QLoRAConfig(batch=4)
    saved = {"batch": 20, "gradient_checkpointing": 30, "mixed_precision": 25, "padding_free": 5, "lora_rank": 1}
    return 100 - sum(v for k, v in saved.items() if getattr(config, k) != getattr(base, k))


def test_where_no_single_change_fits_pairs_of_the_most_promising_are_tried_within_the_bound() -> None:
    calls: list[QLoRAConfig] = []

    def estimate(config: QLoRAConfig) -> int:
        calls.append(config)
        return _saving(config)

    config = QLoRAConfig(batch=4)
    tried = single_changes(config, 0, _on("h100"), "") + checkpointing_and_rank(config)
    rows = cheaper_changes(config, 49, estimate, place=_on("h100"))
    assert len(calls) <= len(tried) + PAIR_POOL
    fitting = [r for r in rows if r["fits"]]
    assert [r["change"] for r in fitting] == ["--gradient-checkpointing --bf16"], rows  # 100 - 30 - 25 = 45
    assert all(not r["fits"] for r in rows if r["change"].count("--") == 1)
    # with one that fits alone, no pair is tried
    calls.clear()
    rows = cheaper_changes(config, 70, estimate, place=_on("h100"))
    assert len(calls) == len(tried) and any(r["fits"] for r in rows)


def test_a_config_measured_once_is_not_run_again() -> None:
    calls: list[QLoRAConfig] = []

    def estimate(config: QLoRAConfig) -> int:
        calls.append(config)
        return 10 * config.batch

    once = remembered(estimate)
    config = QLoRAConfig(batch=4, gradient_accumulation_steps=2)
    fit = search(config, 25, once, known={4: 40})
    assert fit.largest == 2
    cheaper_changes(config, 25, once, largest_batch=fit.largest, place=_on("h100"))
    keys = [dataclasses.replace(c, model="") for c in calls]
    assert len(keys) == len(set(map(repr, keys)))


def test_ranked_by_fits_then_step_time_and_the_first_line_names_the_cost() -> None:
    from vramguard.cli.estimate import for_reading
    from vramguard.view.report import answer

    rows = [
        {"change": "--offload-activations", "total_bytes": 10, "fits": True},
        {"change": "--gradient-checkpointing", "total_bytes": 20, "fits": True},
        {"change": "--batch 1 --gradient-accumulation-steps 8", "total_bytes": 30, "fits": True},
        {"change": "--bf16", "total_bytes": 40, "fits": True},
        {"change": "--lora-rank 4", "total_bytes": 5, "fits": False},
    ]
    ranked = [r["change"] for r in by_cost(rows)]
    assert ranked == [
        "--bf16",  # none (faster)
        "--batch 1 --gradient-accumulation-steps 8",  # smaller matmuls
        "--gradient-checkpointing",  # recompute
        "--offload-activations",  # PCIe traffic
        "--lora-rank 4",  # does not fit
    ]
    fit = for_reading({"dim": "batch", "largest": 0, "changes": rows})
    from types import SimpleNamespace

    report = SimpleNamespace(estimate=SimpleNamespace(total_bytes=100, high_total_bytes=100, target="cuda"))
    line = answer(report, 50, fit=fit)  # type: ignore[arg-type]
    assert line.endswith("try --bf16 (40 B, costs none (faster)) or --batch 1 --gradient-accumulation-steps 8 "
                         "(30 B, costs smaller matmuls)"), line


@pytest.mark.slow  # five meta runs of SFTTrainer's step (about 10 s of CPU)
def test_fit_runs_trl_sfts_own_step_and_its_first_line_names_the_change_and_its_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fit`` with flags alone (trl sft's defaults) prices SFTTrainer's own step (it fell back to vramguard's
    loop, which is not the run the user launches); its verdict names the best change and its cost, and the
    changes it cannot price there are named."""
    from vramguard.cli import main

    out = tmp_path / "fit.json"
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "64", "--batch", "4", "--steps", "1", "--gpu", "rtx4090"]
    assert main([*argv, "--fit", "820MiB", "--json", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    assert report["config"]["recipe"].startswith("recipe: trl sft ") and "ran instead" not in report["config"]["recipe"]
    fit = report["estimate"]["fit"]
    assert fit["trainer"] == "sft" and fit["limit"] == 2**21 // 64
    assert "--offload-activations" in fit["not_priced"]
    best = by_cost(fit["changes"])[0]
    assert best["fits"], fit["changes"]
    assert lines[0].startswith("does not fit in 820.00 MiB (GeForce RTX 4090): ")
    assert f"; try {best['change']} (" in lines[0] and ", costs " in lines[0]
    assert any(line.startswith("  not tried: --offload-activations") for line in lines)


ROOT = Path(__file__).resolve().parents[1]
SFT_8B_4K = ROOT / "fixtures" / "configs" / "sft-llama-3.1-8b-4k.yaml"


@pytest.mark.slow  # issue 47's acceptance: full-size meta runs of SFTTrainer's step (minutes of CPU)
@pytest.mark.parametrize("size", ["24GiB", "18GiB"])
def test_the_8b_4k_trl_sft_config_on_an_rtx4090(
    size: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fit 24GiB --gpu rtx4090`` on the 8B 4k config, priced through trl sft's own step under CUDA's bf16
    autocast: it fits (19.50 GiB expected, 20.97 GiB at the high end; batch 3 fits too, 23.68 GiB, batch 4 does
    not), so nothing needs changing and the first line says so; at 18 GiB it does not, and the first line names a
    change that fits with its cost."""
    from vramguard.cli import main

    out = tmp_path / "fit.json"
    argv = ["estimate", "--config", str(SFT_8B_4K), "--fit", size, "--gpu", "rtx4090", "--json", str(out)]
    code = main(argv)
    first = capsys.readouterr().out.splitlines()[0]
    fit = json.loads(out.read_text())["estimate"]["fit"]
    assert fit["trainer"] == "sft"
    if size == "24GiB":
        assert code == 0 and first.startswith("fits in 24.00 GiB (GeForce RTX 4090): ") and fit["largest"] == 3
        assert fit["changes"] == []
    else:
        assert code == 1 and first.startswith("does not fit in 18.00 GiB (GeForce RTX 4090): ")
        best = by_cost(fit["changes"])[0]
        assert best["fits"] and f"; try {best['change']} (" in first and ", costs " in first, first


def test_the_padding_free_changes_are_flags_estimate_takes() -> None:
    """What ``--fit`` suggests can be given back to ``estimate`` (and to ``trl sft``, whose parser takes the same
    spellings)."""
    import argparse

    from vramguard.cli import estimate
    from vramguard.cli.options import qlora_config

    parser = argparse.ArgumentParser()
    estimate.register(parser.add_subparsers())
    args = parser.parse_args(["estimate", "--model", "tiny-llama", "--packing", "--padding-free"])
    config, _ = qlora_config(args, device="cpu")
    assert config.packing and config.padding_free
    args = parser.parse_args(["estimate", "--model", "tiny-llama", "--trainer", "loop", "--padding-free"])
    config, _ = qlora_config(args, device="cpu")
    assert config.padding_free and not config.packing


VLM_QWEN25 = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm" / "tiny-qwen2.5-vl.json"


def test_fewer_targets_are_offered_only_where_the_run_takes_them() -> None:
    """PEFT has no default targets for a vision-language model's type (the run would be refused): there the
    fewer targets offered are the language model's alone (``--lora-scope language-model``); a text model type PEFT
    has no defaults for is offered none."""
    vlm = QLoRAConfig(model=str(VLM_QWEN25), target_modules="all-linear", image_size="56x56")
    offered = dict(single_changes(vlm, 0, _on("rtx4090"), ""))
    assert "--target-modules peft-default" not in offered
    assert offered["--lora-scope language-model"].lora_scope == "language-model"
    olmo = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "tiny-olmo2.json"
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    text = QLoRAConfig(model=str(olmo))
    has_defaults = text.resolved().spec.transformers_config().model_type in PEFT_DEFAULTS
    assert ("--target-modules peft-default" in _offered(text, _on("t4"))) is has_defaults


def test_a_change_the_run_refuses_is_named_not_the_whole_answer() -> None:
    """A change whose step is refused (one line) is a row that says why, after every priced one; the other
    changes are still priced and ranked, and no pair is built from it."""
    from vramguard.errors import UsageError

    def estimate(c: QLoRAConfig) -> int:
        if c.gradient_checkpointing:
            raise UsageError("checkpointing refused here")
        return 100 if c.lora_rank < 8 else 200

    rows = cheaper_changes(QLoRAConfig(lora_rank=8), 50, estimate, place=_on("t4"))
    refused = [r for r in rows if "refused" in r]
    assert refused and all(r["change"].startswith("--gradient-checkpointing") for r in refused)
    assert refused[0]["refused"] == "checkpointing refused here" and refused[0]["total_bytes"] is None
    assert rows[-len(refused):] == refused and by_cost(rows)[-len(refused):] == refused
    assert not any("--gradient-checkpointing" in r["change"] and "refused" not in r for r in rows)


def test_a_change_of_two_options_at_one_cost_names_both() -> None:
    from vramguard.estimate.fit import cost_of

    both = cost_of("--lora-rank 8 --optimizer adamw-8bit")
    assert both.word == "no time"
    assert "smaller adapter" in both.detail and "optimizer's state" in both.detail
