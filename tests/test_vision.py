"""Vision-language models (issue 45): shapes from text_config / vision_config, rows made by each family's own
processor, and a real QLoRA step (from_pretrained with BitsAndBytesConfig, PEFT all-linear) whose saved bytes
vramguard's ledger counts as an independent hook-and-ctx count (tests/saved_count.py) does, byte for byte."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from saved_count import independent_saved_bytes, saved_storages

from vramguard.errors import UsageError
from vramguard.measure.ledger import SavedTensorLedger
from vramguard.workload.models import PRESETS_DIR, ModelSpec, QLoRAConfig
from vramguard.workload.vision import (
    STACKS,
    VISION_FAMILIES,
    build_vision_qlora,
    family_of,
    family_processor,
    image_rows,
    image_text_class,
    is_vision_config,
    load_vision_config,
    parse_image_size,
    vision_shape,
)

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
FIXTURES = {p.stem.removeprefix("tiny-"): p for p in sorted(VLM.glob("tiny-*.json"))}
"""One tiny config per family: text hidden 64, 2 layers; vision hidden 64, 2 layers (vocab 512)."""
ROOT = Path(__file__).resolve().parents[1]
# .ci/run runs the mistral3 tests in a second environment with torchvision and sets
# VRAMGUARD_REQUIRE_TORCHVISION=1: there a torchvision that is missing or does not import fails them, never
# skips them or takes the refusal branch (a CI that refused Mistral 3 would still pass)
REQUIRE_TORCHVISION = os.environ.get("VRAMGUARD_REQUIRE_TORCHVISION") == "1"


def _missing(family: object) -> list[str]:
    """The packages ``family``'s processor needs that this install lacks."""
    needs = family.needs  # type: ignore[attr-defined]
    if REQUIRE_TORCHVISION and "torchvision" in needs:
        try:
            importlib.import_module("torchvision")
        except Exception as exc:  # PyPI's torchvision beside the CPU torch: "operator torchvision::nms ..."
            pytest.fail(f"VRAMGUARD_REQUIRE_TORCHVISION=1 but torchvision does not import: {exc}")
    return [p for p in needs if importlib.util.find_spec(p) is None]


def _config(name: str, seq: int = 128, **kw: object) -> QLoRAConfig:
    return QLoRAConfig(model=str(FIXTURES[name]), seq_len=seq, batch=1, **kw)  # type: ignore[arg-type]


# -- config reading -------------------------------------------------------------------------------


def test_every_family_has_a_tiny_config_and_a_processor() -> None:
    """The 14 families of issue 45 and Qwen3-VL-MoE (and Qwen3.5-MoE's processor, shared with Qwen3.5)."""
    types = {json.loads(p.read_text())["model_type"] for p in FIXTURES.values()}
    assert len(types) == 15
    assert types <= set(VISION_FAMILIES)


def test_a_vision_config_resolves_to_its_language_models_shape() -> None:
    """Issue 45: ModelSpec.load refused every vision-language config with "vocab_size must be a positive integer,
    got None" (it read the top level); the shape is text_config's."""
    spec = ModelSpec.load(str(FIXTURES["qwen2-vl"]))
    assert spec.model_type == "qwen2_vl"
    assert (spec.fields["vocab_size"], spec.fields["hidden_size"], spec.fields["num_hidden_layers"]) == (
        512,
        64,
        2,
    )
    assert spec.fields["head_dim"] == 16


@pytest.mark.parametrize("name", ["qwen2-vl", "gemma3", "mllama", "internvl"])
def test_shapes_come_from_text_and_vision_config(name: str) -> None:
    data = json.loads(FIXTURES[name].read_text())
    assert is_vision_config(data)
    config, _ = load_vision_config(FIXTURES[name])
    shape = vision_shape(FIXTURES[name], config)
    assert shape.text["vocab_size"] == data["text_config"]["vocab_size"] == 512
    assert shape.text["hidden_size"] == 64 and shape.text["num_hidden_layers"] == 2
    assert shape.vision["layers"] == 2 and shape.vision["hidden_size"] == 64
    assert image_text_class(config).__name__.endswith("ForConditionalGeneration")


def test_a_missing_vision_size_names_the_sub_config(tmp_path: Path) -> None:
    data = json.loads(FIXTURES["qwen2-vl"].read_text())
    data["text_config"]["hidden_size"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    config, _ = load_vision_config(path)
    with pytest.raises(UsageError, match=r"text_config\.hidden_size must be a positive integer, got 0"):
        vision_shape(path, config)


def test_text_config_is_no_vision_config(tmp_path: Path) -> None:
    path = tmp_path / "text.json"
    path.write_text((PRESETS_DIR / "tiny-qwen3.json").read_text())
    with pytest.raises(UsageError, match="no vision-language config"):
        load_vision_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [("448", "HxW"), ("0x448", "between 1"), ("448x99999", "between 1"), ("axb", "HxW"), ("", "HxW")],
)
def test_bad_image_sizes_are_one_line(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        parse_image_size(text)
    assert "\n" not in str(err.value)


def test_image_sizes_parse() -> None:
    assert parse_image_size("448x336") == (448, 336)
    assert parse_image_size(" 56 X 112 ") == (56, 112)


# -- rows made by the families' processors -------------------------------------------------------


def _rows(name: str, size: tuple[int, int], seq: int = 256, images: int = 1):  # type: ignore[no-untyped-def]
    config, _ = load_vision_config(FIXTURES[name])
    family = family_of(config.model_type)
    return config, image_rows(family, config, 512, size, seq, images_per_row=images)


@pytest.mark.parametrize(("size", "grid"), [((56, 56), (4, 4)), ((112, 84), (8, 6)), ((100, 300), (8, 22))])
def test_qwen2_vl_image_tokens_are_the_processors_grid(size: tuple[int, int], grid: tuple[int, int]) -> None:
    """Qwen2-VL: the image is resized to multiples of patch x merge (28) and takes (h/14 x w/14) / 4 tokens;
    the grid is the processor's (image_grid_thw), the row exactly seq-len long with mm_token_type_ids."""
    config, rows = _rows("qwen2-vl", size)
    thw = rows.inputs["image_grid_thw"].tolist()
    assert thw == [[1, *grid]]
    assert rows.image_tokens == grid[0] * grid[1] // 4
    ids = rows.inputs["input_ids"]
    assert ids.shape == (1, 256)
    assert int((ids == config.image_token_id).sum()) == rows.image_tokens
    assert int(rows.inputs["mm_token_type_ids"].sum()) == rows.image_tokens  # 1 on image tokens
    assert rows.inputs["pixel_values"].shape[0] == grid[0] * grid[1]
    assert (rows.inputs["labels"] == -100).sum() == rows.image_tokens


def test_qwen3_vl_min_pixels_upscale_small_images() -> None:
    """Qwen3-VL's processor keeps at least 65,536 pixels (256 x 256 at patch 16): a 56x56 image takes 64 tokens,
    as many as a 256x256 one; 512x512 takes 256."""
    assert _rows("qwen3-vl", (56, 56))[1].image_tokens == 64
    assert _rows("qwen3-vl", (256, 256))[1].image_tokens == 64
    assert _rows("qwen3-vl", (512, 512), seq=512)[1].image_tokens == 256


def test_fixed_size_families_ignore_the_image_size() -> None:
    """Gemma 3 takes mm_tokens_per_image whatever the image (no pan-and-scan by default); LLaVA its tower's
    patches; LLaVA-NeXT adds tiles by the image's aspect (its grid pinpoints)."""
    assert _rows("gemma3", (56, 56))[1].image_tokens == _rows("gemma3", (300, 120))[1].image_tokens == 16
    assert _rows("llava", (56, 56))[1].image_tokens == _rows("llava", (300, 120))[1].image_tokens == 16
    assert _rows("llava-next", (56, 56))[1].image_tokens < _rows("llava-next", (112, 112))[1].image_tokens


@pytest.mark.parametrize(
    ("size", "crops"), [((56, 56), 0), ((300, 600), 2), ((300, 900), 3), ((1200, 300), 4)]
)
def test_gemma3_pan_and_scan_adds_the_processors_crops(size: tuple[int, int], crops: int) -> None:
    """Gemma 3's processor call with ``do_pan_and_scan=True`` (its call defaults win over its image
    processor's settings, so it goes to every call): an image of aspect ratio >= 1.2 is also cut into 2-4
    crops, each taking mm_tokens_per_image (16) tokens and a pixel_values entry; a square one stays whole."""
    config, _ = load_vision_config(FIXTURES["gemma3"])
    rows = image_rows(family_of("gemma3"), config, 512, size, 256, pixels={"do_pan_and_scan": True})
    assert rows.image_tokens == 16 * (1 + crops)
    assert rows.inputs["pixel_values"].shape[0] == 1 + crops
    assert int((rows.inputs["input_ids"] == config.image_token_id).sum()) == rows.image_tokens


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3_rows_of_a_batch_each_take_their_own_image(pan_and_scan: bool) -> None:
    """A batch of Gemma 3 rows, as TRL's vision collator hands them to the processor (one list of images per row):
    each row holds its image's tokens; batch 2 was refused by Gemma3Processor ("[1, 1] <start_of_image> tokens and
    [2] images per sample") where the images went flat."""
    config, _ = load_vision_config(FIXTURES["gemma3"])
    options = {"do_pan_and_scan": True} if pan_and_scan else None
    rows = image_rows(family_of("gemma3"), config, 512, (300, 600), 256, batch=2, pixels=options)
    per_row = (rows.inputs["input_ids"] == config.image_token_id).sum(dim=1).tolist()
    assert per_row == [16 * (3 if pan_and_scan else 1)] * 2
    assert rows.inputs["pixel_values"].shape[0] == 2 * (3 if pan_and_scan else 1)


def test_pan_and_scan_audit_equals_estimate_and_is_gemma3s_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pan-and-scan``: the audit and the estimate (``--target cpu``) of tiny Gemma 3 with a 300x600
    image take the processor's 48 image tokens (the image and 2 crops) and agree to the byte; the JSON
    records it. Any other family, or a text model, is refused in one line (exit 2)."""
    from vramguard.cli.app import main

    base = ["--model", str(FIXTURES["gemma3"]), "--image-size", "300x600", "--seq-len", "96", "--batch", "1"]
    base += ["--pan-and-scan"]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    assert main(["audit", *base, "--steps", "1", "--device", "cpu", "--quiet", "--json", str(audit)]) == 0
    assert main(["estimate", *base, *LOOP, "--steps", "1", "--quiet", "--json", str(estimate)]) == 0
    a, e = json.loads(audit.read_text()), json.loads(estimate.read_text())
    assert a["config"]["pan_and_scan"] is e["config"]["pan_and_scan"] is True
    assert a["totals"] == e["totals"]
    assert any("48 image tokens" in n and "pixel_values 3x3x64x64" in n for n in a["verdict"]["notes"])
    capsys.readouterr()
    for model in (str(FIXTURES["qwen2.5-vl"]), "tiny-llama"):
        args = ["estimate", "--model", model, "--seq-len", "96", "--pan-and-scan", *LOOP]
        assert main([*args, "--image-size", "56x56"] if "vl" in model else args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pan-and-scan" in err, err
    assert "pan_and_scan" not in QLoRAConfig().to_dict()


def test_images_per_row_and_an_overflowing_row() -> None:
    one = _rows("qwen2-vl", (112, 112))[1].image_tokens
    assert _rows("qwen2-vl", (112, 112), images=3)[1].image_tokens == 3 * one
    with pytest.raises(UsageError, match=r"take \d+ tokens .* more than seq-len 16"):
        _rows("qwen2-vl", (112, 112), seq=16)


def test_special_token_ids_must_fit_the_vocabulary_and_differ(tmp_path: Path) -> None:
    data = json.loads(FIXTURES["qwen2-vl"].read_text())
    for change, message in (
        ({"image_token_id": 600}, "outside the language model's vocabulary"),
        ({"vision_start_token_id": 500}, "another special token's id too"),
    ):
        path = tmp_path / "ids.json"
        path.write_text(json.dumps({**data, **change}))
        config, _ = load_vision_config(path)
        with pytest.raises(UsageError, match=message):
            image_rows(family_of("qwen2_vl"), config, 512, (56, 56), 64)


@pytest.mark.skipif(importlib.util.find_spec("num2words") is not None, reason="num2words is installed")
def test_smolvlm_without_num2words_is_a_one_line_refusal() -> None:
    config, _ = load_vision_config(FIXTURES["smolvlm"])
    with pytest.raises(UsageError, match="needs the num2words package"):
        family_processor(family_of("smolvlm"), config, 512)


def test_smolvlm_rows_are_its_processors() -> None:
    """SmolVLM's processor (num2words installed, as the test extra has it) takes a video_processor argument
    with no default, which transformers' video processors cannot give without torchvision: it is given None,
    as the image-only processor of the other families drops its video slot. The row is SmolVLMProcessor's
    (Idefics3's splitting: a 56x56 image is 4 tiles and the global image, 68 image tokens at this tiny shape);
    the slow tests below measure its step (ledger = independent count, meta = audit) at two sizes."""
    config, rows = _rows("smolvlm", (56, 56))
    assert type(family_processor(family_of("smolvlm"), config, 512)).__name__ == "SmolVLMProcessor"
    assert rows.image_tokens == 68
    assert int((rows.inputs["input_ids"] == config.image_token_id).sum()) == 68
    assert rows.inputs["pixel_attention_mask"].shape[:2] == rows.inputs["pixel_values"].shape[:2]


# -- a real QLoRA step, its ledger and an independent count --------------------------------------


@pytest.fixture(scope="module")
def qwen25() -> object:
    """Tiny Qwen2.5-VL as users load it: from_pretrained with BitsAndBytesConfig (nf4, bf16), PEFT all-linear."""
    return build_vision_qlora(_config("qwen2.5-vl", seq=128), (56, 56))


def _ledger(model: torch.nn.Module, batch: dict) -> object:  # type: ignore[type-arg]
    with SavedTensorLedger(model) as ledger:
        out = model(**batch)
        ledger.add_roots(out.loss)
    out.loss.backward()
    for p in model.parameters():
        p.grad = None
    return ledger.report


def test_the_vision_tower_is_4bit_and_has_lora(qwen25) -> None:  # type: ignore[no-untyped-def]
    """bitsandbytes quantizes every nn.Linear but lm_head, the tower's and the merger's too, and all-linear puts
    LoRA on them: what users of the usual recipe get."""
    import bitsandbytes as bnb

    stacks = {s: {"4bit": 0, "lora": 0} for s in STACKS}
    for name, module in qwen25.q.model.named_modules():
        stack = qwen25.family.stack_of(name)
        stacks[stack]["4bit"] += isinstance(module, bnb.nn.Linear4bit)
        stacks[stack]["lora"] += hasattr(module, "lora_A")
    assert all(s["4bit"] > 0 and s["lora"] == s["4bit"] for s in stacks.values()), stacks
    head = qwen25.q.model.get_base_model().lm_head
    assert not isinstance(head, bnb.nn.Linear4bit)


def test_ledger_equals_an_independent_count_at_two_image_sizes(qwen25) -> None:  # type: ignore[no-untyped-def]
    """The ledger's saved bytes are the independent count's, and the vision tower's share grows with the image:
    the same model, rows of 56x56 and 112x112 images from its processor."""
    config, _ = load_vision_config(FIXTURES["qwen2.5-vl"])
    shares = []
    for size in ((56, 56), (112, 112)):
        rows = image_rows(qwen25.family, config, 512, size, 128)
        report = _ledger(qwen25.q.model, rows.inputs)
        assert report.saved_bytes == independent_saved_bytes(qwen25.q.model, rows.inputs)
        tower = sum(r.bytes for r in report.records if qwen25.family.stack_of(r.module) == "vision tower")
        shares.append(tower / report.saved_bytes)
    assert 0 < shares[0] < shares[1]


def test_matmul4bit_keeps_only_the_packed_weight_on_ctx(qwen25) -> None:  # type: ignore[no-untyped-def]
    """What the ctx walk of both counts finds here: bitsandbytes 0.50's MatMul4Bit keeps ``ctx.tensors = (None,
    B)`` and its QuantState, all resident (older releases kept the input A there too, which no hook sees): on
    this stack every saved activation goes through the hooks, and the walk adds nothing."""
    from saved_count import _tensors, graph_nodes, resident_storages

    resident = resident_storages(qwen25.q.model)
    out = qwen25.q.model(**qwen25.q.batch())
    nodes = [n for n in graph_nodes(out.loss.grad_fn) if type(n).__name__ == "MatMul4BitBackward"]
    kept = [t for n in nodes for k, v in vars(n).items() if not k.startswith("_") for t in _tensors(v, 2)]
    out.loss.backward()
    for p in qwen25.q.model.parameters():
        p.grad = None
    assert len(nodes) > 20  # the 4-bit linears of the tower, the merger and the language model
    assert kept and all(t.untyped_storage().data_ptr() in resident for t in kept)
    batch = qwen25.q.batch()
    with_ctx, loss = saved_storages(qwen25.q.model, batch)
    loss.backward()
    hooks_only, loss = saved_storages(qwen25.q.model, batch, walk_ctx=False)
    loss.backward()
    for p in qwen25.q.model.parameters():
        p.grad = None
    assert sum(with_ctx.values()) == sum(hooks_only.values())


def test_one_step_trains_the_towers_lora(qwen25) -> None:  # type: ignore[no-untyped-def]
    out = qwen25.q.model(**qwen25.q.batch())
    assert math.isfinite(float(out.loss.detach()))
    out.loss.backward()
    grads = [  # (lora_A's gradients are zero at the first step: lora_B starts at zero)
        p.grad
        for n, p in qwen25.q.model.named_parameters()
        if "lora_B" in n and qwen25.family.stack_of(n) == "vision tower"
    ]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    for p in qwen25.q.model.parameters():
        p.grad = None


def test_qwen3_vl_8b_preset_has_the_published_shape() -> None:
    """The preset is Qwen/Qwen3-VL-8B-Instruct's config.json: 8.77B parameters built on meta; one 448x448 image is
    (448/16)^2 / 4 = 196 tokens of a 512-token row."""
    path = PRESETS_DIR / "qwen3-vl-8b.json"
    config, _ = load_vision_config(path)
    shape = vision_shape(path, config)
    assert (shape.text["hidden_size"], shape.text["num_hidden_layers"], shape.vision["layers"]) == (
        4096,
        36,
        27,
    )
    with torch.device("meta"):
        model = image_text_class(config)(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.77
    rows = image_rows(family_of("qwen3_vl"), config, shape.text["vocab_size"], (448, 448), 512)
    assert rows.image_tokens == 196 and rows.inputs["input_ids"].shape == (1, 512)


# -- every family (slow: about 3 s a family and size) ---------------------------------------------

TWO_SIZES = {"qwen3-vl": ((256, 256), (512, 512)), "qwen3-vl-moe": ((256, 256), (512, 512))}
TWO_SIZES |= {
    "qwen3.5": TWO_SIZES["qwen3-vl"],
    "idefics3": ((56, 56), (56, 112)),
    "smolvlm": ((56, 56), (56, 112)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_family_steps_and_its_ledger_equals_the_independent_count(name: str) -> None:
    """Each family's tiny config through the whole path at two image sizes; one that cannot run here is a
    one-line refusal naming why (a processor's missing package)."""
    family = family_of(json.loads(FIXTURES[name].read_text())["model_type"])
    missing = _missing(family)
    if missing:
        with pytest.raises(UsageError, match=f"needs the {missing[0]} package"):
            build_vision_qlora(_config(name, seq=640), (56, 56))
        return
    q = build_vision_qlora(_config(name, seq=640), TWO_SIZES.get(name, ((56, 56), (112, 112)))[0])
    config, _ = load_vision_config(FIXTURES[name])
    for size in TWO_SIZES.get(name, ((56, 56), (112, 112))):
        rows = image_rows(q.family, config, 512, size, 640)
        independent = independent_saved_bytes(q.q.model, rows.inputs)  # first: a fresh model's first forward
        report = _ledger(q.q.model, rows.inputs)
        assert report.saved_bytes == independent, (name, size)
        by_stack = {s: 0 for s in STACKS}
        for r in report.records:
            by_stack[q.family.stack_of(r.module)] += r.bytes
        assert by_stack["vision tower"] > 0 and by_stack["language model"] > 0, by_stack


# -- the meta run -------------------------------------------------------------------------------


def _figures(step: object) -> dict:  # type: ignore[type-arg]
    d = step.to_dict()  # type: ignore[attr-defined]
    del d["seconds"]
    for s in d["steps"]:
        del s["loss"]  # meta has no values
    return d


@pytest.mark.parametrize("size", [(56, 56), (112, 112)])
def test_meta_step_equals_the_cpu_audit(size: tuple[int, int]) -> None:
    """Two steps of tiny Qwen2.5-VL on meta (the image inputs' values carried: grid sizes, cu_seqlens, the
    image tokens' positions) give the CPU audit's phase peaks, saved bytes per stack and retained bytes, to the
    byte."""
    from vramguard.estimate.vision import audit_vision_step, estimate_vision_step

    config = _config("qwen2.5-vl")
    audit = audit_vision_step(config, size)
    assert _figures(estimate_vision_step(config, size, target="cpu")) == _figures(audit)
    assert audit.by_stack["vision tower"] > 0


def test_plain_meta_cannot_run_the_vision_tower() -> None:
    """Without the carried values the tower stops at its first value read (what ImageValues answers)."""
    from vramguard.estimate.vision import build_vision_meta

    built, _values = build_vision_meta(_config("qwen2.5-vl"), (56, 56))
    with pytest.raises(RuntimeError, match="meta"):
        built.q.model(**built.q.batch())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_family_meta_step_equals_the_cpu_audit(name: str) -> None:
    from vramguard.estimate.vision import audit_vision_step, estimate_vision_step

    family = family_of(json.loads(FIXTURES[name].read_text())["model_type"])
    if _missing(family):
        pytest.skip(f"{family.name}'s processor needs {', '.join(family.needs)}")
    config = _config(name, seq=640)
    for size in TWO_SIZES.get(name, ((56, 56), (112, 112))):
        expected = _figures(audit_vision_step(config, size))
        assert _figures(estimate_vision_step(config, size, target="cpu")) == expected, (name, size)


@pytest.mark.slow
def test_qwen3_vl_8b_estimate_splits_the_stacks() -> None:
    """Issue 45's acceptance: a Qwen3-VL-8B-shaped estimate with one 448x448 image at seq 512 runs on the CPU
    (about 13 s here: benchmarks/test_estimate_targets.py times it) and splits vision tower / projector /
    language model bytes."""
    from vramguard.estimate.vision import estimate_vision_step

    config = QLoRAConfig(model=str(PRESETS_DIR / "qwen3-vl-8b.json"), seq_len=512, batch=1)
    step = estimate_vision_step(config, (448, 448), target="cuda")
    assert step.image_tokens == 196
    assert all(step.by_stack[s] > 0 for s in STACKS)
    assert sum(step.by_stack.values()) == step.ledger.saved_bytes
    assert step.seconds < 120


# -- the commands --------------------------------------------------------------------------------


LOOP = ["--trainer", "loop", "--target", "cpu"]
"""The audit's recipe on the CPU's kernels (estimate's default recipe is trl sft's)."""


def test_audit_and_estimate_commands_of_a_vlm_agree_to_the_byte(tmp_path: Path) -> None:
    """``vramguard audit --model <tiny VLM config> --image-size HxW`` measures (exit 0) and notes the rows and
    the saved bytes per stack; ``vramguard estimate ... --trainer loop --target cpu`` gives the same phase peaks,
    totals and per-stack note."""
    from vramguard.cli.app import main

    base = [
        "--model",
        str(FIXTURES["qwen2.5-vl"]),
        "--image-size",
        "112x84",
        "--seq-len",
        "96",
        "--batch",
        "1",
    ]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    assert main(["audit", *base, "--steps", "2", "--device", "cpu", "--quiet", "--json", str(audit)]) == 0
    assert main(["estimate", *base, *LOOP, "--steps", "2", "--quiet", "--json", str(estimate)]) == 0
    a, e = json.loads(audit.read_text()), json.loads(estimate.read_text())
    assert a["config"]["image_size"] == e["config"]["image_size"] == "112x84"
    assert a["totals"] == e["totals"] and a["totals"]["saved_bytes"] > 0
    assert {k: v["peak_bytes"] for k, v in a["phases"].items()} == {
        k: v["peak_bytes"] for k, v in e["phases"].items()
    }

    def notes(doc: dict) -> list[str]:  # type: ignore[type-arg]
        return [n for n in doc["verdict"]["notes"] if "vision" in n]

    assert notes(a) == notes(e)
    assert any("12 image tokens" in n and "image_grid_thw [[1, 8, 6]]" in n for n in notes(a)), notes(a)
    assert any(n.startswith("saved for backward by stack: vision tower") for n in notes(a)), notes(a)


def test_text_run_documents_have_no_image_fields() -> None:
    d = QLoRAConfig().to_dict()
    assert "image_size" not in d and "images_per_row" not in d
    assert QLoRAConfig(image_size="56x56", images_per_row=2).to_dict()["images_per_row"] == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--image-size", "0x56"], "image size sides must be between 1"),
        (["--image-size", "56"], "image size must be HxW"),
        (["--images-per-row", "2"], "images-per-row needs image-size"),
        (["--image-size", "448x448", "--seq-len", "8"], "more than seq-len 8"),
    ],
)
def test_bad_image_options_are_one_line_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(FIXTURES["qwen2-vl"]), "--batch", "1", "--seq-len", "64", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_a_family_whose_processor_cannot_run_here_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vramguard.cli.app import main

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Mistral 3's processor runs")
    argv = ["estimate", "--model", str(FIXTURES["mistral3"]), "--image-size", "56x56", "--seq-len", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the torchvision package" in err and "\n" not in err


def test_ci_runs_mistral3_where_torchvision_imports() -> None:
    """The refusal above is all the default run sees of Mistral 3 (torchvision does not import beside its CPU
    torch): .ci/run runs the family's tests in a second environment with torch 2.14.1 and torchvision 0.29.1,
    where a missing torchvision fails them."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.14.1 torchvision==0.29.1" in ci and "VRAMGUARD_REQUIRE_TORCHVISION=1" in ci
    assert "tests/test_vision.py -k \"mistral3 or video\"" in ci


def test_text_only_rows_without_an_image_size() -> None:
    """The seed's TEXT mode: a vision-language model trained on text rows (no --image-size): the processor's rows
    have no image inputs; PaliGemma's processor wants images and says so in one line."""
    _, rows = _rows("qwen3-vl", None, seq=64)  # type: ignore[arg-type]
    assert rows.image_tokens == 0 and rows.inputs["input_ids"].shape == (1, 64)
    assert "pixel_values" not in rows.inputs and rows.layout == "no image inputs"
    with pytest.raises(UsageError, match="PaliGemmaProcessor refuses text-only rows"):
        _rows("paligemma", None)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [
        {"gradient_checkpointing": True},
        {"lora_dropout": 0.1},
        {"batch": 2},
        {"images_per_row": 2},
        {"image_size": ""},
    ],
    ids=["checkpointing", "dropout", "batch-2", "two-images", "text-only"],
)
def test_estimate_equals_the_audit_for_the_step_options(change: dict) -> None:  # type: ignore[type-arg]
    from vramguard.audit.run import run_audit
    from vramguard.estimate.run import run_estimate

    base = {"model": str(FIXTURES["qwen3-vl"]), "seq_len": 320, "batch": 1, "image_size": "256x256"}
    config = QLoRAConfig(**{**base, **change}).resolved()  # type: ignore[arg-type]
    audit, estimate = run_audit(config, steps=2), run_estimate(config, steps=2, target="cpu")
    assert audit.totals == estimate.totals
    assert {k: v.peak_bytes for k, v in audit.phases.items()} == {
        k: v.peak_bytes for k, v in estimate.phases.items()
    }


def test_offloaded_estimate_keeps_the_masks_values() -> None:
    """TRL's activation offloading on meta copies every saved tensor to an emulated host buffer: Qwen3-VL's
    deepstack mask, which its backward indexes with, keeps its value there (without it the meta backward stopped
    at nonzero)."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(
        model=str(FIXTURES["qwen3-vl"]), seq_len=128, batch=1, image_size="256x256", offload_activations=True
    )
    report = run_estimate(config.resolved(), steps=1, target="cpu")
    assert report.estimate is not None and report.phases["backward"].peak_bytes > 0
    assert any("activations offloaded" in n for n in report.verdict.notes)


def test_a_towers_encoder_layers_keep_their_stack_in_the_layer_table() -> None:
    """CLIP/SigLIP towers (LLaVA, Gemma 3, PaliGemma, ...) have ``encoder.layers.N`` too: the layer table names
    them by their path, apart from the language model's ``layers.N``, and lists each stack in order."""
    from vramguard.step.assemble import layer_rows
    from vramguard.measure.ledger import LedgerReport, SavedRecord
    from vramguard.view.report import short_layer_name

    tower = "base_model.model.model.vision_tower.vision_model.encoder.layers"
    lm = "base_model.model.model.language_model.layers"
    names = [f"{tower}.1.mlp", f"{lm}.1.mlp", f"{tower}.0.mlp", f"{lm}.0.mlp"]
    report = LedgerReport(
        records=[
            SavedRecord(n, "MulBackward0", (4,), "float32", 16, "hook", "activation", "cpu") for n in names
        ]
    )
    assert [short_layer_name(r.name) for r in layer_rows(report)] == [
        "layers.0",
        "layers.1",
        "vision_tower.vision_model.encoder.layers.0",
        "vision_tower.vision_model.encoder.layers.1",
    ]
    assert short_layer_name("base_model.model.model.layers.3") == "layers.3"


@pytest.mark.parametrize(
    ("family", "module", "layer"),
    [
        ("qwen2_5_vl", "base_model.model.model.visual.blocks.1.attn.qkv.lora_A.default", "visual.blocks.1"),
        ("qwen2_5_vl", "base_model.model.model.visual.merger.mlp.0", "visual.merger"),
        ("qwen2_5_vl", "base_model.model.model.visual.patch_embed.proj", None),
        ("qwen2_5_vl", "base_model.model.model.language_model.layers.0.mlp", "language_model.layers.0"),
        ("qwen2_5_vl", "base_model.model.lm_head", None),
        ("qwen3_vl", "model.visual.deepstack_merger_list.0.linear_fc1", "visual.deepstack_merger_list.0"),
        ("internvl", "model.vision_tower.encoder.layer.1.mlp.fc1", "vision_tower.encoder.layer.1"),
        ("mllama", "model.vision_model.global_transformer.layers.0.mlp", "vision_model.global_transformer.layers.0"),
        ("mistral3", "model.multi_modal_projector.patch_merger.merging_layer", "multi_modal_projector"),
        ("smolvlm", "model.text_model.layers.1.self_attn", "text_model.layers.1"),
        ("smolvlm", "model.connector.modality_projection.proj", "connector"),
    ],
)
def test_each_stacks_layers_are_rows(family: str, module: str, layer: str | None) -> None:
    """The layer a record goes under, as the families' modules are named in transformers 5: the tower's blocks
    (``blocks.N``, ``encoder.layers.N``, InternVL's ``encoder.layer.N``, Mllama's two lists), the projector
    (one row, or one per element of a list) and the language model's decoder layers; the patch embedding and
    ``lm_head`` are in none."""
    got = VISION_FAMILIES[family].layer_of(module)
    assert (got if got is None else got.removeprefix("base_model.model.").removeprefix("model.")) == layer


def test_the_layer_table_lists_each_stacks_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 item 1: the per-layer table of a tiny Qwen2.5-VL estimate has rows of each stack, the vision
    tower's blocks, the merger and the language model's decoder layers, under a stack column, identical layers
    of one stack collapsed by default and every layer with --verbose; the JSON's ``layers`` carry them with their
    stack (the tower's ``blocks.N`` and the merger were in "outside decoder layers": the table listed the
    language model's layers only)."""
    from rich.console import Console

    from vramguard.cli.app import main
    from vramguard.step.report import AuditReport
    from vramguard.view.report import estimate_layout, render, short_layer_name

    monkeypatch.setenv("COLUMNS", "200")  # rows read from the text: unwrapped (xdist's workers set COLUMNS=80)
    out = tmp_path / "e.json"
    argv = ["estimate", "--model", str(FIXTURES["qwen2.5-vl"]), "--image-size", "56x56", "--seq-len", "64"]
    assert main([*argv, "--batch", "1", "--target-modules", "all-linear", "--target", "cpu", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(row["stack"], short_layer_name(row["name"])) for row in doc["layers"]] == [
        ("vision tower", "visual.blocks.0"),
        ("vision tower", "visual.blocks.1"),
        ("projector", "visual.merger"),
        ("language model", "layers.0"),
        ("language model", "layers.1"),
    ]
    totals = doc["totals"]
    assert sum(row["saved_bytes"] for row in doc["layers"]) + totals["outside_layers_bytes"] == totals["saved_bytes"]
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in table]
    assert rows[0][0] == "vision tower" and rows[0][1].startswith("visual.blocks.0"), rows
    assert rows[-2:] == [["projector", "visual.merger"], ["language model", "layers.0-1"]], rows
    console = Console(record=True, width=200)
    render(AuditReport.from_dict(doc), console, estimate_layout(verbose=True))
    text = console.export_text()
    assert "per layer of each stack" in text and "outside the stacks' layers" in text
    assert all(f" {name} " in text for name in ("visual.blocks.0", "visual.blocks.1", "layers.0", "layers.1"))


def test_estimates_default_recipe_runs_sfttrainers_step_for_a_vlm(capsys: pytest.CaptureFixture[str]) -> None:
    """``vramguard estimate`` prices trl sft's recipe by default; a vision-language model's step is SFTTrainer's
    own (tests/test_vision_trainer.py), its saved bytes split by stack."""
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(FIXTURES["qwen2.5-vl"]), "--image-size", "56x56", "--seq-len", "64"]
    assert main([*argv, "--batch", "1", "--target-modules", "all-linear", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "(SFTTrainer's own step)" in out and "saved for backward by stack" in out


def test_trl_default_targets_on_a_vlm_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """TRL's default LoRA targets are PEFT's per-architecture list, which has no vision-language model: one line
    naming --target-modules, before anything is built."""
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(FIXTURES["qwen3-vl"]), "--image-size", "56x56", "--seq-len", "128"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "PEFT has no default target modules for qwen3_vl" in err and "--target-modules all-linear" in err


# -- the Trainer callback ------------------------------------------------------------------------


def test_trainer_callback_on_a_vlm_splits_its_ledger_by_stack(tmp_path: Path) -> None:
    """``VramGuardCallback`` on a plain transformers ``Trainer`` of tiny Qwen2.5-VL QLoRA (vramguard's VLM
    build, two rows of the processor's 56x56 image inputs, a collator that concatenates them): two steps, no
    growth, the ledger's saved bytes equal the independent count of the same first forward, and the report
    splits them by stack as ``vramguard audit`` does (the note was missing: the callback's model has no
    ``vision`` setup)."""
    from transformers import Trainer, TrainingArguments

    from vramguard.integrations.transformers import VramGuardCallback
    from vramguard.workload.training import make_optimizer

    built = build_vision_qlora(_config("qwen2.5-vl", seq=128), (56, 56))
    config, _ = load_vision_config(FIXTURES["qwen2.5-vl"])
    rows = [image_rows(built.family, config, 512, (56, 56), 128, seed=i).inputs for i in range(2)]
    independent = independent_saved_bytes(built.q.model, rows[0])
    args = TrainingArguments(
        str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        train_sampling_strategy="sequential",  # step 1 trains on rows[0]
        remove_unused_columns=False,  # pixel_values, image_grid_thw, mm_token_type_ids reach the model
        disable_tqdm=True,
    )
    cb = VramGuardCallback(table=False)
    trainer = Trainer(
        model=built.q.model,
        args=args,
        train_dataset=rows,  # type: ignore[arg-type]  # a list of dicts is a map-style dataset
        data_collator=lambda items: {k: torch.cat([it[k] for it in items]) for k in items[0]},
        callbacks=[cb],
        optimizers=(make_optimizer(built.q), None),
    )
    trainer.train()
    report = cb.report
    assert report is not None and report.verdict.ok, report.verdict.line
    assert len(report.steps) == 2 and cb.ledger is not None
    assert report.totals.saved_bytes == cb.ledger.saved_bytes == independent
    assert [(r.stack, r.name.rsplit(".", 2)[-2:]) for r in report.layers] == [
        ("vision tower", ["blocks", "0"]),
        ("vision tower", ["blocks", "1"]),
        ("projector", ["visual", "merger"]),
        ("language model", ["layers", "0"]),
        ("language model", ["layers", "1"]),
    ]
    notes = [n for n in report.verdict.notes if n.startswith("saved for backward by stack")]
    assert len(notes) == 1 and "vision tower" in notes[0] and "projector" in notes[0], report.verdict.notes


# -- video frames (Qwen2-VL/2.5-VL/3-VL/3-VL-MoE, Qwen3.5, GLM-4V, InternVL; they need torchvision) ----

GRID_VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5", "glm4v")
"""The tiny fixtures of the families whose video processor makes ``pixel_values_videos`` and ``video_grid_thw``."""
VIDEO_FAMILIES = (*GRID_VIDEO_FAMILIES, "internvl", "smolvlm")
"""The tiny fixtures of the families whose video rows vramguard makes (InternVL's and SmolVLM's frames are
images)."""


def _video_missing() -> bool:
    """Whether torchvision cannot run here (transformers' video processors need it); with
    VRAMGUARD_REQUIRE_TORCHVISION=1 (.ci/run's torchvision stage) that fails the test instead."""
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # noqa: BLE001  (missing, or PyPI's torchvision beside the CPU torch: ::nms ...)
        if REQUIRE_TORCHVISION:
            pytest.fail(f"VRAMGUARD_REQUIRE_TORCHVISION=1 but torchvision does not import: {exc}")
        return True
    return False


def _video_rows(name: str, frames: int, size: tuple[int, int] = (56, 56), seq: int = 640) -> tuple[Any, Any]:
    """(the family, its processor's rows of one video of ``frames`` frames of ``size``, ``seq`` tokens
    long)."""
    from vramguard.workload.vision import VideoAsk

    config, _ = load_vision_config(FIXTURES[name])
    family = family_of(config.model_type)
    return family, image_rows(family, config, 512, None, seq, video=VideoAsk(frames, size))


@pytest.mark.parametrize("name", GRID_VIDEO_FAMILIES)
def test_video_rows_are_the_video_processors(name: str) -> None:
    """The family's video processor makes pixel_values_videos and video_grid_thw: 2 frames a temporal patch
    (an odd count padded with its last frame: 3 frames take the temporal patches of 4), each temporal patch
    ``grid_h * grid_w / merge**2`` video tokens in the row, the row --seq-len long, its video tokens masked in
    the labels; no image inputs. GLM-4V's processor writes each temporal patch as an image (its image token
    between the image markers, then the timestamp) inside the video's markers: its video tokens are the ones its
    ``mm_token_type_ids`` mark 2."""
    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    config, _ = load_vision_config(FIXTURES[name])
    merge = int(config.vision_config.spatial_merge_size)
    for frames, temporal in ((3, 2), (4, 2), (8, 4)):
        family, rows = _video_rows(name, frames)
        ((t, h, w),) = rows.inputs["video_grid_thw"].tolist()
        assert t == temporal, (name, frames)
        assert rows.video_tokens == t * h * w // merge**2 > 0
        ids = rows.inputs["input_ids"]
        video = ids == config.video_token_id if family.video_token else rows.inputs["mm_token_type_ids"] == 2
        assert ids.shape == (1, 640) and int(video.sum()) == rows.video_tokens
        if not family.video_token:  # GLM-4V: the video's tokens are image tokens, one frame marker pair a patch
            assert int((ids == config.image_token_id).sum()) == rows.video_tokens
            assert int((ids == config.image_start_token_id).sum()) == t
        assert int((rows.inputs["labels"] == -100).sum()) == rows.video_tokens
        assert rows.inputs["pixel_values_videos"].shape[0] == t * h * w
        assert "pixel_values" not in rows.inputs and rows.image_tokens == 0
    overflow = r"a video of 8 frames of 56x56 take \d+ tokens .* video tokens\), more than"
    with pytest.raises(UsageError, match=overflow):
        _video_rows(name, 8, seq=8)


@pytest.mark.parametrize(
    ("name", "bounds"),
    [
        # Qwen2-VL / Qwen2.5-VL ship no video_preprocessor_config.json: from_pretrained reads the image bounds
        ("qwen2-vl", (3136, 12845056)),
        ("qwen2.5-vl", (3136, 12845056)),
        # Qwen3-VL's video_preprocessor_config.json: size {"shortest_edge": 4096, "longest_edge": 25165824}
        ("qwen3-vl", (4096, 25165824)),
        # Qwen3-VL-MoE and Qwen3.5 load Qwen3-VL's video processor (Qwen3VLProcessor) with its bounds
        ("qwen3-vl-moe", (4096, 25165824)),
        ("qwen3.5", (4096, 25165824)),
    ],
)
def test_the_video_processor_has_the_pixel_bounds_users_load(name: str, bounds: tuple[int, int]) -> None:
    """The video processor's bounds are those ``AutoProcessor.from_pretrained`` gives for the checkpoints, not the
    classes' defaults (100,352-602,112 and 131,072-786,432): 8 frames of 448x448 on Qwen3-VL keep their size,
    784 video tokens, where the class default shrank them to 288x288 (324; review)."""
    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    from vramguard.workload.vision import _video_processor

    config, _ = load_vision_config(FIXTURES[name])
    size = _video_processor(family_of(config.model_type), config).size
    assert (size.shortest_edge, size.longest_edge) == bounds


@pytest.mark.slow
@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_video_ledger_equals_an_independent_count_at_two_frame_counts(name: str) -> None:
    """A real QLoRA step of each family (from_pretrained with BitsAndBytesConfig, PEFT all-linear) on rows
    with a video of 3 and of 8 frames: the ledger's saved bytes are the independent hook-and-ctx count's, the
    vision tower's share grows with the frames (frames of 192x192: Qwen3-VL's video processor bounds the whole
    video's pixels, so 3 frames of 56x56 are enlarged more than 8 and take more tokens)."""
    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    q = build_vision_qlora(_config(name, seq=640, video_frames=4, video_size="192x192"))
    tower = []
    for frames in (3, 8):
        _family, rows = _video_rows(name, frames, (192, 192))
        independent = independent_saved_bytes(q.q.model, rows.inputs)
        report = _ledger(q.q.model, rows.inputs)
        assert report.saved_bytes == independent, (name, frames)
        tower.append(sum(r.bytes for r in report.records if q.family.stack_of(r.module) == "vision tower"))
    assert 0 < tower[0] < tower[1], tower


@pytest.mark.slow
@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_video_audit_and_estimate_commands_agree_to_the_byte(name: str, tmp_path: Path) -> None:
    """``vramguard audit --video-frames N --video-size HxW`` measures, and ``vramguard estimate ... --trainer
    loop --target cpu`` (the meta run, video_grid_thw's values carried beside its meta tensor) gives its phase
    peaks, totals and notes to the byte, at 3 and 8 frames."""
    from vramguard.cli.app import main

    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    for frames in (3, 8):
        base = ["--model", str(FIXTURES[name]), "--video-frames", str(frames), "--video-size", "56x84"]
        base += ["--seq-len", "640", "--batch", "1", "--steps", "2", "--quiet"]
        audit, estimate = tmp_path / f"audit{frames}.json", tmp_path / f"estimate{frames}.json"
        assert main(["audit", *base, "--device", "cpu", "--json", str(audit)]) in (0, 1)
        assert main(["estimate", *base, *LOOP, "--json", str(estimate)]) == 0
        a, e = json.loads(audit.read_text()), json.loads(estimate.read_text())
        assert a["config"]["video_frames"] == e["config"]["video_frames"] == frames
        assert a["totals"] == e["totals"] and a["totals"]["saved_bytes"] > 0, (name, frames)
        assert {k: v["peak_bytes"] for k, v in a["phases"].items()} == {
            k: v["peak_bytes"] for k, v in e["phases"].items()
        }
        notes = [n for n in a["verdict"]["notes"] if "vision" in n]
        assert notes == [n for n in e["verdict"]["notes"] if "vision" in n]
        asked = f"a video of {frames} frames of 56x84"
        made = {"internvl": f"pixel_values {frames}x3x56x56", "smolvlm": f"pixel_values 1x{frames}x3x56x56"}
        made = made.get(name, "video_grid_thw [[")
        assert any(asked in n and made in n for n in notes), notes


def test_smolvlm_video_frames_are_images_and_a_row_holds_no_image_beside_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SmolVLM's video processor resizes each frame to the tower's size (as its image processor resizes an image
    before splitting it) and its processor writes each as an image after 'Frame from MM:SS:' (image_seq_len image
    tokens between its markers, no global token), the frames in ``pixel_values`` (batch x frames x 3 x H x W):
    3 frames are 3 images. It returns them under the images' own name, so a row with an image and a video would
    have the video's pixels for both: that is one line."""
    from vramguard.cli.app import main

    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    config, _ = load_vision_config(FIXTURES["smolvlm"])
    per_frame = (56 // 14) ** 2 // int(config.scale_factor) ** 2
    for frames in (3, 8):
        _family, rows = _video_rows("smolvlm", frames, (56, 84))
        assert (rows.video_tokens, rows.image_tokens) == (frames * per_frame, 0)
        assert tuple(rows.inputs["pixel_values"].shape) == (1, frames, 3, 56, 56)
        ids = rows.inputs["input_ids"]
        assert int((ids == config.image_token_id).sum()) == rows.video_tokens
        assert int((rows.inputs["labels"] == -100).sum()) == rows.video_tokens
    argv = ["estimate", "--model", str(FIXTURES["smolvlm"]), "--video-frames", "3", "--video-size", "56x56"]
    assert main([*argv, "--image-size", "56x56", "--seq-len", "640", "--target-modules", "all-linear"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a row cannot hold both: give --image-size or --video-frames" in err and "\n" not in err


@pytest.mark.parametrize("name", ["qwen2-vl", "glm4v"])
def test_video_frames_one_or_three_pixels_high_are_read_as_height(
    name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """The frames are (frames, height, width, 3) arrays: a frame 1 or 3 pixels high looks channels-first to
    transformers' inference (review: 3x200 frames made the grid of 200x3 ones, 1x5 frames were read as
    one channel of 5x3, each with a warning on stderr). The processor is told they are channels-last: a
    3x200 video gets the transpose of a 200x3 one's grid, and nothing is printed."""
    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    config, _ = load_vision_config(FIXTURES[name])
    family = family_of(config.model_type)
    from vramguard.workload.vision import VideoAsk

    grid = {}
    for size in ((3, 200), (200, 3), (1, 5), (5, 1)):
        rows = image_rows(family, config, 512, None, 640, video=VideoAsk(2, size))
        grid[size] = rows.inputs["video_grid_thw"].tolist()[0]
    for short, tall in (((3, 200), (200, 3)), ((1, 5), (5, 1))):
        assert grid[short] == [1, grid[tall][2], grid[tall][1]] and grid[short][1] < grid[short][2], grid
    assert "channel dimension is ambiguous" not in capfd.readouterr().err


def test_glm4v_image_and_video_in_one_row_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-4V's model finds a row's image features by the image token, and its processor writes the video's
    frames with that token too (Glm4vModel.get_placeholder_mask: ``special_video_mask`` is the image token's
    mask), so a row with an image and a video ends in transformers' "Image features and image tokens do not
    match", on the real model as on meta (review: exit 3, an internal error). It is one line, exit 2, before
    any processor is built (so without torchvision too)."""
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(FIXTURES["glm4v"]), "--image-size", "56x56", "--video-frames", "3"]
    assert main([*argv, "--video-size", "56x84", "--seq-len", "640", "--target-modules", "all-linear"]) == 2
    err = capsys.readouterr().err.strip()
    assert "GLM-4V" in err and "a row cannot hold both: give --image-size or --video-frames" in err, err
    assert "\n" not in err


def test_a_family_whose_video_rows_are_not_made_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A family registered without its video processor, whose processor takes video (SmolVLM's, here unregistered):
    the one line says so and names the families whose video rows are made."""
    import dataclasses

    from vramguard.cli.app import main

    family = VISION_FAMILIES["smolvlm"]
    monkeypatch.setitem(VISION_FAMILIES, "smolvlm", dataclasses.replace(family, video_processor=None))
    argv = ["estimate", "--model", str(FIXTURES["smolvlm"]), "--video-frames", "4", "--video-size", "56x56"]
    assert main([*argv, "--seq-len", "640", "--target-modules", "all-linear"]) == 2
    err = capsys.readouterr().err.strip()
    assert "SmolVLM's processor (SmolVLMProcessor) takes video, but vramguard does not make its video rows yet" in err
    assert "done: Qwen2-VL" in err and "InternVL" in err and "\n" not in err


@pytest.mark.slow
def test_qwen3_5_moe_video_audit_and_estimate_agree_to_the_byte(tmp_path: Path) -> None:
    """Qwen3.5-MoE (no tiny fixture of its own: tiny Qwen3.5's config with 4 experts, 2 a token) takes Qwen3.5's
    processor and its video processor: the audit of a row with a 3-frame video measures, and the meta run (the
    experts' routing and video_grid_thw's values carried) gives its totals and phase peaks to the byte."""
    from vramguard.cli.app import main

    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    data = json.loads(FIXTURES["qwen3.5"].read_text())
    data.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"])
    data["text_config"].update(
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    model = tmp_path / "tiny-qwen3.5-moe.json"
    model.write_text(json.dumps(data))
    base = ["--model", str(model), "--video-frames", "3", "--video-size", "56x84", "--seq-len", "640"]
    base += ["--batch", "1", "--steps", "2", "--quiet"]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    assert main(["audit", *base, "--device", "cpu", "--json", str(audit)]) in (0, 1)
    assert main(["estimate", *base, *LOOP, "--json", str(estimate)]) == 0
    a, e = json.loads(audit.read_text()), json.loads(estimate.read_text())
    assert a["totals"] == e["totals"] and a["totals"]["saved_bytes"] > 0
    assert {k: v["peak_bytes"] for k, v in a["phases"].items()} == {k: v["peak_bytes"] for k, v in e["phases"].items()}
    notes = [n for n in e["verdict"]["notes"] if "vision-language model (Qwen3.5-MoE)" in n]
    assert len(notes) == 1 and "12 video tokens" in notes[0] and "video_grid_thw [[2, 4, 6]]" in notes[0], notes


def test_internvl_video_frames_are_images() -> None:
    """InternVL's processor resizes each frame to the tower's image size (InternVLVideoProcessor) and writes it as
    an image, ``FrameN: <img>`` and image_seq_length image tokens ``</img>``, its pixels among the images' in
    ``pixel_values``: no temporal patches (3 frames are 3 images), and the row's video tokens are the image
    tokens the video adds to its images' own."""
    if _video_missing():
        pytest.skip("transformers' video processors need torchvision")
    from vramguard.workload.vision import VideoAsk

    config, _ = load_vision_config(FIXTURES["internvl"])
    family = family_of(config.model_type)
    per_frame = (56 // 14) ** 2 // 4  # (image_size / patch_size)^2 * downsample_ratio^2
    for frames in (3, 8):
        _family, rows = _video_rows("internvl", frames, (56, 84))
        assert (rows.video_tokens, rows.image_tokens) == (frames * per_frame, 0)
        assert tuple(rows.inputs["pixel_values"].shape) == (frames, 3, 56, 56)
        ids = rows.inputs["input_ids"]
        assert ids.shape == (1, 640) and int((ids == config.image_token_id).sum()) == rows.video_tokens
        assert int((rows.inputs["labels"] == -100).sum()) == rows.video_tokens
        both = image_rows(family, config, 512, (56, 56), 640, video=VideoAsk(frames, (56, 84)))
        assert (both.image_tokens, both.video_tokens) == (per_frame, frames * per_frame)
        assert tuple(both.inputs["pixel_values"].shape) == (frames + 1, 3, 56, 56)


def test_video_without_torchvision_is_a_one_line_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    """Where torchvision is not installed (the default environment: PyPI's does not import beside the CPU
    torch) a video is refused in one line naming the way out."""
    from vramguard.cli.app import main

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the video processors run")
    argv = ["estimate", "--model", str(FIXTURES["qwen2.5-vl"]), "--video-frames", "4"]
    assert main([*argv, "--video-size", "56x56", "--seq-len", "640", "--target-modules", "all-linear"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Qwen2VLVideoProcessor) needs the torchvision package: pip install torchvision" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("llava", [], "LLaVA takes no video in transformers"),
        ("gemma3", [], "Gemma 3 takes no video in transformers"),
        ("qwen2-vl", ["--video-size", ""], "video-frames and video-size go together"),
        ("qwen2-vl", ["--video-size", "56"], "video-size: image size must be HxW"),
        ("qwen2-vl", ["--video-frames", "769"], "video-frames must be an integer from 1 to 768"),
        (
            "qwen2-vl",
            ["--video-frames", "768", "--video-size", "4096x4096"],
            "is 12,884,901,888 pixels, more than the 268,435,456",
        ),
    ],
    ids=["llava", "gemma3", "no-size", "bad-size", "too-many", "too-many-pixels"],
)
def test_video_options_a_run_cannot_take_are_one_line_exit_2(
    model: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(FIXTURES[model]), "--video-frames", "4", "--video-size", "56x56"]
    assert main([*argv, "--seq-len", "640", "--target-modules", "all-linear", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_video_fields_are_recorded_only_when_set() -> None:
    """A run without a video writes the document it wrote before the fields; a text model given one is
    refused."""
    assert "video_frames" not in QLoRAConfig().to_dict() and "video_size" not in QLoRAConfig().to_dict()
    d = QLoRAConfig(video_frames=4, video_size="56x56").to_dict()
    assert (d["video_frames"], d["video_size"]) == (4, "56x56")
    with pytest.raises(UsageError, match="video-frames, video-size: options of a vision-language model"):
        from vramguard.workload.vision import refuse_tower_options

        refuse_tower_options(QLoRAConfig(video_frames=4, video_size="56x56"))


def test_video_with_fit_dim_image_is_refused_in_one_line() -> None:
    """``--fit-dim image`` counts an image's tokens only: beside a video it would overflow the row it
    searched."""
    from vramguard.estimate.fit_image import image_space

    config = QLoRAConfig(model=str(FIXTURES["qwen2.5-vl"]), video_frames=4, video_size="56x56", seq_len=640)
    with pytest.raises(UsageError, match="--fit-dim image does not search beside a video yet"):
        image_space(config.resolved())


def test_video_frames_bound_the_batch_fit_as_images_do() -> None:
    """``--fit-dim batch`` makes every row's video on the host: its frames' pixels count against the probe's
    pixel budget as images do (8 frames of 448x448: 10 rows, not the 2^20 of a text model)."""
    import argparse

    from vramguard.cli.estimate import IMAGE_FIT_PIXELS, _limit

    config = QLoRAConfig(model=str(FIXTURES["qwen2.5-vl"]), video_frames=8, video_size="448x448", batch=1)
    args = argparse.Namespace(fit_dim="batch", steps=1)
    assert _limit(config, args, "loop") == IMAGE_FIT_PIXELS // (8 * 448 * 448) == 10
