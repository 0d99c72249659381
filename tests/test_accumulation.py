"""Trainer's gradient accumulation (``gradient_accumulation_steps``, ``--gradient-accumulation-steps``): a step
is k micro-batches, each a forward and a backward that adds into the gradients the earlier ones left, then one
optimizer step. What it costs is the whole gradient held through every micro-batch after the first."""

from __future__ import annotations

import pytest

from vramguard.audit.run import run_audit
from vramguard.cli import main
from vramguard.workload.models import QLoRAConfig, build_qlora


ROWS = 1 * 32 * 8  # one micro-batch of batch 1 x seq 32 int64 token ids
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _held(nbytes: int, device: str) -> int:
    """What a tensor of ``nbytes`` adds to the device's live bytes: on CUDA the caching allocator's block, rounded
    up to its 512 B granule (blocks under 1 MiB, the default ``PYTORCH_CUDA_ALLOC_CONF``: a 256 B row takes
    512 B there); on the host the bytes themselves."""
    return -(-nbytes // 512) * 512 if device == "cuda" else nbytes


def _on(device: str, **fields) -> QLoRAConfig:
    """The tests' tiny-llama step (batch 1 x seq 32) on ``device`` (the plugin skips a gpu test without CUDA)."""
    return QLoRAConfig(seq_len=32, batch=1, device=device, **fields)


def _parameters_of(preset: str) -> int:
    """The parameter count of the preset's plain transformers model (a config.json), built on meta."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramguard.workload.models import presets

    fields = json.loads(presets()[preset].read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _peaks(config: QLoRAConfig) -> dict[str, int]:
    report = run_audit(config, steps=2)
    return {name: phase.peak_bytes for name, phase in report.phases.items()}


@pytest.mark.parametrize(
    ("method", "device"), [("qlora", "cpu"), ("full", "cpu"), pytest.param("qlora", "cuda", marks=pytest.mark.gpu)]
)
def test_later_micro_batches_run_their_forward_with_the_whole_gradient_held(method: str, device: str) -> None:
    """The forward peak of a step of two micro-batches is the one-micro-batch peak plus every trainable
    parameter's gradient, counted from the model (numel x element size), not from the tracker, plus the second
    micro-batch's rows (made before the step, as Trainer fetches them: batch x seq int64 ids, the labels the
    same tensor); the optimizer step's peak by those rows only. On CUDA the same, read off the allocator."""
    base = _on(device)
    if method == "full":  # full fine-tuning on the host: the unquantized model, every parameter trained
        from vramguard.estimate.run import run_estimate

        base = QLoRAConfig(model="tiny-llama-hf", seq_len=32, batch=1)  # a plain config.json
        one = run_estimate(base, steps=2, method="full", device="cpu", target="cpu")
        two = run_estimate(
            QLoRAConfig(model="tiny-llama-hf", seq_len=32, batch=1, gradient_accumulation_steps=2),
            steps=2, method="full", device="cpu", target="cpu",
        )  # fmt: skip
        grads = 4 * _parameters_of(base.model)  # every parameter's fp32 gradient
        assert two.phases["forward"].peak_bytes - one.phases["forward"].peak_bytes == grads + ROWS
        assert two.phases["optimizer"].peak_bytes - one.phases["optimizer"].peak_bytes == ROWS
        return
    q = build_qlora(base)
    grads = sum(_held(p.numel() * p.element_size(), device) for p in q.trainable_parameters())
    del q
    one = _peaks(base)
    two = _peaks(_on(device, gradient_accumulation_steps=2))
    rows = _held(ROWS, device)
    assert two["forward"] - one["forward"] == grads + rows
    assert two["optimizer"] - one["optimizer"] == rows  # the rows are held through the step, as in Trainer
    assert two["backward"] > one["backward"]


def test_the_config_files_accumulation_is_priced_and_the_flag_overrides_it(tmp_path) -> None:
    """``gradient_accumulation_steps`` in a ``trl sft`` file reaches the step (the estimate's JSON records it and
    the forward peak moves), and ``--gradient-accumulation-steps`` overrides the file."""
    import json

    import yaml

    from vramguard.workload.models import presets

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": str(presets()["tiny-llama-hf"]), "per_device_train_batch_size": 1, "max_length": 32,
        "use_peft": True, "load_in_4bit": True, "gradient_checkpointing": False, "gradient_accumulation_steps": 3,
    }))  # fmt: skip
    forward = {}
    for flags in ([], ["--gradient-accumulation-steps", "1"]):
        out = tmp_path / f"e{len(flags)}.json"
        argv = ["estimate", "--config", str(path), "--target", "cpu", "--quiet", "--json", str(out), *flags]
        assert main(argv) == 0
        report = json.loads(out.read_text())
        forward[report["config"]["gradient_accumulation_steps"]] = report["phases"]["forward"]["peak_bytes"]
    assert sorted(forward) == [1, 3] and forward[3] > forward[1]


@pytest.mark.parametrize("device", DEVICES)
def test_the_real_trainer_holds_the_whole_gradient_as_the_loop_prices_it(tmp_path, device: str) -> None:
    """transformers' own Trainer with ``gradient_accumulation_steps=2`` (``audit --trainer trainer``, measured by
    VramGuardCallback) raises its forward peak as the loop does: by the LoRA gradients' bytes, counted from the
    model, and the second micro-batch it fetched before the step (``get_batch_samples``), whose collated
    ``input_ids`` and ``labels`` are two tensors there. On CUDA the same, read off the allocator (measured on an
    H200 at batch 2 x 128: +153,600 B = 149,504 B of gradients + 2 x 2,048 B of rows)."""
    from vramguard.integrations.trainer_audit import run_trainer_audit

    q = build_qlora(_on(device))
    grads = sum(_held(p.numel() * p.element_size(), device) for p in q.trainable_parameters())
    del q
    forward = {}
    for k in (1, 2):
        config = _on(device, gradient_accumulation_steps=k)
        report = run_trainer_audit(config, "trainer", tmp_path / f"run{k}", steps=2)
        forward[k] = report.phases["forward"].peak_bytes
    assert forward[2] - forward[1] == grads + 2 * _held(ROWS, device)


@pytest.mark.parametrize("sharding", ["fsdp2", "fsdp1"])
def test_each_rank_holds_the_whole_unsharded_gradient_between_micro_batches(sharding: str) -> None:
    """Across ranks Trainer's accumulation runs every micro-batch but the last under accelerate's ``no_sync``
    (FSDP2's ``set_requires_gradient_sync(False)``, FSDP1's ``no_sync()``): the engine keeps each rank's
    gradients unsharded until the last micro-batch reduces them. So rank 0's forward peak rises by the whole
    model's LoRA gradients, counted on the unsharded model, not by its 1/N shard (plus its second micro-batch's
    rows), under the fake process group on meta; the real gloo ranks are held to the same figures by
    ``tests/test_distributed.py``'s FSDP1 run."""
    from vramguard.estimate.distributed import run_distributed_estimate
    from vramguard.workload.sharding import ShardingConfig

    grads = sum(p.numel() * p.element_size() for p in build_qlora(QLoRAConfig()).trainable_parameters())
    forward = {}
    for k in (1, 2):
        report = run_distributed_estimate(
            QLoRAConfig(gradient_accumulation_steps=k), ShardingConfig(2, sharding), steps=2, target="cpu", ranks=[0]
        )
        forward[k] = report.phases["forward"].peak_bytes
    rows = QLoRAConfig().batch * QLoRAConfig().seq_len * 8  # batch 2 x seq 128 int64 ids
    assert forward[2] - forward[1] == grads + rows


def test_fit_offers_the_same_rows_a_step_in_micro_batches_that_fit(tmp_path) -> None:
    """``--fit`` for a batch that does not fit names, among its changes, the same rows a step in micro-batches
    of the largest batch that fits and divides them (batch 8 -> ``--batch 4 --gradient-accumulation-steps 2``),
    priced by its own meta run: the held gradients included, so its total is that configuration's estimate."""
    import json

    from vramguard.estimate.run import run_estimate

    def total(**changes: int) -> int:
        report = run_estimate(QLoRAConfig(seq_len=256, **changes), steps=2, target="cpu")
        return report.estimate.total_bytes

    four, eight = total(batch=4), total(batch=8)
    size = (four + eight) // 2  # batch 4 fits, batch 8 does not
    out = tmp_path / "fit.json"
    argv = ["estimate", "--seq-len", "256", "--batch", "8", "--target", "cpu", "--steps", "2", "--quiet"]
    argv += ["--trainer", "loop"]  # the loop's --fit, at the loop's defaults (total() above)
    assert main([*argv, "--fit", f"{size}B", "--json", str(out)]) == 1
    fit = json.loads(out.read_text())["estimate"]["fit"]
    assert 4 <= fit["largest"] < 8
    change = next(c for c in fit["changes"] if "--gradient-accumulation-steps" in c["change"])
    assert change["change"] == "--batch 4 --gradient-accumulation-steps 2"
    assert change["total_bytes"] == total(batch=4, gradient_accumulation_steps=2) > four


@pytest.mark.parametrize(
    ("batch", "steps", "largest", "offered"),
    [
        (8, 1, 5, "--batch 4 --gradient-accumulation-steps 2"),
        (7, 1, 4, "--batch 1 --gradient-accumulation-steps 7"),  # 7 rows a step: only micro-batches of 1 divide
        (8, 3, 5, "--batch 4 --gradient-accumulation-steps 6"),  # 24 rows a step, already accumulated
        (8, 1, 0, "--batch 1 --gradient-accumulation-steps 8"),  # none found to fit (or none searched): rows of 1
        (1, 4, 0, None),  # a batch of 1: nothing to split
    ],
)
def test_the_fit_option_keeps_the_rows_a_step(
    monkeypatch: pytest.MonkeyPatch, batch: int, steps: int, largest: int, offered: str | None
) -> None:
    """The micro-batch option keeps the rows a step (batch x micro-batches) exactly, in micro-batches no larger
    than the largest batch that fit (a stand-in estimator: this is the option's arithmetic, not its pricing;
    run in this process, where its calls are seen)."""
    from vramguard.estimate.fit import cheaper_changes
    from vramguard.estimate.workers import WORKERS

    monkeypatch.setenv(WORKERS, "1")

    seen = []

    def estimate(config: QLoRAConfig):
        seen.append(config)
        return 1

    config = QLoRAConfig(batch=batch, gradient_accumulation_steps=steps)
    changes = [c["change"] for c in cheaper_changes(config, 0, estimate, largest_batch=largest)]
    mine = [c for c in changes if "--gradient-accumulation-steps" in c and c.count("--") == 2]  # not in a pair
    assert mine == ([offered] if offered else [])
    for c in seen:
        if c.gradient_accumulation_steps != steps:
            assert c.batch * c.gradient_accumulation_steps == batch * steps and c.batch <= max(largest, 1)
