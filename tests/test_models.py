"""Model presets and configs (clear UsageErrors on bad input) and the real QLoRA build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import pytest
import torch

from vramguard.errors import UsageError
from vramguard.workload import models
from vramguard.workload.models import ModelSpec, QLoRAConfig, parse_dtype, presets

TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}


def _write(tmp_path: Path, data: Any, name: str = "m.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


# -- ModelSpec ------------------------------------------------------------------------------


REPO = Path(__file__).resolve().parents[1]


def test_presets_ship_inside_the_package() -> None:
    """One copy, inside the package: what a wheel installs is what the suites use."""
    package = Path(models.__file__).resolve().parent
    assert {"tiny-llama", "small-llama", "llama-1b-shape"} <= set(presets())
    assert all(p.parent == package / "presets" for p in presets().values())
    assert not (REPO / "fixtures" / "models").exists()  # no second copy to drift


def test_presets_are_every_json_in_the_presets_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preset added as ``presets/<name>.json`` is picked up by name, without code changes."""
    (tmp_path / "new-model.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1}))
    (tmp_path / "notes.txt").write_text("not a preset")
    monkeypatch.setattr(models, "PRESETS_DIR", tmp_path)
    assert set(presets()) == {"new-model"}
    assert ModelSpec.load("new-model").fields["num_hidden_layers"] == 1


def test_load_tiny_preset() -> None:
    spec = ModelSpec.load("tiny-llama")
    assert spec.name == "tiny-llama"
    assert spec.fields == TINY  # "description" and "architecture" are not Llama config keys
    assert spec.head_dim == 128 // 4


@pytest.mark.parametrize("name", ["small-llama", "llama-1b-shape"])
def test_load_other_presets(name: str) -> None:
    data = json.loads(presets()[name].read_text())
    spec = ModelSpec.load(name)
    assert spec.fields["hidden_size"] == data["hidden_size"]
    assert spec.head_dim == data["hidden_size"] // data["num_attention_heads"]
    assert spec.llama_config().num_key_value_heads == data["num_key_value_heads"]


def test_load_json_path_and_defaults(tmp_path: Path) -> None:
    data = {
        k: TINY[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
    }
    spec = ModelSpec.load(_write(tmp_path, {**data, "head_dim": 16, "unknown_key": 1}, "mine.json"))
    assert spec.name == "mine"
    assert spec.fields == {**data, "head_dim": 16, "num_key_value_heads": 4}  # kv heads default to heads
    assert spec.head_dim == 16
    cfg = spec.llama_config("eager")
    assert (cfg.hidden_size, cfg._attn_implementation) == (128, "eager")


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(
        UsageError, match=r"unknown model 'nope': use a preset \(.*tiny-llama.*\) or a JSON path"
    ):
        ModelSpec.load("nope")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"cannot read model config .*bad\.json"),
        ([1, 2], r"must be a JSON object"),
        ({**TINY, "architecture": "gpt2"}, r"architecture 'gpt2' is not supported \(only 'llama'\)"),
        (
            {"vocab_size": 10, "hidden_size": 8},
            r"lacks intermediate_size, num_attention_heads, num_hidden_layers",
        ),
        ({**TINY, "hidden_size": 0}, r"hidden_size must be a positive integer, got 0"),
        ({**TINY, "num_hidden_layers": 2.5}, r"num_hidden_layers must be a positive integer, got 2\.5"),
        ({**TINY, "vocab_size": "512"}, r"vocab_size must be a positive integer, got '512'"),
        ({**TINY, "num_attention_heads": True}, r"num_attention_heads must be a positive integer, got True"),
        ({**TINY, "hidden_size": 130}, r"hidden_size is not a multiple of num_attention_heads"),
    ],
)
def test_bad_model_configs_raise_usage_errors(tmp_path: Path, content: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ModelSpec.load(_write(tmp_path, content, "bad.json"))


def test_binary_model_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 4)  # not UTF-8: was a UnicodeDecodeError traceback
    with pytest.raises(UsageError, match=r"cannot read model config .*model\.safetensors: not UTF-8 text"):
        ModelSpec.load(path)


def test_deeply_nested_model_file_is_a_usage_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json")
    with pytest.raises(UsageError, match=r"cannot read model config .*deep\.json: JSON nested too deeply"):
        ModelSpec.load(path)


def test_a_number_too_long_to_read_is_a_usage_error(tmp_path: Path) -> None:
    """Python refuses to read an integer of over 4,300 digits: a ValueError traceback before (fuzzing)."""
    path = _write(tmp_path, '{"vocab_size": ' + "9" * 5000 + "}", "long.json")
    with pytest.raises(UsageError, match=r"cannot read model config .*long\.json: Exceeds the limit"):
        ModelSpec.load(path)


def test_a_pipe_is_read_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """``--model`` naming a FIFO nobody writes waited for ever (fuzzing): now it reads as empty, one line. A
    pipe with a writer (``--model <(cat config.json)``, ``/dev/stdin``) reads as any file; a named FIFO whose
    writer comes later reads as empty too (the price of not waiting)."""
    import os

    from test_run_config import release_a_reader_after

    fifo = tmp_path / "model.json"
    os.mkfifo(fifo)
    release_a_reader_after(fifo, 10)
    with pytest.raises(UsageError, match=r"cannot read model config .*model\.json: Expecting value"):
        ModelSpec.load(fifo)
    read_end, write_end = os.pipe()  # as bash's <(cat config.json): the writer holds its end from the start
    os.write(write_end, presets()["tiny-llama"].read_bytes())
    os.close(write_end)
    try:
        assert ModelSpec.load(Path(f"/dev/fd/{read_end}")).fields == ModelSpec.load("tiny-llama").fields
    finally:
        os.close(read_end)


def test_huge_model_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = _write(tmp_path, " " * (models.MAX_CONFIG_BYTES + 1), "huge.json")
    with pytest.raises(UsageError, match=r"huge\.json is over 1048576 bytes: not a JSON model config"):
        ModelSpec.load(path)


def test_missing_json_path(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"model config not found: .*absent\.json"):
        ModelSpec.load(tmp_path / "absent.json")


# -- QLoRAConfig ----------------------------------------------------------------------------


def test_default_config_is_valid() -> None:
    QLoRAConfig().validate()
    assert QLoRAConfig().to_dict()["model"] == "tiny-llama"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 0}, r"seq-len must be positive, got 0"),
        ({"batch": -1}, r"batch must be positive, got -1"),
        ({"lora_rank": 0}, r"lora-rank must be positive, got 0"),
        ({"batch": 10**29}, r"batch must be at most 2,147,483,647, got 1000000000"),  # a run config's value
        ({"batch": 10**400}, r"batch must be at most 2,147,483,647, got 1000000000"),  # past a float
        ({"lora_dropout": 1.0}, r"lora dropout must be in \[0, 1\), got 1\.0"),
        ({"lora_dropout": -0.1}, r"lora dropout must be in \[0, 1\)"),
        ({"compute_dtype": "int8"}, r"unknown dtype 'int8' \(choose from bf16, fp16, fp32\)"),
        ({"quant_type": "int4"}, r"quant type must be nf4 or fp4, got 'int4'"),
        (
            {"attn_implementation": "flash"},
            r"attention implementation must be one of sdpa, eager, flash_attention_2, got 'flash'",
        ),
        ({"device": "notadevice"}, r"not a device: 'notadevice'"),
        ({"device": "meta"}, r"device must be cpu or cuda, got 'meta'"),
        (
            {"seed": 2**70},
            r"seed must be in \[-2\*\*63, 2\*\*64 - 1\] \(torch's seed range\), got 1180591620",
        ),
        ({"seed": 2**64}, r"seed must be in .*, got 18446744073709551616"),
        ({"seed": -(2**63) - 1}, r"seed must be in .*, got -9223372036854775809"),
        ({"seed": 1.5}, r"seed must be an integer, got 1\.5"),
    ],
)
def test_bad_qlora_configs_raise_usage_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        QLoRAConfig(**change).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_without_cuda_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"device 'cuda' requested but CUDA is not available"):
        QLoRAConfig(device="cuda").validate()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("FP16", torch.float16),
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_parse_dtype(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype


# -- build_qlora ----------------------------------------------------------------------------

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _proj_shape(f: dict[str, Any], head_dim: int, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama projection."""
    h, i = f["hidden_size"], f["intermediate_size"]
    q, kv = f["num_attention_heads"] * head_dim, f["num_key_value_heads"] * head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[proj.rsplit(".", 1)[1]]


def test_build_qlora_wraps_4bit_layers_with_lora(tiny_qlora: Any) -> None:
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    q = tiny_qlora
    f, r = q.spec.fields, q.config.lora_rank
    modules = dict(q.model.named_modules())
    expected_trainable: dict[str, tuple[int, ...]] = {}
    for layer in range(f["num_hidden_layers"]):
        for proj in PROJECTIONS:
            name = f"base_model.model.model.layers.{layer}.{proj}"
            wrapper = modules[name]
            assert isinstance(wrapper, LoraLinear4bit), name
            base = wrapper.base_layer
            assert isinstance(base, bnb.nn.Linear4bit) and isinstance(base.weight, bnb.nn.Params4bit)
            in_f, out_f = _proj_shape(f, q.spec.head_dim, proj)
            assert base.weight.quant_state.shape == (out_f, in_f)
            assert base.weight.quant_state.quant_type == "nf4" and base.weight.quant_state.nested
            assert base.compute_dtype == torch.bfloat16
            assert not base.weight.requires_grad
            expected_trainable[f"{name}.lora_A.default.weight"] = (r, in_f)
            expected_trainable[f"{name}.lora_B.default.weight"] = (out_f, r)
    trainable = {n: tuple(p.shape) for n, p in q.model.named_parameters() if p.requires_grad}
    assert trainable == expected_trainable  # LoRA only: no norms, embeddings or lm_head
    per_layer = sum(r * (i + o) for i, o in (_proj_shape(f, q.spec.head_dim, p) for p in PROJECTIONS))
    assert sum(p.numel() for p in q.trainable_parameters()) == f["num_hidden_layers"] * per_layer
    assert all(p.dtype == torch.float32 for p in q.trainable_parameters())
    # lm_head is not quantized and everything not 4-bit was upcast to fp32 for training
    assert isinstance(modules["base_model.model.lm_head"], torch.nn.Linear)
    assert not isinstance(modules["base_model.model.lm_head"], bnb.nn.Linear4bit)
    assert modules["base_model.model.model.norm"].weight.dtype == torch.float32


def test_batch_is_deterministic(tiny_qlora: Any) -> None:
    q = tiny_qlora
    a, b, c = q.batch(0), q.batch(0), q.batch(1)
    assert a["input_ids"].shape == (q.config.batch, q.config.seq_len)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["input_ids"], a["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    assert int(a["input_ids"].max()) < q.spec.fields["vocab_size"]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), -1])
def test_every_seed_torch_accepts_gives_a_deterministic_batch(tiny_qlora: Any, seed: int) -> None:
    """The ends of torch's seed range are valid; the per-step token seed wraps modulo 2**64 (the
    two's complement torch applies to a negative seed, so small and negative seeds are unchanged)."""
    config = QLoRAConfig.from_dict({**tiny_qlora.config.to_dict(), "seed": seed})
    config.validate()
    q = models.QLoRAModel(model=tiny_qlora.model, spec=tiny_qlora.spec, config=config)
    a, b = q.batch(0), q.batch(1)
    assert torch.equal(a["input_ids"], q.batch(0)["input_ids"])
    assert not torch.equal(a["input_ids"], b["input_ids"])
    if seed == -1:
        g = torch.Generator().manual_seed(-1 * 1_000_003)
        expected = torch.randint(0, q.spec.fields["vocab_size"], (config.batch, config.seq_len), generator=g)
        assert torch.equal(a["input_ids"], expected)


# -- the wheel ------------------------------------------------------------------------------


def test_a_wheel_install_has_the_presets(tmp_path: Path) -> None:
    """``pip install .`` (not ``-e``): the installed package, away from the source tree, finds its
    presets and runs the audit, quietly (nothing on stderr, one line: library noise is hidden). The wheel
    is built from a copy of the sources without network or build isolation, and installed with
    ``--no-deps --target``: torch and the rest stay the environment's own."""
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VRAMGUARD_FIXTURES")}
    env["PIP_ROOT_USER_ACTION"] = "ignore"
    built = subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("vramguard-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert installed.returncode == 0, installed.stderr
    shutil.rmtree(src)  # nothing of the source tree is left to fall back on
    env["PYTHONPATH"] = str(site)  # before any editable install of the environment
    run = tmp_path / "elsewhere"
    run.mkdir()
    audited = subprocess.run(  # the installed console script, as a user runs it
        [
            str(site / "bin" / "vramguard"),
            "audit",
            "--seq-len",
            "8",
            "--batch",
            "1",
            "--steps",
            "2",
            "--quiet",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=run,
    )
    assert audited.returncode == 0, audited.stderr
    # what the libraries log (bitsandbytes' kernels-community line) stays out of a quiet run: one line
    assert audited.stderr == ""
    assert audited.stdout.startswith("OK: ") and len(audited.stdout.splitlines()) == 1, audited.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vramguard, vramguard.workload.models as m; print(vramguard.__file__, m.presets()['tiny-llama'])",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=run,
    )
    assert probe.returncode == 0, probe.stderr
    module, preset = probe.stdout.split()
    assert Path(module).is_relative_to(site) and Path(preset).is_relative_to(
        site / "vramguard" / "workload" / "presets"
    )
    shipped = {n.rsplit("/", 1)[1] for n in zipfile.ZipFile(wheel).namelist() if "/presets/" in n}
    assert shipped == {p.name for p in presets().values()}


def test_a_config_reads_back_from_its_document_with_the_step_options() -> None:
    """Schema 1 keeps method, optimizer and offloading under ``extra`` (the estimate's only): they come back
    as the typed fields; a key that is no field (a trainer run's) is left out."""
    config = QLoRAConfig(method="lora", optimizer="adamw-8bit", offload_activations=True, seed=5)
    doc = config.to_dict(step_options=True)
    assert doc["extra"] == {"method": "lora", "optimizer": "adamw-8bit", "offload_activations": True}
    assert QLoRAConfig.from_dict({**doc, "trainer": "sft"}) == config
    assert QLoRAConfig().to_dict()["extra"] == {}
