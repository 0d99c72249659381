"""Hugging Face ``config.json`` models: built as their own architecture, audited against their own
family's formula, or honestly without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vramguard.cli import main
from vramguard.measure.decoder import decoder_layer
from vramguard.measure.meters import SavedBytesMeter
from vramguard.model.analytic import activation_expectation
from vramguard.workload.families import FAMILIES, NoAnalyticModel
from vramguard.workload.models import presets
from vramguard.workload.models import ModelSpec

PRESETS = Path(__file__).resolve().parents[1] / "src" / "vramguard" / "workload" / "presets"
TINY = {
    "tiny-llama-hf": ("llama", "LlamaForCausalLM"),
    "tiny-mistral": ("mistral", "MistralForCausalLM"),
    "tiny-qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "tiny-qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "tiny-phi3": ("phi3", "Phi3ForCausalLM"),
    "tiny-gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "tiny-gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
FULL = ["llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "phi-3-mini-4k"]
SMALL_RUN = ["--seq-len", "24", "--batch", "2", "--steps", "2", "--quiet"]


def _audit(tmp_path: Path, model: str | Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "audit.json"
    code = main(["audit", "--model", str(model), *SMALL_RUN, *extra, "--json", str(out)])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("name", list(TINY))
def test_hf_config_is_audited_as_its_own_architecture_exactly(tmp_path: Path, name: str) -> None:
    """The acceptance: a plain Hugging Face config.json, exit 0, the architecture named, the
    analytic model of its family equal to the measurement to the byte (layer by layer)."""
    model_type, model_class = TINY[name]
    path = PRESETS / f"{name}.json"
    assert json.loads(path.read_text())["model_type"] == model_type  # a plain HF config file
    code, data = _audit(tmp_path, path)
    assert code == 0, data["verdict"]
    arch = data["architecture"]
    assert (arch["model_type"], arch["model_class"]) == (model_type, model_class)
    assert arch["analytic_model"] == FAMILIES[model_type].name
    b = data["budget"]
    assert b["measured_activation_bytes"] == b["analytic_activation_bytes"] == data["totals"]["saved_bytes"]
    assert b["activation_ratio"] == 1.0 and b["no_analytic_model"] is None
    assert len(data["layers"]) == 2
    assert all(row["saved_bytes"] == row["analytic_bytes"] for row in data["layers"])
    assert "100.0% of the analytic model" in data["verdict"]["line"]
    if model_type == "gemma2":  # no sdpa in transformers: eager, and the report says so
        assert arch["attn_implementation"] == "eager"
        assert any("no sdpa attention" in n for n in data["verdict"]["notes"])


#: a Hugging Face config.json of a family with no analytic model (OLMo 2: q/k norms over all heads)
UNKNOWN_FAMILY = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "tiny-olmo2.json"


def test_unknown_family_is_measured_without_a_ratio(tmp_path: Path) -> None:
    code, data = _audit(tmp_path, UNKNOWN_FAMILY)  # a user's config.json, as it comes
    assert code == 0
    assert data["architecture"]["model_class"] == "Olmo2ForCausalLM"
    assert data["architecture"]["analytic_model"] is None
    b = data["budget"]
    assert (
        b["measured_activation_bytes"] > 0 and b["measured_activation_bytes"] == data["totals"]["saved_bytes"]
    )
    assert b["activation_ratio"] is None and b["analytic_activation_bytes"] is None
    assert b["no_analytic_model"] == "no analytic model for olmo2"
    assert all(row["analytic_bytes"] is None for row in data["layers"]) and len(data["layers"]) == 2
    line = data["verdict"]["line"]
    assert "no analytic model for olmo2" in line and "%" not in line
    # the weights need no family formula: still counted exactly from the model's parameters
    assert b["analytic_weights_bytes"] > 0


def test_unknown_family_console_report_shows_no_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = json.loads(UNKNOWN_FAMILY.read_text())
    cfg.update(num_hidden_layers=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["audit", "--model", str(path), "--seq-len", "8", "--batch", "1", "--steps", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(olmo2, Olmo2ForCausalLM, sdpa attention)" in out
    assert "no analytic model for olmo2" in out and "% of the analytic model" not in out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "no-such-model"}, "model_type 'no-such-model' is not known to transformers"),
        ({"model_type": 3}, "model_type must be a non-empty string"),
        ({"model_type": "qwen2", "num_key_value_heads": 3}, "num_key_value_heads must be a positive divisor"),
        (
            {"model_type": "gemma2", "head_dim": 7},
            "RoPE requires an even rotary dimension",
        ),  # transformers' check
        # found by fuzzing: internal errors before
        ({"model_type": "llama", "num_key_value_heads": 0}, "num_key_value_heads must be a positive divisor"),
        ({"model_type": "llama", "hidden_act": "gelu2"}, "cannot build config: KeyError 'gelu2'"),
        ({"model_type": "llama", "quantization_config": "nf4"}, "cannot build config: AttributeError"),
        ({"model_type": "mixtral", "num_local_experts": 0}, "no experts to route each token's 2 to"),
        (
            {"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 5},
            "num_experts_per_tok must be between 1 and the 2 experts, got 5",
        ),
    ],
)
def test_refused_configs_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict, message: str
) -> None:
    shape = {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**shape, **config}))
    for command in ("audit", "estimate"):  # a real model on the host, and one on meta
        assert main([command, "--model", str(path), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_zero_experts_is_a_dense_model_where_transformers_reads_it_so(tmp_path: Path) -> None:
    """Qwen3-MoE with ``num_experts: 0`` builds dense layers in transformers: not refused as Mixtral's is
    (a first version of the experts check refused it; the reviewer's finding)."""
    from vramguard.workload.models import ModelSpec

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(presets()["tiny-qwen3-moe"].read_text()), "num_experts": 0}))
    assert ModelSpec.load(path).model_type == "qwen3_moe"


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, (4, 2, 352)),
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 96,
            },
            (4, 2, 96),
        ),
        ({"model_type": "qwen2"}, None),
    ],
)
def test_mixtures_of_experts_are_read_not_refused(
    tmp_path: Path, config: dict, experts: tuple | None
) -> None:
    """transformers keeps their experts as 3-D parameters bitsandbytes does not quantize: measured as they
    load (tests/test_moe.py), no longer refused."""
    from vramguard.workload.families import experts_of
    from vramguard.workload.models import ModelSpec

    shape = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**shape, "num_attention_heads": 4, "num_key_value_heads": 2, **config}))
    spec = ModelSpec.load(path)
    found = experts_of(spec.transformers_config())
    assert (found and (found.count, found.top_k, found.intermediate)) == experts


def test_presets_include_the_hf_configs() -> None:
    assert set(TINY) | set(FULL) <= set(presets())
    for name in [*TINY, *FULL]:
        spec = ModelSpec.load(name)
        assert (
            spec.hf is not None and spec.model_type == json.loads(presets()[name].read_text())["model_type"]
        )


@pytest.mark.parametrize("name", FULL)
def test_full_size_presets_estimate_without_weights(name: str) -> None:
    """The public full-size shapes: the analytic model from the config alone (nothing is built)."""
    spec = ModelSpec.load(name)
    attn = "eager" if spec.model_type == "gemma2" else "sdpa"
    b = activation_expectation(spec, batch=1, seq_len=2048, lora_rank=16, attn_implementation=attn)
    assert len(b.layer_bytes) == spec.fields["num_hidden_layers"]
    assert b.family == FAMILIES[spec.model_type].name
    # every layer keeps at least its MLP (4 x tokens x intermediate x fp32), layers past the first alike
    assert min(b.layer_bytes) >= 4 * 2048 * spec.fields["intermediate_size"] * 4
    assert len(set(b.layer_bytes[1:])) <= 2  # global/local layers at most


def test_soft_capped_attention_has_no_sdpa_formula() -> None:
    with pytest.raises(NoAnalyticModel, match="soft-capping under sdpa"):
        activation_expectation(
            ModelSpec.load("gemma-2-9b"), batch=1, seq_len=128, lora_rank=8, attn_implementation="sdpa"
        )


def test_sliding_window_shorter_than_seq_is_a_term_per_layer() -> None:
    spec = ModelSpec.load("phi-3-mini-4k")  # window 2047
    short, long = (
        activation_expectation(spec, batch=1, seq_len=s, lora_rank=8, attn_implementation="sdpa")
        for s in (2047, 2048)
    )
    assert "attn_window_mask" not in short.layer_terms[1]
    assert long.layer_terms[1]["attn_window_mask"] == 2048 * 2048 * 4
    assert all("attn_window_mask" in t for t in long.layer_terms)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Net(torch.nn.Module):  # like GPT-NeoX's GPTNeoXLayer: not named *DecoderLayer
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_per_layer_meter_and_ledger_use_one_rule() -> None:
    """The saved_bytes(per_layer=...) meter finds decoder layers by the same rule as the ledger's
    grouping (elements of a ModuleList called `layers`), whatever the layer class is called."""
    net = _Net()
    with SavedBytesMeter("cpu", per_layer=True) as meter:
        y = net(torch.randn(8, 16))
    assert set(meter.layer_peaks) == {"layers.0", "layers.1"}
    assert meter.layer_peaks["layers.0"] == 2 * 8 * 16 * 4  # its input and tanh's output
    assert {decoder_layer(n) for n, _ in net.named_modules()} == {None, "layers.0", "layers.1"}
    y.sum().backward()


def test_decoder_layer_is_the_outermost_layers_index() -> None:
    assert decoder_layer("model.layers.3.mlp.layers.1.lin") == "model.layers.3"


class _CastsItsBias(torch.nn.Module):
    """Like bitsandbytes' Linear4bit on its first call: the bias is cast to the input's dtype by
    replacing its storage, and here the old storage is then used (and kept) as an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(32, 32, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        old = self.bias.data
        self.bias.data = old.to(x.dtype)
        return (x.to(torch.bfloat16) * old).float() + self.bias  # the mul keeps `old` for backward


def test_a_storage_that_stopped_being_a_parameter_is_saved_not_resident() -> None:
    """Qwen2's q/k/v biases: the storage bitsandbytes frees on the first forward was sometimes reused
    by an activation, which the ledger then took for the bias and left out (24-40 KiB missing)."""
    from vramguard.measure.ledger import SavedTensorLedger

    m = _CastsItsBias()
    x = torch.randn(32, 32, requires_grad=True)
    with SavedTensorLedger(m) as ledger:
        y = m(x)
    kept = {(r.shape, r.dtype) for r in ledger.report.records}
    assert ((32, 32), "bfloat16") in kept and ledger.report.resident == []
    y.sum().backward()


@pytest.mark.parametrize(
    "device,act_bytes,heads,kv_heads,head_dim,mask,kernel",
    [
        ("cpu", 4, 32, 8, 64, False, "flash"),  # the CPU's flash kernel takes any dtype, fewer k/v heads
        ("cpu", 4, 32, 8, 64, True, "flash"),
        ("cuda", 2, 32, 8, 64, False, "flash"),  # bf16 GQA, no mask: flash with enable_gqa
        ("cuda", 4, 32, 8, 64, False, "math"),  # fp32: no flash; fewer k/v heads: no memory-efficient
        ("cuda", 4, 32, 32, 64, False, "efficient"),  # fp32, equal heads
        ("cuda", 2, 32, 32, 64, True, "efficient"),  # a mask: no flash (transformers repeated k/v)
        ("cuda", 2, 32, 8, 64, True, "math"),  # unequal heads with a mask: no fused kernel at all
        ("cuda", 2, 8, 8, 512, False, "efficient"),  # flash takes head dims up to 256
        ("cuda", 2, 32, 8, 100, False, "flash"),  # any head dim up to 256: torch pads it to 8
    ],
)
def test_sdpa_kernel_follows_torchs_rules(
    device: str, act_bytes: int, heads: int, kv_heads: int, head_dim: int, mask: bool, kernel: str
) -> None:
    """torch's CUDA rules. The fp32 GQA row is what an H100 did (docs/measurements/: flash "Expected
    query, key and value to all be of dtype: {Half, BFloat16}", memory-efficient "both fused kernels
    require query, key and value to have the same num_heads"); the others are read from torch's
    rules, not yet seen on a GPU."""
    from vramguard.model.layers import sdpa_kernel

    assert sdpa_kernel(device, act_bytes, heads, kv_heads, head_dim, mask) == kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_math_attention_keeps_what_the_formula_prices(dtype: torch.dtype) -> None:
    """torch's math composite (what CUDA runs for fp32 GQA attention) keeps q and k scaled, k and v
    repeated to all heads and the probabilities, and upcasts fp16/bf16 inputs to fp32 first (torch's
    default: no reduced-precision math sdpa), so those are fp32 whatever the activations' width."""
    from vramguard.model.layers import LayerShape, layer_terms

    b, a, kv, s, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for h in (a, kv, kv))
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, False, enable_gqa=True)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    got = sum(n for ptr, n in kept.items() if ptr not in inputs)
    shape = LayerShape(
        batch=b,
        seq=s,
        hidden=a * d,
        heads=a,
        kv_heads=kv,
        head_dim=d,
        intermediate=8,
        rank=1,
        act_bytes=dtype.itemsize,
        sdpa_kernel="math",
    )
    terms = layer_terms(shape)
    assert got == sum(
        terms[n] for n in ("attn_q(scaled)", "attn_k(repeated, scaled)", "attn_v(repeated)", "attn_probs")
    )


# Issue 43, item 4: architectures that failed (an internal error, or a config refused), made tiny with transformers'
# own config classes and written by its save_pretrained (Falcon-H1 and Granite 4 write time_step_limit's infinity
# as {"__float__": "Infinity"}).
TINY_SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
MAMBA = {"mamba_d_state": 16, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 16}
FAST_ESTIMATE = ["--target", "cpu", "--seq-len", "16", "--steps", "1", "--quiet"]
ALL_LINEAR = ["--target-modules", "all-linear"]


def _tiny_config(tmp_path: Path, kind: str) -> Path:
    import transformers

    configs = {
        "llama4_text": lambda: transformers.Llama4TextConfig(
            **TINY_SHAPE, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16
        ),
        "phimoe": lambda: transformers.PhimoeConfig(**TINY_SHAPE, num_local_experts=4, num_experts_per_tok=2),
        "falcon_h1": lambda: transformers.FalconH1Config(
            **TINY_SHAPE, **MAMBA, head_dim=16, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8
        ),
        "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
            **TINY_SHAPE,
            **MAMBA,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=8,
            mamba_d_head=16,
            shared_intermediate_size=128,
            layer_types=["mamba", "attention"],
        ),
    }
    folder = tmp_path / kind
    configs[kind]().save_pretrained(folder)
    return folder / "config.json"


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramguard: error: ") and err.count("\n") == 1 and "internal error" not in err, err
    return err


@pytest.mark.parametrize(("kind", "router"), [("llama4_text", "Llama4Router"), ("phimoe", "PhimoeTopKRouter")])
def test_a_router_returning_a_tuple_is_refused_with_the_targets_that_work(
    kind: str, router: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(_tiny_config(tmp_path, kind))
    # flags alone take trl sft's defaults: PEFT's default targets, which it has none of for this model type
    err = _refusal(capsys, ["estimate", "--model", model, *FAST_ESTIMATE])
    assert f"PEFT has no default targets for {kind}: pass --target-modules all-linear" in err, err
    for trainer in ("sft", "loop"):  # all-linear puts LoRA on the router in TRL's step and in the loop alike
        err = _refusal(capsys, ["estimate", "--model", model, *FAST_ESTIMATE, *ALL_LINEAR, "--trainer", trainer])
        assert f"PEFT cannot put LoRA on the experts' router 'router' ({router})" in err, err
    targets = err.split("--target-modules ")[1].split()[0]
    assert "q_proj" in targets.split(",") and "router" not in targets.split(",")
    with_targets = ["estimate", "--model", model, *FAST_ESTIMATE, "--target-modules", targets]
    assert main([*with_targets, "--trainer", "loop"]) == 0
    # TRL 1.16's own step then fails on both in its fused loss, as the user's trl sft run would: one line
    err = _refusal(capsys, [*with_targets, "--trainer", "sft"])
    assert "as a `trl sft` run of it would: AttributeError" in err, err


def test_falcon_h1_reads_its_config_and_names_the_targets_peft_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _tiny_config(tmp_path, "falcon_h1")
    assert '"__float__": "Infinity"' in model.read_text()
    for trainer in ("sft", "loop"):
        err = _refusal(capsys, ["estimate", "--model", str(model), *FAST_ESTIMATE, *ALL_LINEAR, "--trainer", trainer])
        assert "PEFT refuses LoRA on the Mamba mixer's out_proj and conv1d in falcon_h1 models" in err, err
    targets = err.split("--target-modules ")[1].split()[0]
    assert "in_proj" in targets.split(",") and "out_proj" not in targets.split(",")
    assert main(["estimate", "--model", str(model), *FAST_ESTIMATE, "--target-modules", targets]) == 0
    code, doc = _audit(tmp_path, model, "--target-modules", targets)
    assert code == 0 and doc["config"]["target_modules"] == targets


def test_granite_4_reads_its_config_and_is_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _tiny_config(tmp_path, "granitemoehybrid")
    assert '"__float__": "Infinity"' in model.read_text()
    assert main(["estimate", "--model", str(model), *FAST_ESTIMATE, *ALL_LINEAR, "--trainer", "loop"]) == 0
    # TRL 1.16's own step reads config.num_experts for the MoE auxiliary loss, which Granite 4's config lacks
    err = _refusal(capsys, ["estimate", "--model", str(model), *FAST_ESTIMATE, *ALL_LINEAR, "--trainer", "sft"])
    assert "as a `trl sft` run of it would: AttributeError" in err and "router_aux_loss_coef: 0.0" in err, err
    code, doc = _audit(tmp_path, model)
    assert code == 0 and doc["architecture"]["model_type"] == "granitemoehybrid"
