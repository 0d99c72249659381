"""Peak-memory benchmarks of one QLoRA training step over a small configuration matrix.

CPU (reduced matrix, part of CI): the live storage tracker measures bytes above the model's weights.
GPU (``pytest -m "gpu and benchmark"``): the CUDA caching allocator's absolute numbers, every case
starting from emptied caches and reset peaks (see ``vramguard.history.bench``). Each case records its memory
in ``benchmark.extra_info["vramguard"]``; ``vramguard compare`` gates on it.
"""

from __future__ import annotations

import pytest

from vramguard.history.bench import BenchCase, run_case
from vramguard.history.compare import MEMORY_METRICS

# (model preset, sequence length, gradient checkpointing, LoRA rank)
CPU_MATRIX = [
    BenchCase("tiny-llama", 64, False, 8),
    BenchCase("tiny-llama", 64, True, 8),
    BenchCase("tiny-llama", 64, False, 32),
]
GPU_MATRIX = [
    BenchCase(model, seq, ckpt, rank, batch=4)
    for model in ("small-llama", "llama-1b-shape")
    for seq in (512, 2048)
    for ckpt in (False, True)
    for rank in (16, 64)
]


def _args(cases: list[BenchCase]) -> list[pytest.param]:
    return [
        pytest.param(c.model, c.seq_len, c.gradient_checkpointing, c.lora_rank, c.batch, id=c.id)
        for c in cases
    ]


def _check(payload: dict, case: BenchCase) -> None:
    """Sanity of the measurement itself: a step that allocated nothing was not measured."""
    metrics = payload["metrics"]
    assert payload["params"] == case.params()
    for name in MEMORY_METRICS:
        if name != "peak_reserved" or payload["source"] == "cuda-allocator":
            assert metrics[name] is not None and metrics[name] > 0, name
    assert metrics["peak_allocated"] >= metrics["retained_after_forward"]
    assert metrics["step_time"] > 0
    assert payload["saved_per_layer"]["layers"] > 0


@pytest.mark.benchmark
@pytest.mark.parametrize("model,seq_len,gradient_checkpointing,lora_rank,batch", _args(CPU_MATRIX))
def test_qlora_step_cpu(benchmark, model, seq_len, gradient_checkpointing, lora_rank, batch):
    case = BenchCase(model, seq_len, gradient_checkpointing, lora_rank, batch)
    payload = run_case(benchmark, case, "cpu")
    _check(payload, case)
    assert payload["process"] is None  # no CUDA context on CPU


@pytest.mark.benchmark
@pytest.mark.gpu
@pytest.mark.parametrize("model,seq_len,gradient_checkpointing,lora_rank,batch", _args(GPU_MATRIX))
def test_qlora_step_gpu(benchmark, model, seq_len, gradient_checkpointing, lora_rank, batch):
    case = BenchCase(model, seq_len, gradient_checkpointing, lora_rank, batch)
    payload = run_case(benchmark, case, "cuda")
    _check(payload, case)
    process = payload["process"]
    assert process["allocator_reserved_bytes"] >= 0
    assert payload["metrics"]["peak_reserved"] >= payload["metrics"]["peak_allocated"]
