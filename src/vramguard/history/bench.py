"""One benchmark case: a measured QLoRA step, reduced to the numbers a nightly comparison needs.

The payload goes into ``benchmark.extra_info["vramguard"]`` (pytest-benchmark JSON) and into the
results store, so ``vramguard compare`` reads the same fields from either.

Isolation on CUDA (documented in docs/benchmarks.md): every case starts with ``gc.collect()``,
``torch.cuda.empty_cache()`` and ``reset_peak_memory_stats()``, and ends by deleting the model and
emptying the cache again, so a case never inherits the previous case's cached blocks or peak.
The CUDA context and memory outside the caching allocator (NVML per-process usage minus
``memory_reserved``) are reported apart from the allocator's numbers.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from vramguard.measure.ledger import SavedTensorLedger
from vramguard.measure.storage import storage_key, storage_nbytes
from vramguard.measure.tracker import CudaAllocatorSource, MemoryTracker
from vramguard.workload.models import QLoRAConfig, QLoRAModel, build_qlora
from vramguard.workload.training import PHASES, StepResult, make_optimizer, train_step

SCHEMA = 1


@dataclass(frozen=True)
class BenchCase:
    """One point of the benchmark matrix; ``id`` is the pytest parameter id."""

    model: str
    seq_len: int
    gradient_checkpointing: bool
    lora_rank: int
    batch: int = 2

    @property
    def id(self) -> str:
        """The benchmark's id in test names, e.g. ``tiny-llama-s128-nockpt-r8``."""
        ckpt = "ckpt" if self.gradient_checkpointing else "nockpt"
        return f"{self.model}-s{self.seq_len}-{ckpt}-r{self.lora_rank}"

    def params(self) -> dict[str, Any]:
        """The parameters a record carries, by which runs are matched in ``compare``."""
        return {
            "model": self.model,
            "seq_len": self.seq_len,
            "gradient_checkpointing": self.gradient_checkpointing,
            "lora_rank": self.lora_rank,
            "batch": self.batch,
        }

    def qlora(self, device: str) -> QLoRAConfig:
        """The QLoRA configuration the case measures on ``device`` (LoRA alpha twice the rank)."""
        return QLoRAConfig(
            model=self.model,
            seq_len=self.seq_len,
            batch=self.batch,
            lora_rank=self.lora_rank,
            lora_alpha=2 * self.lora_rank,
            gradient_checkpointing=self.gradient_checkpointing,
            device=device,
        )


def reset_cuda(device: torch.device) -> None:
    """Clean slate between cases: no cached blocks, peaks equal to what is live now."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def nvml_process_bytes(device: torch.device) -> int | None:
    """This process's memory on ``device`` as the driver sees it (NVML), or None without pynvml."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"  # robust to CUDA_VISIBLE_DEVICES
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except (pynvml.NVMLError, AttributeError, RuntimeError):  # the number is optional
        return None
    return None


def process_memory(device: torch.device) -> dict[str, Any] | None:
    """Memory the allocator does not count: CUDA context, cuBLAS workspaces, other libraries."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = int(torch.cuda.memory_reserved(device))
    nvml = nvml_process_bytes(device)
    return {
        "device_total_bytes": int(total),
        "device_used_bytes": int(total - free),  # all processes on the device
        "allocator_reserved_bytes": reserved,
        "nvml_process_bytes": nvml,
        # NVML's per-process figure minus the allocator's reservation = context + non-PyTorch memory
        "non_allocator_bytes": None if nvml is None else nvml - reserved,
        "source": "nvml" if nvml is not None else "mem_get_info (pynvml not installed)",
    }


def _saved_per_layer(ledger: SavedTensorLedger) -> dict[str, Any]:
    by_layer: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}  # layer -> {"activation": n, "weight-copy": n}
    for layer, records in ledger.report.by_layer().items():
        by_layer[layer] = sum(r.bytes for r in records)
        kinds = by_kind.setdefault(layer, {})
        for r in records:
            kinds[r.kind] = kinds.get(r.kind, 0) + r.bytes
    values = list(by_layer.values()) or [0]
    return {
        "layers": len(by_layer),
        "total_bytes": sum(by_layer.values()),
        "mean_bytes": sum(values) // len(values),
        "max_bytes": max(values),
        "min_bytes": min(values),
        "by_layer": by_layer,
        "by_layer_kind": by_kind,
    }


def _model_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Resident bytes of the model: the allocator's figure on CUDA, unique storages elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device))
    seen: dict[object, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen.setdefault(storage_key(t), storage_nbytes(t))
    return sum(seen.values())


class Prepared:
    """A model after one warm-up step (optimizer state exists), plus the ledger of that step.

    The warm-up step carries the ledger so that its hooks never slow the timed step.
    """

    def __init__(self, case: BenchCase, device: str) -> None:
        self.case = case
        self.device = torch.device(device)
        reset_cuda(self.device)
        self.q: QLoRAModel = build_qlora(case.qlora(device))
        self.optimizer = make_optimizer(self.q)
        self.model_bytes = _model_bytes(self.q.model, self.device)
        self.ledger = SavedTensorLedger(self.q.model)
        with MemoryTracker(self.device) as tracker:
            train_step(self.q, self.optimizer, tracker, step=0, ledger=self.ledger)
        if not self._cpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def _cpu(self) -> bool:
        return self.device.type != "cuda"

    def close(self) -> None:
        """Drop the model, optimizer and ledger and release the device's cached memory before the next case."""
        del self.q, self.optimizer, self.ledger
        reset_cuda(self.device)


def measure_case(prepared: Prepared) -> dict[str, Any]:
    """The timed step (step 1), measured phase by phase; returns the ``extra_info`` payload."""
    device = prepared.device
    with MemoryTracker(device) as tracker:
        t0 = time.perf_counter()
        step: StepResult = train_step(prepared.q, prepared.optimizer, tracker, step=1)
        elapsed = time.perf_counter() - t0
    cuda = isinstance(tracker.source, CudaAllocatorSource)
    phases: dict[str, dict[str, int | None]] = {}
    for name in PHASES:
        stats = tracker.result.phases[name]
        phases[name] = {"peak_allocated": stats.peak_bytes, "peak_reserved": stats.reserved_peak_bytes}
    reserved = [p["peak_reserved"] for p in phases.values() if p["peak_reserved"] is not None]
    per_layer = _saved_per_layer(prepared.ledger)
    metrics: dict[str, float | int | None] = {
        "peak_allocated": max(p["peak_allocated"] or 0 for p in phases.values()),
        "peak_reserved": max(reserved) if reserved else None,
        "retained_after_forward": step.after_forward_bytes - step.start_bytes,
        "saved_bytes": prepared.ledger.report.saved_bytes,
        "saved_per_layer_max": per_layer["max_bytes"],
        "step_time": elapsed,
    }
    return {
        "schema": SCHEMA,
        "device": str(device),
        "source": "cuda-allocator" if cuda else "storage-tracker",
        # CPU: bytes above the model's own weights (tracking starts after the build); CUDA: absolute.
        "baseline": "absolute" if cuda else "above-model",
        "params": prepared.case.params(),
        "model_bytes": prepared.model_bytes,
        "metrics": metrics,
        "phases": phases,
        "saved_per_layer": per_layer,
        "retained_after_step": step.retained_bytes - step.start_bytes,
        "loss": step.loss,
        "process": process_memory(device),
    }


def run_case(benchmark: Any, case: BenchCase, device: str) -> dict[str, Any]:
    """Run ``case`` under pytest-benchmark (pedantic, 1 round) and record the payload in extra_info.

    Without pytest-benchmark timing (e.g. disabled under xdist) the step still runs once.
    """
    prepared = Prepared(case, device)
    payload: dict[str, Any] = {}
    try:

        def target() -> None:
            payload.update(measure_case(prepared))

        benchmark.pedantic(target, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        prepared.close()
    benchmark.extra_info["vramguard"] = payload
    return payload
