"""``vramguard estimate``: a meta-device run equals the CPU audit's measurement to the byte.

The CPU audit (:func:`vramguard.audit.run_audit`) builds the model through ``from_pretrained`` and
trains it on real tensors; the estimate builds it on meta and trains on shapes. Everything both
count above the model's weights (saved bytes per record and per layer, peaks per phase, bytes
retained after each step) and the weights themselves must be equal, not close.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vramguard.audit.run import run_audit
from vramguard.cli import main
from vramguard.step.report import AuditReport
from vramguard.workload.models import QLoRAConfig, build_qlora, parse_dtype, presets

STEPS = 2


def _records(report: AuditReport) -> list[dict[str, Any]]:
    keep = (
        "module",
        "node",
        "shape",
        "dtype",
        "bytes",
        "source",
        "kind",
        "attribute",
        "owner",
        "also_saved_by",
    )
    return sorted(
        (tuple((k, json.dumps(r[k])) for k in keep) for r in report.records),
    )


def _above_weights(report: AuditReport) -> dict[str, Any]:
    """Everything the audit measures above the model's weights (and the weights), as plain data."""
    return {
        "layers": [
            (row.name, row.saved_bytes, row.activation_bytes, row.weight_copy_bytes) for row in report.layers
        ],
        "totals": report.totals,
        "phases": {k: (v.peak_bytes, v.peak_above_start) for k, v in report.phases.items()},
        "retained": [(s.retained_bytes, s.retained_after_forward, s.peak_bytes) for s in report.steps],
        "lora_training": report.budget.measured_lora_training_bytes,
        "weights": report.budget.measured_weights_bytes,
        "records": _records(report),
    }


VARIANTS = [
    pytest.param({"model": "tiny-llama"}, id="llama"),
    pytest.param({"model": "tiny-llama", "gradient_checkpointing": True}, id="llama-checkpointing"),
    pytest.param({"model": "tiny-qwen2"}, id="qwen2"),
    # the peak of this step is set in backward while MatMul4Bit's dequantized weight is alive: a meta
    # weight quantized as float32 made that copy twice the real one's size (+96,128 B)
    pytest.param({"model": "tiny-llama", "batch": 1, "seq_len": 32}, id="llama-b1-s32"),
    pytest.param({"model": "tiny-gemma2"}, id="gemma2-eager-sliding-window"),
    # Trainer's gradient accumulation: the second micro-batch runs with the first one's gradients held
    pytest.param(
        {"model": "tiny-llama", "batch": 1, "seq_len": 32, "gradient_accumulation_steps": 2}, id="llama-accumulation"
    ),
    pytest.param({"model": "tiny-phi3"}, id="phi3-fused", marks=pytest.mark.slow),
    pytest.param({"model": "tiny-qwen3"}, id="qwen3", marks=pytest.mark.slow),
    pytest.param({"model": "tiny-gemma3"}, id="gemma3", marks=pytest.mark.slow),
    pytest.param({"model": "tiny-mistral"}, id="mistral", marks=pytest.mark.slow),
    pytest.param(
        {"model": "tiny-llama", "batch": 1, "seq_len": 96, "lora_dropout": 0.1},
        id="llama-b1-dropout",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_meta_estimate_equals_the_cpu_audit_to_the_byte(variant: dict[str, Any]) -> None:
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(**{"seq_len": 64, "batch": 2, **variant})
    estimate = run_estimate(config, steps=STEPS, target="cpu")  # the CPU's kernels, as the audit
    audit = run_audit(config, steps=STEPS)
    assert estimate.device == "meta" and audit.device == "cpu"
    assert estimate.totals.saved_bytes > 0
    got, want = _above_weights(estimate), _above_weights(audit)
    for key in want:
        assert got[key] == want[key], key
    # the decisions were forced, not skipped: the mask branch ran once per forward
    assert estimate.estimate is not None
    assert estimate.estimate.forced_decisions["find_packed_sequence_indices"] == STEPS * config.gradient_accumulation_steps * (
        2 if variant["model"] in ("tiny-gemma2", "tiny-gemma3") else 1  # a full and a sliding-window mask
    )


def test_meta_weights_are_quantized_from_the_dtype_the_checkpoint_loads_in() -> None:
    """Every 4-bit weight's quant state records the dtype it was quantized from, and every dequantization
    (MatMul4Bit's backward, DoRA's weight norm) makes a weight of that dtype: on meta it must be the
    loaded checkpoint's (the compute dtype), as in the real build, not torch's default float32."""
    import bitsandbytes as bnb

    from vramguard.estimate.meta import build_meta

    for dtype in ("bf16", "fp16"):
        config = QLoRAConfig(seq_len=32, batch=1, compute_dtype=dtype)

        def dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
            return {
                n: m.weight.quant_state.dtype
                for n, m in model.named_modules()
                if isinstance(m, bnb.nn.Linear4bit)
            }

        meta, real = dtypes(build_meta(config).model), dtypes(build_qlora(config).model)
        assert meta and meta == real
        assert set(meta.values()) == {parse_dtype(dtype)}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "fsdp-recipe"])
def test_the_meta_build_has_the_real_builds_parameters(sharded: bool) -> None:
    """Every parameter of the meta build has the real build's name, shape, dtype and trainability, on one device
    and in the FSDP + QLoRA recipe, for a model whose linear layers have biases (Qwen2's q, k, v): the swapped-in
    4-bit layers' biases were float32 on meta where the real recipe loads them in the compute dtype, and FSDP1
    then refused to flatten the unit (an internal error)."""
    from vramguard.estimate.meta import build_meta

    def params(model: torch.nn.Module) -> dict[str, tuple]:
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}

    config = QLoRAConfig(model="tiny-qwen2", seq_len=40, batch=2)
    meta, real = (
        params(build_meta(config, sharded=sharded).model),
        params(build_qlora(config, sharded=sharded).model),
    )
    assert any(n.endswith("q_proj.base_layer.bias") for n in real)
    assert meta == real


def test_without_the_forced_mask_decision_meta_cannot_run() -> None:
    """The obstacle the estimate works around: transformers' mask creation calls ``.item()``."""
    from vramguard.estimate.meta import build_meta
    from vramguard.measure.tracker import MemoryTracker
    from vramguard.workload.training import make_optimizer, train_step

    q = build_meta(QLoRAConfig(seq_len=32, batch=1))
    with (
        pytest.raises((RuntimeError, NotImplementedError), match="meta|item|data"),
        MemoryTracker("meta", model=q.model) as tracker,
    ):
        train_step(q, make_optimizer(q), tracker, 0)


def test_attention_saves_what_the_fused_cpu_kernel_saves() -> None:
    """On meta, torch's sdpa always takes the math path and keeps the b x h x s x s attention
    matrix; the estimate must take the fused kernel a device takes (output + logsumexp)."""
    from vramguard.estimate.run import run_estimate

    report = run_estimate(QLoRAConfig(seq_len=128, batch=2), steps=1, target="cpu")
    per_layer = [r for r in report.records if ".layers.1.self_attn" in r["module"]]
    b, h, s = 2, 4, 128
    assert not any(r["shape"] == [b, h, s, s] for r in per_layer), "the attention matrix was saved"
    assert any(r["shape"] == [b, h, s] and r["dtype"] == "float32" for r in per_layer), "no logsumexp"


def test_full_size_config_runs_on_meta_without_allocating(tmp_path: Path) -> None:
    """A 4096-wide, 2-layer cut of Llama-3.1-8B at seq 4096: the host allocates nothing of its size."""
    import resource

    from vramguard.estimate.run import run_estimate

    data = json.loads(presets()["llama-3.1-8b"].read_text())
    data["num_hidden_layers"] = 2
    cfg = tmp_path / "llama-8b-2layers.json"
    cfg.write_text(json.dumps(data))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = run_estimate(QLoRAConfig(model=str(cfg), seq_len=4096, batch=4, lora_rank=16), steps=1)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    est = report.estimate
    assert est is not None
    # fp32 logits alone: 4 x 4096 x 128256 x 4 B = 7.8 GiB; on the host the run grew by far less
    assert report.totals.outside_layers_bytes > 4 * 4096 * 128256 * 4
    assert grown_kib < 1 << 20  # < 1 GiB
    assert est.allocator_peak_bytes == est.weights_bytes + est.trainable_bytes + est.step_peak_bytes
    assert est.total_bytes == est.allocator_peak_bytes + sum(o.bytes for o in est.overheads)


def test_cli_json_is_the_audit_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "estimate.json"
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", "32", "--batch", "1", "--json", str(out)]
    code = main([*argv, "--verbose"])  # every table: the overheads' among them
    assert code == 0
    text = capsys.readouterr().out
    assert "vramguard estimate tiny-llama" in text and "cuBLAS workspace" in text
    doc = json.loads(out.read_text())
    report = AuditReport.from_dict(doc)
    assert report.device == "meta"
    assert report.estimate is not None and report.estimate.overheads
    assert [s["loss"] for s in doc["steps"]] == [None, None]  # no values on meta, and valid JSON
    assert report.verdict.line.startswith("estimate: ")


def test_audit_json_still_round_trips_without_an_estimate() -> None:
    config = QLoRAConfig(seq_len=16, batch=1)
    report = run_audit(config, steps=1)
    assert report.estimate is None
    assert AuditReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--seq-len", "0"], "must be positive"),
        (["--dtype", "int3"], "unknown dtype"),
        # past torch's 64-bit sizes: was an internal error from torch.empty (fuzzing)
        (["--seq-len", str(10**29)], "must be at most 2,147,483,647"),
        (["--lora-rank", str(2**31)], "must be at most 2,147,483,647"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_unknown_model_type_and_rejected_config_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no-such-arch", "hidden_size": 64}))
    rejected = tmp_path / "rejected.json"
    data = json.loads(presets()["tiny-qwen2"].read_text())
    data["num_attention_heads"] = 3  # hidden 128 is no multiple of 3 heads
    rejected.write_text(json.dumps(data))
    for path in (unknown, rejected):
        assert main(["estimate", "--model", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vramguard: error: ") and err.count("\n") == 1, err


def test_a_models_path_is_printed_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The header names the ``--model`` file as given: read as rich markup, ``[b]`` turned the rest bold and
    vanished, and ``[/]`` (a folder ending in ``[``) made the estimate an internal error after its run."""
    folder = tmp_path / "models[/]x"  # the folders "models[" and "]x"
    folder.mkdir(parents=True)
    path = folder / "[b]tiny.json"
    path.write_text(presets()["tiny-llama"].read_text())
    assert main(["estimate", "--model", str(path), "--seq-len", "8", "--batch", "1", "--target", "cpu"]) == 0
    unwrapped = "".join(capsys.readouterr().out.split())  # COLUMNS=80 under xdist wraps the header
    assert f"vramguardestimate{path}(llama" in unwrapped


def test_absurd_seq_len_is_answered_with_the_number(capsys: pytest.CaptureFixture[str]) -> None:
    """seq 10^9: one line, exit 2, with the estimate's figure; nothing of that size is allocated."""
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", str(10**9), "--batch", "1", "--trainer", "loop"]
    assert main([*argv, "--target", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "1,000,000,000" in err and "1,024 positions" in err and "would need" in err and "TiB" in err
    # on CUDA its fp32 GQA attention is the math composite: s x s probabilities, over 2^63 bytes
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1,024 positions" in err and "2^63 bytes" in err


def test_console_script_error_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramguard", "estimate", "--model", "nope"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_a_meta_build_leaves_real_quantization_working() -> None:
    """bitsandbytes caches its double-quantization code on the device of first use; a meta build
    must not leave it on meta (every later real 4-bit load in the process would fail)."""
    import bitsandbytes.functional as F
    import torch

    from vramguard.estimate.meta import build_meta

    F.name2qmap.pop("dynamic", None)  # as in a fresh process: the meta build is the first use
    build_meta(QLoRAConfig(seq_len=16, batch=1))
    packed, state = F.quantize_4bit(torch.randn(64, 64), quant_type="nf4", compress_statistics=True)
    assert packed.device.type == "cpu" and state.state2 is not None


def test_a_cpu_target_adds_no_gpu_overheads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--target cpu`` prices the step on the host's kernels: its total is the step's tensors (what the CPU audit
    measures), with none of an H100's CUDA context, cuBLAS workspaces or fragmentation allowance, and it says so;
    ``--target cuda`` of the same step adds them (it used to add them to both: 808 MiB on a 7 MiB step)."""
    from vramguard.cli import main

    totals = {}
    for target in ("cpu", "cuda"):
        out = tmp_path / f"{target}.json"
        page = tmp_path / f"{target}.html"
        argv = ["estimate", "--seq-len", "16", "--batch", "1", "--target", target, "--json", str(out)]
        assert main([*argv, "--html", str(page)]) == 0
        printed = capsys.readouterr().out
        assert ("host estimate" in page.read_text()) == (target == "cpu")
        assert ("CUDA context" in page.read_text()) == (target == "cuda")
        e = json.loads(out.read_text())["estimate"]
        assert e["target"] == target
        totals[target] = e
        if target == "cpu":
            assert e["overheads"] == [] and e["overhead_bytes"] == 0
            assert e["total_bytes"] == e["allocator_peak_bytes"]
            assert "of the host's memory" in printed and "CUDA context" not in printed
        else:
            assert {o["name"] for o in e["overheads"]} == {
                "CUDA context + kernels", "cuBLAS workspaces", "fragmentation allowance"
            }  # fmt: skip
            assert e["total_bytes"] == e["allocator_peak_bytes"] + e["overhead_bytes"] > e["allocator_peak_bytes"]


def test_on_a_cpu_target_offloaded_activations_stay_in_the_total_and_are_no_cheaper_change(tmp_path: Path) -> None:
    """Offloading moves saved activations to the host: on ``--target cpu`` that is the same memory, so the total
    keeps them (the offloading note's bytes, as the one overhead) and ``--fit`` never offers offloading as a
    change that would make a cpu step fit; on cuda it does."""
    from vramguard.cli import main

    base = ["estimate", "--seq-len", "16", "--batch", "1", "--quiet"]
    out = tmp_path / "offload.json"
    assert main([*base, "--target", "cpu", "--offload-activations", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    from vramguard.units import format_bytes

    e = report["estimate"]
    (offloaded,) = e["overheads"]
    assert offloaded["name"] == "activations offloaded to the host" and offloaded["bytes"] > 0
    note = next(n for n in report["verdict"]["notes"] if n.startswith("activations offloaded to the host"))
    assert f"at most {format_bytes(offloaded['bytes'])} of host memory at once, in the total" in note
    assert e["total_bytes"] == e["allocator_peak_bytes"] + offloaded["bytes"]
    # what --fit tries on each target, in vramguard's loop (which prices offloading; trl sft's step does not yet):
    # the offers alone are what this test is about, each change a meta run in a real --fit (that --fit prints
    # the offer on cuda, with its figure: test_fit_on_meta_is_right_at_the_border_and_names_cheaper_changes)
    from vramguard.estimate.fit import single_changes
    from vramguard.step.technique import Place

    config = QLoRAConfig(seq_len=16, batch=1)
    offered = {
        target: [flag for flag, _ in single_changes(config, 0, Place(target, trainer="loop"), "")]
        for target in ("cuda", "cpu")
    }
    assert "--offload-activations" in offered["cuda"] and "--offload-activations" not in offered["cpu"]
    assert offered["cpu"]  # other changes are offered there


@pytest.mark.parametrize("method", ["lora", "full", "full-bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_lora_and_full_on_meta_equal_the_same_run_on_cpu(method: str, checkpointing: bool) -> None:
    """``--method lora`` (bf16 base) and ``full`` (every parameter trained, in fp32 or, ``--full-dtype bf16``,
    in bf16 as TRL trains a model loaded in bf16): the meta run equals the same build and step on real CPU
    tensors, to the byte."""
    from vramguard.estimate.run import run_estimate

    method, _, dtype = method.partition("-")
    config = QLoRAConfig(seq_len=64, batch=2, gradient_checkpointing=checkpointing)
    if dtype:
        config = dataclasses.replace(config, method=method, full_dtype=dtype)
    meta = run_estimate(config, steps=STEPS, method=method, target="cpu")
    cpu = run_estimate(config, steps=STEPS, method=method, device="cpu", target="cpu")
    assert (meta.device, cpu.device) == ("meta", "cpu")
    got, want = _above_weights(meta), _above_weights(cpu)
    for key in want:
        assert got[key] == want[key], key
    assert meta.estimate == dataclasses.replace(cpu.estimate, forced_decisions=meta.estimate.forced_decisions)
    if (
        method == "full"
    ):  # the textbook's 16 (fp32) or 8 (bf16) bytes per parameter, plus Adam's fp32 step counters
        from vramguard.estimate.meta import build_meta

        tensors = list(build_meta(config, method="full").model.parameters())
        n = sum(t.numel() for t in tensors)
        assert meta.budget.lora_params == n
        per_param = 8 if dtype == "bf16" else 16
        assert meta.budget.measured_lora_training_bytes == per_param * n + 4 * len(tensors)
        assert {t.dtype for t in tensors} == {torch.bfloat16 if dtype else torch.float32}


def test_full_dtype_belongs_to_the_full_method() -> None:
    """``--full-dtype`` names the dtype full fine-tuning trains in; with LoRA or QLoRA it would be ignored, so
    it is refused in one line."""
    from vramguard.errors import UsageError

    with pytest.raises(UsageError, match="full-dtype bf16 is the dtype of --method full"):
        QLoRAConfig(full_dtype="bf16").validate()
    QLoRAConfig(method="full", full_dtype="bf16").validate()
    with pytest.raises(UsageError):
        QLoRAConfig(method="full", full_dtype="int8").validate()


class _Fake:
    """An estimator of known totals (bytes as a function of batch), counting its calls."""

    def __init__(self, total: Any) -> None:
        self.total = total
        self.calls: list[int] = []

    def __call__(self, config: QLoRAConfig) -> int:
        self.calls.append(config.batch)
        return self.total(config.batch)


FIT_SHAPES = {
    "linear": lambda b: 100 + 10 * b,  # the line is right: four runs
    "batch1-special": lambda b: 100 + 10 * b + (5 if b == 1 else 0),  # the loss's batch-1 special case
    "quadratic": lambda b: 100 + b * b,  # eager attention along seq
    "steps": lambda b: 100 + 10 * b + (b // 7) * 50,
    "cubic": lambda b: 100 + b**3 // 1000,
    "sqrt": lambda b: 100 + int(1000 * b**0.5),  # concave: the line through far points overshoots
    "flat-then-steep": lambda b: 100 + (0 if b < 300 else (b - 300) * 10**6),
    "overflow-above-900": lambda b: None if b > 900 else 100 + 10 * b,  # beyond torch: None
}


class _Fake:
    """An estimator of known totals (bytes as a function of batch), counting its calls; a total of
    None is a step torch cannot describe (``TooLarge``, as run_estimate raises)."""

    def __init__(self, total: Any) -> None:
        self.total = total
        self.calls: list[int] = []

    def __call__(self, config: QLoRAConfig) -> int:
        from vramguard.estimate.run import TooLarge

        self.calls.append(config.batch)
        total = self.total(config.batch)
        if total is None:
            raise TooLarge("beyond 2^63 bytes")
        return total


@pytest.mark.parametrize("shape", list(FIT_SHAPES))
@pytest.mark.parametrize("limit", [1, 2, 3, 100, 1000, 4096, 131072, 1 << 20])
@pytest.mark.parametrize("size", [99, 110, 115, 120, 1000, 5000, 10**6, 10**9, 10**18])
def test_fit_search_finds_the_largest_that_fits_within_the_bound(shape: str, limit: int, size: int) -> None:
    """The issue's bound, ceil(log2(range)) + 2 meta runs, over every shape, limit and size."""
    import math

    from vramguard.estimate.fit import run_bound, search

    total = FIT_SHAPES[shape]
    fake = _Fake(total)
    fit = search(QLoRAConfig(), size, fake, limit=limit)

    def fits(b: int) -> bool:
        t = total(b)
        return t is not None and t <= size

    want = max((b for b in range(1, limit + 1) if fits(b)), default=0) if limit <= 5000 else None
    if want is None:  # large limits: the answer is monotone's border, checked at its two sides
        assert fit.largest == 0 or fits(fit.largest)
        assert fit.largest == limit or not fits(fit.largest + 1)
    else:
        assert fit.largest == want
    assert fit.run_count == len(fake.calls) == len(set(fake.calls))
    assert fit.run_count <= fit.bound == run_bound(limit) == math.ceil(math.log2(limit)) + 2
    if shape == "linear" and limit > 2:
        assert fit.run_count <= 4  # two bisections, the line's answer, one above it


@pytest.mark.parametrize("shape", ["linear", "quadratic", "steps"])
@pytest.mark.parametrize("requested", [1, 3, 40, 5000])
@pytest.mark.parametrize("size", [105, 1000, 10**6])
def test_fit_search_reuses_the_requested_shape(shape: str, requested: int, size: int) -> None:
    """The requested shape's estimate is a measured value the search does not run again."""
    from vramguard.estimate.fit import search

    total = FIT_SHAPES[shape]
    plain = search(QLoRAConfig(), size, _Fake(total), limit=4096)
    fake = _Fake(total)
    reused = search(QLoRAConfig(), size, fake, limit=4096, known={requested: total(requested)})
    assert reused.largest == plain.largest
    assert requested not in fake.calls and reused.run_count == len(fake.calls) <= reused.bound
    if requested == 1 and total(1) > size:
        assert reused.run_count == 0  # not even batch 1: nothing to search


def test_fit_on_meta_is_right_at_the_border_and_names_cheaper_changes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vramguard.estimate.run import run_estimate

    base = ["estimate", "--model", "tiny-llama", "--seq-len", "64", "--steps", "2", "--trainer", "loop"]
    at = {b: run_estimate(QLoRAConfig(seq_len=64, batch=b), steps=2).estimate.total_bytes for b in (3, 4)}
    size = (at[3] + at[4]) // 2  # batch 3 fits, batch 4 does not
    assert (
        main([*base, "--batch", "8", "--fit", f"{size}B", "--quiet"]) == 1
    )  # the requested shape does not fit
    out = capsys.readouterr().out
    assert "the largest batch that fits" in out and " is 3 (" in out
    # the search's own count, within the bound over [1, 2^20]: ceil(log2(2^20)) + 2 = 22
    runs = int(out.split(" is 3 (", 1)[1].split(" meta runs", 1)[0])
    assert runs <= 22 and "at most 22)" in out
    assert "--gradient-checkpointing:" in out
    assert "--optimizer adamw-8bit:" in out and "--offload-activations:" in out  # each with its figure
    assert main([*base, "--batch", "2", "--fit", f"{size}B", "--quiet"]) == 0


def test_fit_with_a_bad_size_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--fit", "lots"]) == 2
    err = capsys.readouterr().err
    assert "not a size" in err and err.count("\n") == 1


def test_fit_without_a_unit_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--fit 24`` had meant 24 bytes ("not even batch 1 fits in 24 B"), after a whole search."""
    assert main(["estimate", "--fit", "24"]) == 2
    err = capsys.readouterr().err
    assert err == "vramguard: error: '24' has no unit: say e.g. '24GiB' (binary, 2^30) or '24GB' (SI, 10^9)\n"


def test_adamw_8bit_on_meta_equals_the_same_run_on_cpu() -> None:
    """bitsandbytes' AdamW8bit runs on meta; its state and the optimizer phase equal the CPU run's."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=64, batch=2)
    meta = run_estimate(config, steps=STEPS, method="lora", optimizer="adamw-8bit", target="cpu")
    cpu = run_estimate(config, steps=STEPS, method="lora", optimizer="adamw-8bit", device="cpu")
    got, want = _above_weights(meta), _above_weights(cpu)
    for key in want:
        assert got[key] == want[key], key
    assert meta.config["extra"] == {"method": "lora", "optimizer": "adamw-8bit"}


def test_adamw_8bit_estimate_for_the_cpu_equals_the_audit_where_lora_gets_8bit_state() -> None:
    """bitsandbytes gives 8-bit state only to parameters of at least 4,096 elements (``min_8bit_size``; smaller
    ones get fp32 state, as every LoRA weight of the test above at rank 8), and moves its two quantization maps,
    made on the host when the optimizer is built, to the parameters' device at the first step. The CPU needs no
    copy; the meta run made one (2 KiB in every phase) until the ``cpu`` target moved them before the step."""
    from vramguard.audit.run import run_audit
    from vramguard.estimate.meta import build_meta
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=32, batch=1, lora_rank=64, optimizer="adamw-8bit")
    assert max(p.numel() for p in build_meta(config).trainable_parameters()) >= 4096  # the 8-bit path runs
    estimate = run_estimate(config, steps=STEPS, target="cpu")
    audit = run_audit(config, steps=STEPS)
    assert {k: v.peak_bytes for k, v in estimate.phases.items()} == {
        k: v.peak_bytes for k, v in audit.phases.items()
    }
    assert estimate.totals == audit.totals


def test_adamw_for_a_cuda_target_steps_as_cudas_foreach_and_fused_as_its_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's AdamW picks its implementation by the parameters' device: ``foreach`` on CUDA, whose step makes
    ``sqrt(exp_avg_sq)`` of every parameter at once (measured on an H200: the optimizer phase rises by the
    trainable bytes, docs/measurements/2026-11-27-h200-blog13b), the single-tensor loop on the CPU. The meta
    run for ``target="cuda"`` takes CUDA's choice; a real CPU step forced to foreach (the same kernels' memory)
    is the reference, byte for byte. ``adamw-fused`` (TrainingArguments' default) makes no temporary on either
    device: its estimate equals the CPU audit's fused step for both targets."""
    import vramguard.audit.run as audit_run
    from vramguard.estimate.run import run_estimate
    from vramguard.workload.models import QLoRAModel

    config = QLoRAConfig(seq_len=32, batch=2)

    def optimizer_phase(report: AuditReport) -> int:
        return report.phases["optimizer"].peak_bytes

    cuda = run_estimate(config, steps=STEPS, target="cuda")
    cpu = run_estimate(config, steps=STEPS, target="cpu")
    assert cuda.estimate is not None
    assert optimizer_phase(cpu) == optimizer_phase(run_audit(config, steps=STEPS))  # single-tensor on both

    def foreach(q: QLoRAModel, lr: float = 1e-4, name: str = "adamw") -> torch.optim.Optimizer:
        return torch.optim.AdamW(q.trainable_parameters(), lr=lr, foreach=True)

    with monkeypatch.context() as m:
        m.setattr(audit_run, "make_optimizer", foreach)
        assert optimizer_phase(cuda) == optimizer_phase(run_audit(config, steps=STEPS))
    assert optimizer_phase(cuda) > optimizer_phase(cpu)

    fused = dataclasses.replace(config, optimizer="adamw-fused")
    audit = run_audit(fused, steps=STEPS)
    assert isinstance(audit_run.make_optimizer(build_qlora(fused), name="adamw-fused"), torch.optim.AdamW)
    for target in ("cpu", "cuda"):
        assert optimizer_phase(run_estimate(fused, steps=STEPS, target=target)) == optimizer_phase(audit)
    assert optimizer_phase(audit) < optimizer_phase(cpu)  # no temporaries at all


def test_a_meta_block_inside_another_picks_the_optimizer_for_its_own_target() -> None:
    """``forced_decisions`` answers torch's choice of AdamW implementation for meta parameters as its target
    would (foreach for CUDA, the loop for the CPU), a block inside another for its own target, and leaves
    torch's own answer once it ends."""
    from torch.optim import optimizer

    from vramguard.estimate.meta import forced_decisions

    params = [torch.empty(3, device="meta")]

    def foreach() -> bool:
        return optimizer._default_to_fused_or_foreach(params, False)[1]

    assert not foreach()
    with forced_decisions("cuda"):
        assert foreach()
        with forced_decisions("cpu"):
            assert not foreach()
        assert foreach()
    assert not foreach()


def test_fit_on_cuda_offers_the_fused_adamw_where_the_foreach_step_sets_the_peak() -> None:
    """Full fine-tuning's optimizer step is its peak; on CUDA torch's default AdamW (foreach) adds a temporary
    as large as the parameters there, which ``--optimizer adamw-fused`` does not make: one of the cheaper
    changes ``--fit`` names, with its own total, its optimizer step smaller by exactly the trainable bytes. Not
    offered for the CPU, where AdamW already steps one parameter at a time, nor where another phase peaks."""
    from vramguard.estimate.fit import cheaper_changes
    from vramguard.estimate.run import run_estimate
    from vramguard.step.technique import Place

    config = QLoRAConfig(seq_len=32, batch=2, method="full")
    report = run_estimate(config, steps=STEPS, target="cuda")
    base = report.estimate
    assert base is not None and base.peak_phase == "optimizer"

    fused = run_estimate(dataclasses.replace(config, optimizer="adamw-fused"), steps=STEPS, target="cuda")
    assert fused.estimate is not None

    def on_cuda(changed: QLoRAConfig) -> int:
        """The fused optimizer's row priced by its own meta run (the one row read here: --fit's other rows are
        priced the same way in the command-line tests), every other change a stand-in."""
        if changed.optimizer != "adamw-fused":
            return base.total_bytes
        estimate = run_estimate(changed, steps=STEPS, target="cuda").estimate
        assert estimate is not None
        return estimate.total_bytes

    offered = cheaper_changes(config, 0, on_cuda, peak_phase=base.peak_phase)
    rows = {r["change"]: r["total_bytes"] for r in offered}
    assert rows["--optimizer adamw-fused"] == fused.estimate.total_bytes
    assert fused.estimate.total_bytes < base.total_bytes
    optimizer = report.phases["optimizer"].peak_bytes
    assert optimizer - fused.phases["optimizer"].peak_bytes == base.trainable_bytes

    def anything(changed: QLoRAConfig) -> Any:
        return 1

    for target, phase in (("cpu", "optimizer"), ("cuda", "backward")):  # nothing to save there
        rows = cheaper_changes(config, 0, anything, place=Place(target), peak_phase=phase)
        assert "--optimizer adamw-fused" not in {r["change"] for r in rows}


def test_an_unknown_optimizer_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and err.count("\n") == 1


def test_target_cuda_prices_the_attention_kernel_cuda_runs() -> None:
    """fp32 attention with fewer k/v heads (tiny-llama: 4 heads, 2 k/v; fp32 after
    prepare_model_for_kbit_training) runs the math composite on CUDA: flash takes fp16/bf16 only, the
    memory-efficient kernel equal heads only (torch's reasons, seen on an H100: docs/measurements/).
    The meta run for ``target="cuda"`` keeps the softmax, the formula prices it, they agree to the
    byte, and the step keeps more than on the CPU (flash) by exactly the terms that differ."""
    from vramguard.estimate.run import run_estimate

    b, s, a, kv, d, layers = 2, 64, 4, 2, 32, 2
    config = QLoRAConfig(seq_len=s, batch=b)
    cuda = run_estimate(config, steps=1, target="cuda")
    cpu = run_estimate(config, steps=1, target="cpu")
    for report in (cuda, cpu):
        assert report.budget.measured_activation_bytes == report.budget.analytic_activation_bytes
    T, e = b * s, 4
    math_kernel = 3 * T * a * d * e + b * a * s * s * e  # q, k, v at a heads; the probabilities
    flash_kernel = T * a * d * e + 2 * T * kv * d * e + b * a * s * 4  # q; k, v at kv heads; logsumexp
    got = cuda.budget.measured_activation_bytes - cpu.budget.measured_activation_bytes
    assert got == layers * (math_kernel - flash_kernel)
    assert cuda.estimate is not None and cpu.estimate is not None
    assert cuda.estimate.total_bytes > cpu.estimate.total_bytes


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({"lora_dropout": 0.1}, id="math-dropout"),  # o_proj keeps only its dropped input
        pytest.param({"model": "tiny-gemma3", "seq_len": 640}, id="efficient-window-mask"),  # window 512
    ],
)
def test_target_cuda_meta_run_equals_the_cuda_formula(variant: dict[str, Any]) -> None:
    """The two cases the H100 corrected (docs/measurements/2026-11-22-h100/): the math composite with
    LoRA dropout keeps no attention output (the formula had one), and the memory-efficient kernel keeps
    the additive float mask made of a sliding window's boolean one (the meta run had none)."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(**{"seq_len": 64, "batch": 2, **variant})
    report = run_estimate(config, steps=1, target="cuda")
    assert report.budget.measured_activation_bytes == report.budget.analytic_activation_bytes


def _estimate_bench_doc(wall: float, rss: int, total: int) -> dict[str, Any]:
    """A results-store document as benchmarks/test_estimate_speed.py records it."""
    payload = {
        "schema": 1,
        "params": {"model": "llama-3.1-8b", "seq_len": 2048, "batch": 1, "lora_rank": 16},
        "metrics": {
            "estimate_wall_time": wall,
            "estimate_cpu_time": wall * 0.7,
            "estimate_peak_rss": rss,
            "estimate_total_bytes": total,
            "estimate_allocator_peak": total - 10,
        },
        "phases": {},
    }
    bench = {"name": "test_estimate_command_speed[x]", "params": payload["params"], "stats": None}
    return {
        "machine_info": {"vramguard": {"packages": {"torch": "2"}}},
        "benchmarks": [dict(bench, extra_info={"vramguard": payload})],
    }


def test_compare_gates_the_estimate_benchmark() -> None:
    """The estimate's RSS and answer are gated like memory; its wall and CPU time only on request."""
    from vramguard.history.compare import Gate

    base = _estimate_bench_doc(20.0, 600 << 20, 50 << 30)
    slower = _estimate_bench_doc(40.0, 600 << 20, 50 << 30)
    assert not Gate.from_options([], None, False).compare(base, slower, "a", "b").failed
    gated = Gate.from_options(["estimate_wall_time=20%"], None, False).compare(base, slower, "a", "b")
    assert [r.metric for r in gated.regressions] == ["estimate_wall_time"]
    fatter = _estimate_bench_doc(20.0, 700 << 20, 52 << 30)
    got = Gate.from_options([], None, False).compare(base, fatter, "a", "b")
    assert sorted(r.metric for r in got.regressions) == [
        "estimate_allocator_peak",
        "estimate_peak_rss",
        "estimate_total_bytes",
    ]


def _hook_activation_bytes(report: AuditReport) -> int:
    return sum(r["bytes"] for r in report.records if r["source"] == "hook" and r["kind"] == "activation")


def test_offloading_frees_exactly_the_saved_activations_on_the_device() -> None:
    """save_on_cpu, emulated on meta: after the forward the device holds less by exactly what the
    ledger saw saved through autograd's hooks (each such storage had no other owner), and the ledger
    then sees nothing saved on the device; backward's peak counts the copies back."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=64, batch=2)
    kept = run_estimate(config, steps=1, target="cpu")
    off = run_estimate(config, steps=1, target="cpu", offload_activations=True)
    saved = _hook_activation_bytes(kept)
    assert saved > 0 and saved == kept.totals.saved_bytes
    freed = kept.steps[0].retained_after_forward - off.steps[0].retained_after_forward
    assert freed == saved
    assert off.totals.saved_bytes == 0
    assert off.config["extra"]["offload_activations"] is True
    assert any("offloaded to the host" in n for n in off.verdict.notes)
    assert off.estimate.allocator_peak_bytes < kept.estimate.allocator_peak_bytes  # the device's (the host keeps them)


def test_offloading_counts_the_copies_back_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpack allocates the device copy inside the trackers (save_on_cpu's ``packed.to(device)``):
    made invisible, backward's peak drops; as made, it is above what stays on the device."""
    from torch.utils._python_dispatch import _disable_current_modes

    from vramguard.estimate import offload
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=64, batch=2)
    counted = run_estimate(config, steps=1, target="cpu", offload_activations=True)
    real_unpack = offload.OffloadActivations._unpack

    def unpack_unseen(self: Any, packed: Any) -> Any:
        with _disable_current_modes():
            return real_unpack(self, packed)

    monkeypatch.setattr(offload.OffloadActivations, "_unpack", unpack_unseen)
    unseen = run_estimate(config, steps=1, target="cpu", offload_activations=True)
    assert counted.steps[0].retained_after_forward == unseen.steps[0].retained_after_forward
    assert counted.phases["backward"].peak_bytes > unseen.phases["backward"].peak_bytes


def test_offloading_with_checkpointing_frees_what_only_autograd_held() -> None:
    """With checkpointing, the layers' inputs are what autograd saves; one of them (the rotary
    cos/sin the checkpoint keeps as keyword arguments) has another owner, so it stays on the device
    while its copy goes to the host, as under the real save_on_cpu."""
    from vramguard.estimate.run import run_estimate

    config = QLoRAConfig(seq_len=64, batch=2, gradient_checkpointing=True)
    kept = run_estimate(config, steps=1, target="cpu")
    off = run_estimate(config, steps=1, target="cpu", offload_activations=True)
    freed = kept.steps[0].retained_after_forward - off.steps[0].retained_after_forward
    assert 0 < freed <= _hook_activation_bytes(kept)


def test_cli_offload_activations_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "estimate.json"
    args = ["estimate", "--model", "tiny-llama", "--seq-len", "32", "--batch", "1", "--steps", "1"]
    assert main([*args, "--offload-activations", "--json", str(out)]) == 0
    assert "activations offloaded to the host" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["config"]["extra"]["offload_activations"] is True


def test_paged_adamw_8bit_is_adamw_8bit_with_its_paged_state_named(tmp_path: Path) -> None:
    """PagedAdamW8bit is AdamW8bit(is_paged=True): the same state; the moments of parameters with
    >= 1e5 elements go to unified memory. On meta it runs as AdamW8bit, every figure equal, and the
    paged bytes are named: full fine-tuning of tiny-llama with a 1024-token vocabulary pages the two
    uint8 moments of its embedding and lm_head (1024 x 128 each); nothing else reaches 1e5 elements."""
    from vramguard.estimate.meta import build_meta
    from vramguard.estimate.run import run_estimate

    data = json.loads(presets()["tiny-llama"].read_text())
    data["vocab_size"] = 1024
    model = tmp_path / "tiny-llama-1024.json"
    model.write_text(json.dumps(data))
    config = QLoRAConfig(model=str(model), seq_len=32, batch=1)
    plain = run_estimate(config, steps=STEPS, method="full", optimizer="adamw-8bit", target="cpu")
    paged = run_estimate(config, steps=STEPS, method="full", optimizer="paged-adamw-8bit", target="cpu")
    got, want = _above_weights(paged), _above_weights(plain)
    for key in want:
        assert got[key] == want[key], key
    assert paged.estimate.total_bytes == plain.estimate.total_bytes
    q = build_meta(config, method="full")
    big = sorted(n for n, p in q.model.named_parameters() if p.requires_grad and p.numel() >= 100_000)
    assert big == ["lm_head.weight", "model.embed_tokens.weight"]
    note = next(n for n in paged.verdict.notes if n.startswith("paged optimizer"))
    assert "512.00 KiB of its state (4 moment tensors" in note  # 2 parameters x 2 moments x 1024 x 128 x 1 B
    assert not any(n.startswith("paged optimizer") for n in plain.verdict.notes)


@pytest.mark.parametrize(
    "preset,positions",
    [("tiny-llama", 1024), ("llama-3.1-8b", 131072), ("qwen2.5-7b", 131072), ("gemma-2-9b", 8192)],
)
def test_max_positions_of_vramguard_and_hugging_face_presets(preset: str, positions: int) -> None:
    """The full-size presets are Hugging Face config.json files: their limit is in the config, not in
    the shape fields (read there only, the 8B's seq was never refused and --fit-dim seq searched 2^20)."""
    from vramguard.estimate.run import max_positions
    from vramguard.workload.models import ModelSpec

    assert max_positions(ModelSpec.load(preset)) == positions


def test_seq_beyond_a_hugging_face_configs_positions_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads(presets()["tiny-llama-hf"].read_text())
    assert cfg["max_position_embeddings"] == 1024
    code = main(["estimate", "--model", "tiny-llama-hf", "--seq-len", "1025", "--steps", "1", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "beyond tiny-llama-hf's 1,024 positions" in err and err.count("\n") == 1


def test_what_the_data_decides_is_bounded_for_packed_rows() -> None:
    """Packed rows: the figure is the high (several sequences a row: transformers builds the packed-sequence
    mask, and sdpa takes another kernel); the low is the same step with every row one sequence. The low run
    equals a padding-free batch of one sequence a row plus exactly the bytes of the boundary tensors TRL's
    collator adds for the second sequence (counted here from the collator's own batches)."""
    from vramguard.estimate.run import run_estimate
    from vramguard.units import format_bytes
    from vramguard.workload.models import padding_free_batch

    packed = QLoRAConfig(seq_len=64, batch=1, padding_free=True, packing=True)
    high = run_estimate(packed, target="cpu")
    [note] = [f for f in high.verdict.findings if f.kind == "data-bounds"]
    low = run_estimate(packed, target="cpu", one_sequence_per_row=True)
    assert not [
        f for f in low.verdict.findings if f.kind == "data-bounds"
    ]  # the low run bounds nothing itself
    assert high.estimate is not None and low.estimate is not None
    assert note.bytes == high.estimate.total_bytes - low.estimate.total_bytes > 0
    assert format_bytes(low.estimate.total_bytes) in note.message

    one = run_estimate(QLoRAConfig(seq_len=64, batch=1, padding_free=True), target="cpu")
    assert one.estimate is not None

    def nbytes(batch: dict) -> int:
        tensors = {id(v): v for v in batch.values() if isinstance(v, torch.Tensor)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    ids = torch.zeros((1, 64), dtype=torch.long)
    boundaries = nbytes(padding_free_batch(ids, True)) - nbytes(padding_free_batch(ids, False))
    assert low.estimate.allocator_peak_bytes == one.estimate.allocator_peak_bytes + boundaries
    assert low.totals.saved_bytes == one.totals.saved_bytes < high.totals.saved_bytes
    [plain] = [f for f in one.verdict.findings if f.kind == "data-bounds"]
    assert "padding-free rows, priced full" in plain.message and plain.bytes is None
