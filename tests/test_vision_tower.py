"""The vision tower's choices (issue 45 item 3): kept unquantized (BitsAndBytesConfig's llm_int8_skip_modules),
LoRA on the language model only (PEFT's exclude_modules), the tower's checkpointing, and Qwen's min/max pixels.
Each is built by transformers / bitsandbytes / PEFT themselves, its saved bytes equal the independent hook count
(tests/saved_count.py), and the meta estimate equals the CPU audit to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from saved_count import independent_saved_bytes
from test_vision import _ledger

from vramguard.errors import UsageError
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.vision import (
    build_vision_qlora,
    family_of,
    image_rows,
    load_vision_config,
)

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"


def _config(name: str, seq: int = 128, **kw: object) -> QLoRAConfig:
    return QLoRAConfig(model=str(VLM / f"tiny-{name}.json"), seq_len=seq, batch=1, **kw)  # type: ignore[arg-type]


def _per_stack(q: object) -> dict[str, dict[str, int]]:
    """4-bit linear layers and LoRA layers of each stack of a built model."""
    out: dict[str, dict[str, int]] = {}
    for name, module in q.q.model.named_modules():  # type: ignore[attr-defined]
        c = out.setdefault(q.family.stack_of(name), {"4bit": 0, "plain": 0, "lora": 0})  # type: ignore[attr-defined]
        if hasattr(module, "lora_A"):
            c["lora"] += 1
        elif type(module).__name__ == "Linear4bit":
            c["4bit"] += 1
        elif isinstance(module, torch.nn.Linear) and ".lora_" not in name and not name.endswith("lm_head"):
            c["plain"] += 1
    return out


def _saved(model: torch.nn.Module, batch: dict) -> int:  # type: ignore[type-arg]
    """What the ledger saw kept by one forward, loss and backward of ``model`` (test_vision's step)."""
    return _ledger(model, batch).saved_bytes  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "choice"),
    [
        ("qwen2.5-vl", {"vision_tower": "unquantized"}),
        ("qwen2.5-vl", {"lora_scope": "language-model"}),
        ("qwen2.5-vl", {"train_projector": True, "lora_scope": "language-model"}),
        pytest.param("llava", {"train_projector": True}, marks=pytest.mark.slow),
        pytest.param("llava", {"vision_tower": "unquantized"}, marks=pytest.mark.slow),
        pytest.param("llava", {"lora_scope": "language-model"}, marks=pytest.mark.slow),
        pytest.param("qwen3-vl", {"vision_tower": "unquantized"}, marks=pytest.mark.slow),
        pytest.param("qwen3-vl", {"lora_scope": "language-model"}, marks=pytest.mark.slow),
    ],
)
def test_choice_is_built_and_its_saved_bytes_equal_the_independent_count(name: str, choice: dict) -> None:  # type: ignore[type-arg]
    """The tower unquantized: no 4-bit layer in it (transformers matched the family's qualified name), LoRA still
    on it; LoRA on the language model only: no LoRA in the tower or projector, the language model's as before; the
    projector trained whole: PEFT's modules_to_save copy of it, unquantized, trained.
    The ledger equals the independent count of the same step."""
    size = (256, 256) if name == "qwen3-vl" else (56, 56)
    q = build_vision_qlora(_config(name, seq=640 if name == "llava" else 128, **choice), size)
    stacks = _per_stack(q)
    if "vision_tower" in choice:
        assert stacks["vision tower"]["4bit"] == 0 and stacks["vision tower"]["lora"] > 0, stacks
    elif "train_projector" in choice:  # the projector trained whole: unquantized, no LoRA, its parameters trained
        assert stacks["projector"]["4bit"] == stacks["projector"]["lora"] == 0 and stacks["projector"]["plain"] > 0
        trained = [n for n, p in q.q.model.named_parameters() if p.requires_grad and q.family.stack_of(n) == "projector"]
        assert trained and all("modules_to_save" in n for n in trained), trained
    else:
        assert stacks["vision tower"]["lora"] == stacks["projector"]["lora"] == 0, stacks
        assert stacks["vision tower"]["4bit"] > 0, stacks
    assert stacks["language model"]["lora"] > 0 and stacks["language model"]["4bit"] > 0, stacks
    config, _ = load_vision_config(VLM / f"tiny-{name}.json")
    rows = image_rows(q.family, config, 512, size, 640 if name == "llava" else 128)
    independent = independent_saved_bytes(q.q.model, rows.inputs)
    assert _saved(q.q.model, rows.inputs) == independent
    assert any(n.startswith("vision tower choices") for n in q.q.notes)


def _figures(step: object) -> dict:  # type: ignore[type-arg]
    d = step.to_dict()  # type: ignore[attr-defined]
    del d["seconds"]
    for s in d["steps"]:
        del s["loss"]
    return d


CHOICES = [
    {"vision_tower": "unquantized"},
    {"lora_scope": "language-model"},
    {"lora_scope": "language-model+projector"},
    {"gradient_checkpointing": True, "tower_checkpointing": False},
    {"train_projector": True, "lora_scope": "language-model"},
]
IDS = ["unquantized", "lm-only", "lm+projector", "tower-not-checkpointed", "projector-trained"]


@pytest.mark.parametrize("choice", CHOICES, ids=IDS)
def test_meta_estimate_equals_the_cpu_audit_with_each_choice(choice: dict) -> None:  # type: ignore[type-arg]
    """Tiny Qwen2.5-VL: the meta step (transformers' quantizer with the same skip list, PEFT with the same
    exclude_modules, the tower's flags cleared the same way) gives the CPU audit's phase peaks, saved bytes per
    stack and retained bytes, to the byte; and each choice changes what the default recipe gives."""
    from vramguard.estimate.vision import audit_vision_step, estimate_vision_step

    base = {"gradient_checkpointing": True} if "tower_checkpointing" in choice else {}
    audit = audit_vision_step(_config("qwen2.5-vl", **choice), (56, 56))
    assert _figures(estimate_vision_step(_config("qwen2.5-vl", **choice), (56, 56), target="cpu")) == _figures(audit)
    default = estimate_vision_step(_config("qwen2.5-vl", **base), (56, 56), target="cpu")
    assert _figures(audit) != _figures(default)
    if choice.get("lora_scope") == "language-model" and "train_projector" not in choice:
        assert audit.by_stack["vision tower"] == audit.by_stack["projector"] == 0
        assert default.by_stack["vision tower"] > 0
    if "tower_checkpointing" in choice:  # the tower keeps its activations, the language model stays checkpointed
        assert audit.by_stack["vision tower"] > default.by_stack["vision tower"]
        assert audit.by_stack["language model"] == default.by_stack["language model"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llava", "qwen3-vl"])
@pytest.mark.parametrize("choice", CHOICES, ids=IDS)
def test_meta_estimate_equals_the_cpu_audit_on_other_families(name: str, choice: dict) -> None:  # type: ignore[type-arg]
    from vramguard.estimate.vision import audit_vision_step, estimate_vision_step

    size = (256, 256) if name == "qwen3-vl" else (56, 56)
    config = _config(name, seq=640 if name == "llava" else 320, **choice)
    assert _figures(estimate_vision_step(config, size, target="cpu")) == _figures(audit_vision_step(config, size))


def test_a_bare_visual_skip_matches_nothing_in_transformers_5() -> None:
    """Older Qwen-VL recipes write llm_int8_skip_modules=["visual"]: transformers 5 matches a skip name from the
    start of the qualified name (model.visual...), so the tower stays 4-bit, and the list, replacing the
    default skips, makes lm_head 4-bit too. What really happens is built, and the note says so."""
    from vramguard.estimate.vision import build_vision_meta

    built, _ = build_vision_meta(_config("qwen2.5-vl", llm_int8_skip_modules="visual"), (56, 56))
    stacks = _per_stack(built)
    assert stacks["vision tower"]["plain"] == 0 and stacks["vision tower"]["4bit"] > 0
    head = built.q.model.get_base_model().lm_head
    assert type(head).__name__ == "Linear4bit"
    note = next(n for n in built.q.notes if n.startswith("vision tower choices"))
    assert "matched no layer: visual" in note and "lm_head 4-bit" in note


def test_the_family_paths_are_the_models_and_the_exclusion_keeps_the_merger() -> None:
    """Qwen's merger sits inside model.visual: language-model+projector leaves it LoRA; LLaVA's projector is
    outside the tower."""
    import re

    from vramguard.workload.vision import tower_choices

    qwen = tower_choices(_config("qwen2.5-vl", lora_scope="language-model+projector"), family_of("qwen2_5_vl"))
    assert qwen.exclude_modules is not None
    assert re.fullmatch(qwen.exclude_modules, "model.visual.blocks.0.attn.qkv")
    assert not re.fullmatch(qwen.exclude_modules, "model.visual.merger.mlp.0")
    llava = tower_choices(_config("llava", lora_scope="language-model"), family_of("llava"))
    assert re.fullmatch(llava.exclude_modules or "", "model.multi_modal_projector.linear_1")
    assert not re.fullmatch(llava.exclude_modules or "", "model.language_model.layers.0.self_attn.q_proj")
    unq = tower_choices(_config("llava", vision_tower="unquantized"), family_of("llava"))
    assert unq.skip_modules == ("lm_head", "model.vision_tower")


def test_mllamas_tower_cannot_be_checkpointed_and_the_note_says_so() -> None:
    """Mllama's vision encoder layers are no GradientCheckpointingLayer and its encoder loop ignores its flag:
    gradient_checkpointing_enable leaves the tower's activations all kept."""
    from vramguard.estimate.vision import build_vision_meta

    config = _config("mllama", seq=640, gradient_checkpointing=True, lora_scope="language-model+projector")
    built, _ = build_vision_meta(config, (56, 56))
    note = next(n for n in built.q.notes if n.startswith("vision tower choices"))
    tower = note.split("vision tower: ")[1].split(";")[0]
    assert "no checkpointing layer" in tower


def test_max_pixels_bounds_qwens_image_tokens() -> None:
    """Qwen2-VL's processor with max_pixels 112*112: a 448x448 image is resized to 112x112, 16 tokens (256 at
    the default max_pixels); a family without pixel bounds refuses them in one line."""
    config, _ = load_vision_config(VLM / "tiny-qwen2-vl.json")
    family = family_of("qwen2_vl")
    assert image_rows(family, config, 512, (448, 448), 512).image_tokens == 256
    bounded = image_rows(family, config, 512, (448, 448), 512, pixels={"max_pixels": 112 * 112})
    assert bounded.image_tokens == 16 and bounded.inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    from vramguard.workload.vision import vision_setup

    with pytest.raises(UsageError, match="min-pixels / max-pixels bound Qwen's processors"):
        vision_setup(_config("llava", seq=640, image_size="56x56", max_pixels=12544))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vision-tower", "fp8"], "invalid choice"),
        (["--lora-scope", "tower"], "invalid choice"),
        (["--min-pixels", "900", "--max-pixels", "800"], "min-pixels 900 is more than max-pixels 800"),
        (["--llm-int8-skip-modules", "a b"], "llm-int8-skip-modules must be"),
    ],
)
def test_bad_tower_options_are_one_line_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(VLM / "tiny-qwen2-vl.json"), "--batch", "1", "--seq-len", "64", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err


def test_a_text_model_with_a_tower_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from vramguard.cli.app import main

    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "32", "--trainer", "loop", "--lora-scope", "language-model"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "lora-scope: options of a vision-language model" in err and "\n" not in err


def test_documents_record_the_choices_only_where_set() -> None:
    """A run without tower options writes the document it wrote before (byte-identical outputs)."""
    d = QLoRAConfig(image_size="56x56").to_dict()
    assert not {"vision_tower", "llm_int8_skip_modules", "lora_scope", "tower_checkpointing"} & set(d)
    d = QLoRAConfig(image_size="56x56", lora_scope="language-model", max_pixels=12544).to_dict()
    assert d["lora_scope"] == "language-model" and d["max_pixels"] == 12544 and "vision_tower" not in d


# -- a trl sft YAML for a vision-language model ---------------------------------------------------------------

LM_ONLY = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def test_a_trl_vlm_config_with_a_language_model_regex_is_priced(tmp_path: Path) -> None:
    """TRL's VLM recipe as a trl sft YAML (max_length null as TRL's docs advise for VLMs, use_peft, load_in_4bit,
    lora_target_modules a string, which PEFT full-matches as a regex: the language model's projections only;
    remove_unused_columns / dataset_kwargs of the older VLM scripts): priced, with no LoRA in the tower and
    projector, the two host-side keys changing no byte."""
    from vramguard.cli.app import main

    config = tmp_path / "vlm.yaml"
    config.write_text(
        f"model_name_or_path: {VLM / 'tiny-qwen2.5-vl.json'}\nmax_length: null\nper_device_train_batch_size: 1\n"
        f"use_peft: true\nload_in_4bit: true\nlora_target_modules: '{LM_ONLY}'\nremove_unused_columns: false\n"
        "dataset_kwargs: {skip_prepare_dataset: true}\n"
    )
    doc = tmp_path / "estimate.json"
    argv = ["estimate", "--config", str(config), "--image-size", "56x56", "--seq-len", "128", "--target", "cpu"]
    assert main([*argv, "--quiet", "--json", str(doc)]) == 0
    assert "(SFTTrainer's own step)" in json.loads(doc.read_text())["config"]["recipe"]  # as trl sft runs it
    notes = json.loads(doc.read_text())["verdict"]["notes"]
    assert any("priced:" in n and "lora_target_modules=" in n for n in notes), notes
    assert any("changes no byte: remove_unused_columns" in n and "dataset_kwargs (dataset preparation" in n for n in notes)
    tower = next(n for n in notes if n.startswith("vision tower choices"))
    assert f"target_modules {LM_ONLY!r}" in tower
    stacks = dict(part.split(": weights ", 1) for part in tower.split("): ", 1)[1].split("; "))
    assert "LoRA on 0, 0 trained params" in stacks["vision tower"]
    assert "LoRA on 0, 0 trained params" in stacks["projector"]
    assert "LoRA on 14," in stacks["language model"]


def test_a_bad_target_regex_is_one_line() -> None:
    with pytest.raises(UsageError, match="is no regular expression") as err:
        QLoRAConfig(target_modules=".*(q_proj").validate()
    assert "\n" not in str(err.value)


def test_trls_smolvlm_example_targets_reach_the_siglip_tower() -> None:
    """TRL's sft_vlm.py example for SmolVLM names down_proj, o_proj, k_proj, q_proj, gate_proj, up_proj, v_proj:
    the SigLIP tower of Idefics3 / SmolVLM has q_proj, k_proj, v_proj too, so PEFT puts LoRA there as well; the
    note says how many layers of each stack took LoRA."""
    from vramguard.estimate.vision import build_vision_meta

    targets = "down_proj,o_proj,k_proj,q_proj,gate_proj,up_proj,v_proj"
    built, _ = build_vision_meta(_config("idefics3", seq=640, target_modules=targets), (56, 56))
    stacks = _per_stack(built)
    assert stacks["vision tower"]["lora"] == 6 and stacks["projector"]["lora"] == 0, stacks  # 2 layers x q, k, v
    note = next(n for n in built.q.notes if n.startswith("vision tower choices"))
    assert f"target_modules '{targets}'" in note and "vision tower: weights" in note


def test_audit_and_estimate_commands_take_the_choices_and_agree(tmp_path: Path) -> None:
    """``vramguard audit`` and ``vramguard estimate --trainer loop --target cpu`` with the tower unquantized and LoRA
    on the language model and projector: both record the choices in the document, name them in the same note, and
    give the same totals and phase peaks."""
    from vramguard.cli.app import main

    base = ["--model", str(VLM / "tiny-qwen2.5-vl.json"), "--image-size", "56x56", "--seq-len", "96", "--batch", "1"]
    base += ["--vision-tower", "unquantized", "--lora-scope", "language-model+projector", "--steps", "2", "--quiet"]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    assert main(["audit", *base, "--device", "cpu", "--json", str(audit)]) == 0
    assert main(["estimate", *base, "--trainer", "loop", "--target", "cpu", "--json", str(estimate)]) == 0
    a, e = json.loads(audit.read_text()), json.loads(estimate.read_text())
    for doc in (a, e):
        assert doc["config"]["vision_tower"] == "unquantized"
        assert doc["config"]["lora_scope"] == "language-model+projector"
    assert a["totals"] == e["totals"]
    assert {k: v["peak_bytes"] for k, v in a["phases"].items()} == {k: v["peak_bytes"] for k, v in e["phases"].items()}
    notes = [[n for n in d["verdict"]["notes"] if n.startswith("vision tower choices")] for d in (a, e)]
    assert notes[0] == notes[1] and "0 4-bit linear, 10 unquantized (float32)" in notes[0][0]


def _init_yaml(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "init.yaml"
    config.write_text(
        f"model_name_or_path: {VLM / 'tiny-qwen2.5-vl.json'}\nmax_length: 128\nper_device_train_batch_size: 1\n"
        "use_peft: true\nlora_target_modules: all-linear\ndtype: bfloat16\n" + extra + "model_init_kwargs:\n"
        "  quantization_config: {load_in_4bit: true, llm_int8_skip_modules: [model.visual, lm_head]}\n"
        "  device_map: auto\n"
    )
    return config


def test_a_trl_yaml_keeps_the_tower_unquantized_through_model_init_kwargs(tmp_path: Path) -> None:
    """A trl sft YAML cannot pass llm_int8_skip_modules through ModelConfig: it gives SFTConfig's
    model_init_kwargs a quantization_config (without load_in_4bit, which SFTTrainer refuses beside it). It is read
    by transformers' AutoQuantizationConfig and priced: method qlora, the tower unquantized; the other keys of
    model_init_kwargs are named NOT PRICED."""
    from vramguard.workload.run_config import load_run_config

    run = load_run_config(_init_yaml(tmp_path))
    assert run.values["method"] == "qlora" and run.values["llm_int8_skip_modules"] == "model.visual,lm_head"
    priced = {r.key for r in run.named("priced")}
    assert "model_init_kwargs.quantization_config" in priced
    # BitsAndBytesConfig's own default compute dtype is float32 (TRL's load_in_4bit takes dtype's): named
    assert sorted(r.key for r in run.named("not-priced")) == [
        "model_init_kwargs.device_map",
        "model_init_kwargs.quantization_config.bnb_4bit_compute_dtype",
    ]
    q = build_vision_qlora(run.config(image_size="56x56"), (56, 56))
    stacks = _per_stack(q)
    assert stacks["vision tower"]["4bit"] == 0 and stacks["vision tower"]["plain"] > 0, stacks
    assert stacks["language model"]["4bit"] > 0


def test_a_quantization_config_computing_in_the_models_dtype_is_priced_whole(tmp_path: Path) -> None:
    from vramguard.workload.run_config import load_run_config

    config = _init_yaml(tmp_path)
    config.write_text(config.read_text().replace("llm_int8_skip_modules:", "bnb_4bit_compute_dtype: bfloat16, llm_int8_skip_modules:"))
    run = load_run_config(config)
    assert [r.key for r in run.named("not-priced")] == ["model_init_kwargs.device_map"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("[model.visual, lm_head]", "[1, 2]"))
    with pytest.raises(UsageError, match="llm_int8_skip_modules must be a list of names"):
        load_run_config(bad)


def test_quantization_config_twice_is_refused_as_sfttrainer_refuses_it(tmp_path: Path) -> None:
    from vramguard.workload.run_config import load_run_config

    with pytest.raises(UsageError, match="both by load_in_4bit and in model_init_kwargs") as err:
        load_run_config(_init_yaml(tmp_path, "load_in_4bit: true\n"))
    assert "\n" not in str(err.value)


def test_a_trained_projector_takes_no_lora() -> None:
    with pytest.raises(UsageError, match="takes no LoRA"):
        from vramguard.workload.vision import vision_setup

        vision_setup(_config("qwen2.5-vl", image_size="56x56", train_projector=True, lora_scope="language-model+projector"))
