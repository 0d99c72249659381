"""A deep model's identical decoder layers priced from one equal running every layer, byte for byte.

The meta step of a decoder with L >= 8 identical layers runs layers 0, 1, 2 and L-1 and counts L-4 copies of
layer 2's forward and backward (:mod:`vramguard.estimate.ghosts`). Each case runs the estimate both ways
(``VRAMGUARD_ALL_LAYERS`` runs every layer) on an 8-layer copy of a tiny preset and compares the whole JSON
report (peaks per phase and step, retained bytes, the ledger's records and layers, forced decisions, notes) but
its wall time, and counts the decoder layers' forwards each ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from test_micro_batches import TRAINER_CASES as MICRO_BATCH_CASES
from vramguard.estimate import ghosts
from vramguard.estimate.ghosts import ALL_LAYERS, eligible, signature
from vramguard.measure.tracker import StorageTracker
from vramguard.workload.models import QLoRAConfig, presets

LAYERS = 8
VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
SMALL = dict(seq_len=32, batch=1)
WIDE = "tiny-llama:wide"
"""tiny-llama with a 4096-wide MLP: a layer's recompute in backward sets the step's peak (the real layer 2's span,
the first of the identical ones: a copy's own highest point never tops a real neighbour's, which has the same
climb from a higher start)."""

DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The shapes of the small configs built here (Granite SWA's, Cohere Compass's text model)."""
VLM_ROWS = {"seq_len": 128, "batch": 2, "image_size": "56x56", "target_modules": "all-linear"}
Case = tuple[dict[str, Any], str, str, str]
"""(config, preset, target, trainer: ``loop`` or ``sft``)."""

CASES: dict[str, Case] = {
    "checkpointing-dropout-bf16-ga4": (
        {
            "seq_len": 32,
            "batch": 2,
            "gradient_accumulation_steps": 4,
            "gradient_checkpointing": True,
            "lora_dropout": 0.05,
            "mixed_precision": "bf16",
        },
        "tiny-llama",
        "cuda",
        "loop",
    ),
    "cpu-8bit-qwen2": (
        {**SMALL, "optimizer": "adamw-8bit"},
        "tiny-qwen2",
        "cpu",
        "loop",
    ),  # q/k/v biases cast
    # Qwen3-VL's DeepStack adds to the output of its first 3 text layers: layers 0..4 run, 5 and 6 priced from 4
    "sft-qwen3-vl-deepstack": (VLM_ROWS, "vlm/tiny-qwen3-vl:deepstack", "cpu", "sft"),
    # the micro-batches' case: packing, checkpointing, dropout, through SFTTrainer
    "sft-checkpointing-packing-ga3": (
        MICRO_BATCH_CASES["sft-checkpointing-packing-ga3"],
        "tiny-llama",
        "cuda",
        "sft",
    ),
}
SLOW_CASES: dict[str, Case] = {
    "llama-fp32": (SMALL, "tiny-llama", "cuda", "loop"),
    "padding-free-packing-ga3": (
        {"seq_len": 48, "batch": 2, "gradient_accumulation_steps": 3, "padding_free": True, "packing": True},
        "tiny-llama",
        "cuda",
        "loop",
    ),
    "wide-mlp-checkpointing": (
        {"seq_len": 64, "batch": 2, "gradient_checkpointing": True},
        WIDE,
        "cuda",
        "loop",
    ),
    "mistral-checkpointing-fused": (
        {**SMALL, "gradient_checkpointing": True, "optimizer": "adamw-fused"},
        "tiny-mistral",
        "cuda",
        "loop",
    ),
    "qwen2-bf16-all-linear-ga3": (
        {
            **SMALL,
            "mixed_precision": "bf16",
            "target_modules": "all-linear",
            "gradient_accumulation_steps": 3,
        },
        "tiny-qwen2",
        "cuda",
        "loop",
    ),
    "phi3-checkpointing-8bit": (
        {**SMALL, "gradient_checkpointing": True, "optimizer": "paged-adamw-8bit"},
        "tiny-phi3",
        "cuda",
        "loop",
    ),
    "sft": (SMALL, "tiny-llama", "cuda", "sft"),
    "qwen2.5-vl-images": (VLM_ROWS, "vlm/tiny-qwen2.5-vl", "cuda", "loop"),
    "llava-images": (VLM_ROWS, "vlm/tiny-llava", "cpu", "loop"),
    "sft-idefics3-images": (VLM_ROWS, "vlm/tiny-idefics3", "cpu", "sft"),
    "sft-bf16-8bit-ga3": (
        {
            **SMALL,
            "gradient_accumulation_steps": 3,
            "mixed_precision": "bf16",
            "optimizer": "paged-adamw-8bit",
        },
        "tiny-llama",
        "cuda",
        "sft",
    ),
}


def deep(tmp_path: Path, preset: str, layers: int = LAYERS) -> str:
    """A config.json of ``preset`` (``WIDE``: see it; ``vlm/NAME``: fixtures/configs/vlm/NAME.json, its text
    model's layers; ``:deepstack``: a Qwen3-VL tower of 3 blocks, each giving DeepStack's embedding to one of the
    first 3 text layers, as the 8B's does) with ``layers`` decoder layers."""
    name, _, variant = preset.partition(":")
    if name.startswith("vlm/"):
        config = json.loads((VLM / f"{name[4:]}.json").read_text())
        text = config["text_config"]
    else:
        config = text = json.loads(presets()[name].read_text())
    text["num_hidden_layers"] = layers
    if variant == "wide":
        text["intermediate_size"] = 4096
    if variant == "deepstack":
        config["vision_config"].update(depth=3, deepstack_visual_indexes=[0, 1, 2])
    text.pop("layer_types", None)
    path = tmp_path / f"{name.replace('/', '-')}{variant}-{layers}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _document(report: Any) -> str:
    doc = report.to_dict()
    doc.pop("elapsed_s", None)
    return json.dumps(doc, sort_keys=True, default=str)


def _both_ways(monkeypatch: pytest.MonkeyPatch, estimate: Any) -> list[tuple[str, int]]:
    """(the report's document, decoder-layer forwards) of ``estimate()`` with every layer run, then priced."""
    out = []
    for full in (True, False):
        calls: list[int] = []

        def counted(module: Any, args: Any, _calls: list[int] = calls) -> None:
            if type(module).__name__.endswith("DecoderLayer") and torch.is_grad_enabled():
                _calls.append(1)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(counted)
        monkeypatch.setenv(ALL_LAYERS, "1" if full else "")
        try:
            out.append((_document(estimate()), len(calls)))
        finally:
            handle.remove()
    return out


def _case(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: Case) -> None:
    """The estimate of ``case`` (vramguard's loop, or TRL's SFTTrainer on meta) both ways: the same report, with
    4 of the 8 layers run in each forward, 6 after DeepStack's (a checkpointed one's recompute under no grad is
    not counted)."""
    from vramguard.estimate.run import run_estimate
    from vramguard.estimate.trainer import run_trainer_estimate

    fields, preset, target, trainer = case
    config = QLoRAConfig(model=deep(tmp_path, preset), **fields)

    def estimate() -> Any:
        if trainer == "loop":
            return run_estimate(config, steps=2, target=target)
        return run_trainer_estimate(config, trainer, steps=2, target=target)

    (full, full_calls), (priced, priced_calls) = _both_ways(monkeypatch, estimate)
    run = 6 if preset.endswith(":deepstack") else 4  # layers 0..4 and 7, else 0..2 and 7
    assert full_calls and priced_calls * LAYERS == full_calls * run
    assert priced == full


@pytest.mark.parametrize("case", list(CASES))
def test_layers_priced_from_one_equal_every_layer_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str
) -> None:
    _case(monkeypatch, tmp_path, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_more_layers_priced_from_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str) -> None:
    _case(monkeypatch, tmp_path, SLOW_CASES[case])


def _built(tmp_path: Path, preset: str, layers: int = LAYERS, **config: Any) -> Any:
    from vramguard.estimate.meta import build_meta

    q_config = QLoRAConfig(model=deep(tmp_path, preset, layers), **SMALL, **config).resolved()
    return build_meta(q_config, q_config.spec)


def test_only_identical_layers_of_a_deep_decoder_are_priced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Eligible: an 8-layer Llama; not: 7 layers, layers that differ (one with another LoRA rank, one with a
    tensor attribute of another shape, Gemma 2's sliding and full layers), a vision-language model's batch, an
    allocation log, a counter that cannot add, ``VRAMGUARD_ALL_LAYERS``."""
    monkeypatch.delenv(ALL_LAYERS, raising=False)
    q = _built(tmp_path, "tiny-llama")
    found = eligible(q, None, [])
    assert found is not None and found[0].endswith("model.layers") and len(found[1]) == LAYERS
    assert eligible(_built(tmp_path, "tiny-llama", 7), None, []) is None
    assert eligible(q, object(), []) is None  # an allocation log lists every storage
    assert eligible(q, None, [object()]) is None
    assert eligible(q, None, [None, {}]) is not None  # contexts that saw nothing
    monkeypatch.setenv(ALL_LAYERS, "1")
    assert eligible(q, None, []) is None
    monkeypatch.delenv(ALL_LAYERS)
    lora_a = found[1][5].self_attn.q_proj.lora_A["default"]
    rows, columns = lora_a.weight.shape
    lora_a.weight = torch.nn.Parameter(torch.empty(rows + 1, columns, device="meta"))
    assert signature(found[1][5]) != signature(found[1][4]) and eligible(q, None, []) is None
    mlp = found[1][5].mlp
    lora_a.weight = found[1][4].self_attn.q_proj.lora_A["default"].weight  # alike again
    assert eligible(q, None, []) is not None
    for layer in found[1]:  # a tensor kept as a plain attribute, not a buffer: its shape is the layer's
        layer.mlp.table = torch.empty(8, device="meta")
    assert eligible(q, None, []) is not None
    mlp.table = torch.empty(7, device="meta")
    assert signature(found[1][5]) != signature(found[1][4]) and eligible(q, None, []) is None
    gemma = _built(tmp_path, "tiny-gemma2")  # alternating sliding-window and full attention
    assert ghosts.decoder_of(gemma.model) is not None and eligible(gemma, None, []) is None


def test_shadowed_bytes_leave_with_their_storage() -> None:
    """The tracker's count of bytes no storage holds (:meth:`StorageTracker.add`): they raise the current
    count and the peak, leave when the storage they shadow is freed (not while it is ``held``), and an
    adopted storage is followed without being counted again."""
    tracker = StorageTracker("cpu")
    tracker.start()
    try:
        a = torch.empty(100, dtype=torch.uint8)
        b = torch.empty(10, dtype=torch.uint8)
        assert tracker.current() == 110
        marks = tracker.marks()
        c = torch.empty(7, dtype=torch.uint8)
        assert tracker.born_since(marks) == {c.untyped_storage()._cdata: 7}
        tracker.add(300, 500)
        assert (tracker.current(), tracker.peak()) == (417, 500)
        tracker.shadow(a.untyped_storage()._cdata, 200)
        tracker.shadow(b.untyped_storage()._cdata, 50)
        tracker.held = frozenset({b.untyped_storage()._cdata})
        del a
        assert tracker.current() == 417 - 100 - 200
        del b
        assert tracker.current() == 117 - 10  # held: its shadow leaves another way
        tracker.held = frozenset()
        with torch.utils._python_dispatch._disable_current_modes():
            d = torch.empty(40, dtype=torch.uint8)
        tracker.adopt(d.untyped_storage())
        assert tracker.current() == 107
        del d
        assert tracker.current() == 67
    finally:
        tracker.stop()


def _granite_swa(tmp_path: Path, theta: list[float]) -> str:
    """A 10-layer Granite SWA config.json (every layer full attention) with the per-layer RoPE theta ``theta``
    (0: a NoPE layer, which its decoder's loop gives no position embeddings by its index)."""
    pytest.importorskip("transformers.models.granite_swa")
    from transformers import GraniteSWAConfig

    config = GraniteSWAConfig(
        vocab_size=256,
        **DIMS,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        layer_types=["full_attention"] * LAYERS,
        layer_rope_theta=theta,
    )
    path = tmp_path / f"granite-swa-{len(set(theta))}.json"
    path.write_text(config.to_json_string())
    return str(path)


ROPE, NOPE = 10000.0, 0.0
SOME_NOPE = [ROPE, ROPE, ROPE, NOPE, NOPE, NOPE, NOPE, NOPE, NOPE, ROPE]


def test_a_loop_that_reads_per_layer_config_by_index_runs_every_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Granite SWA's loop (``for i, layer in enumerate(self.layers[: ...])``) gives layer i position
    embeddings by ``config.layer_rope_theta[i]``: its layers' modules are alike whatever the theta, so
    :func:`signature` cannot tell a NoPE layer, and with layers not run ``i`` counts the layers run (the last
    gets item 3). Alike thetas are priced from one; differing ones run every layer. Gemma 3n's loop indexes
    its per-layer inputs by ``i``: any use of the index but a config list's item runs every layer."""
    import inspect

    from transformers.models.gemma3n import modeling_gemma3n
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    monkeypatch.delenv(ALL_LAYERS, raising=False)

    def built(path: str) -> Any:
        from vramguard.estimate.meta import build_meta

        q_config = QLoRAConfig(model=path, **SMALL).resolved()
        return build_meta(q_config, q_config.spec)

    assert eligible(built(_granite_swa(tmp_path, [ROPE] * LAYERS)), None, []) is not None
    q = built(_granite_swa(tmp_path, SOME_NOPE))
    layers = ghosts.decoder_of(q.model)
    assert layers is not None
    assert signature(layers[1][3]) == signature(layers[1][2])  # a NoPE layer looks like a RoPE one
    assert eligible(q, None, []) is None
    assert ghosts._loop_reads(inspect.getsource(modeling_llama.LlamaModel.forward)) == (
        frozenset(),
        frozenset(),
    )
    qwen3_vl = inspect.getsource(modeling_qwen3_vl.Qwen3VLTextModel.forward)  # DeepStack's first layers
    assert ghosts._loop_reads(qwen3_vl) == (frozenset(), frozenset({"deepstack_visual_embeds"}))
    assert ghosts._loop_reads(inspect.getsource(modeling_gemma3n.Gemma3nTextModel.forward)) is None


def test_a_deepstack_loop_without_a_vision_config_runs_every_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Cohere Compass's text model (``cohere_compass_text``, a causal LM of its own) loops over its layers as
    Qwen3-VL's does, indexing ``deepstack_visual_embeds``, but its config has no vision config to tell how many
    leading layers that reaches: the step runs every layer (the estimate raised AttributeError)."""
    configuration = pytest.importorskip("transformers.models.cohere_compass.configuration_cohere_compass")
    from vramguard.estimate.meta import build_meta

    monkeypatch.delenv(ALL_LAYERS, raising=False)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    text = configuration.CohereCompassTextConfig(
        **DIMS,
        head_dim=16,
        vocab_size=1024,
        rope_parameters={"full_attention": rope, "sliding_attention": rope},
    )
    path = tmp_path / "cohere-compass-text.json"
    path.write_text(json.dumps(text.to_dict()))
    q_config = QLoRAConfig(model=str(path), **SMALL).resolved()
    q = build_meta(q_config, q_config.spec)
    assert ghosts.decoder_of(q.model) is not None  # its loop reads deepstack_visual_embeds[i]
    assert eligible(q, None, []) is None


@pytest.mark.slow
def test_nope_layers_report_equal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The Granite SWA model with NoPE layers: the same report both ways (priced from one, the rotary
    embedding's record listed 17 nodes saving it where running every layer lists 7)."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(model=_granite_swa(tmp_path, SOME_NOPE), seq_len=64, batch=2)
    (full, _), (priced, _) = _both_ways(monkeypatch, lambda: run_estimate(config, steps=2, target="cuda"))
    assert priced == full
