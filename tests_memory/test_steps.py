"""Across training steps: nothing accumulates, and activation offloading leaves nothing behind."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from memhelpers import drop_cublas_workspaces, release

from vramguard.measure.ledger import SavedTensorLedger
from vramguard.measure.tracker import MemoryTracker
from vramguard.workload.training import make_optimizer, train_step

STEPS = 5


def adamw_state_bytes(params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """AdamW keeps exp_avg and exp_avg_sq (parameter-sized) and a scalar fp32 step per parameter.

    Returns (low, high): the step scalars are made by ``torch.tensor(0.0)``, which the CPU storage
    tracker may not see (it bypasses dispatch), so they are allowed, not required."""
    moments = sum(2 * p.numel() * p.element_size() for p in params)
    return moments, moments + 4 * len(params)


class Steps(NamedTuple):
    before: int  # live bytes before the first step (the CUDA allocator counts the model too)
    retained: list[int]  # live bytes after each step
    saved: list[int]  # bytes the ledger saw kept for backward in each step


def run(q, steps: int, wrap: Callable[[], Any] = contextlib.nullcontext) -> Steps:  # type: ignore[no-untyped-def]
    """Live bytes (tracker) and saved bytes (ledger) of each step; cuBLAS's workspaces left out."""
    opt = make_optimizer(q)
    retained, saved = [], []
    device = q.config.device
    with MemoryTracker(device) as tracker:
        gc.collect()  # what earlier tests left in cycles (ledgers) is freed now, not inside step 1
        drop_cublas_workspaces(device)
        before = tracker.current()
        for step in range(steps):
            ledger = SavedTensorLedger(q.model)
            with wrap():
                train_step(q, opt, tracker, step, ledger=ledger)
            saved.append(ledger.report.saved_bytes)
            del ledger  # its hooks' closures form cycles: collect them so only the step's own bytes remain
            gc.collect()
            drop_cublas_workspaces(device)
            retained.append(tracker.current())
    release(q.model)
    return Steps(before, retained, saved)


def test_no_leak_across_steps(device: str, qlora) -> None:
    q = qlora(device)
    before, retained, saved = run(q, STEPS)
    retained = [r - before for r in retained]
    # tracker probe: what step 1 leaves (the optimizer state, from shapes) is what every step leaves
    low, high = adamw_state_bytes(q.trainable_parameters())
    assert low <= retained[0] <= high, (retained, low, high)
    assert retained == [retained[0]] * STEPS, f"retained bytes grow across steps: {retained}"
    # ledger probe: every step's forward keeps the same bytes for backward
    assert saved == [saved[0]] * STEPS and saved[0] > 0, saved


def test_save_on_cpu_leaves_nothing_referenced(device: str, qlora) -> None:
    """torch.autograd.graph.save_on_cpu: the step's retained bytes are those without it."""
    q = qlora(device)
    plain = run(q, 3).retained
    offloaded = run(q, 3, lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)).retained
    assert offloaded == plain, (plain, offloaded)


@pytest.mark.gpu
def test_save_on_cpu_keeps_no_device_bytes(qlora) -> None:
    """On CUDA, with save_on_cpu the device holds no saved activations after the forward."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vramguard.measure.meters import measure

    q = qlora("cuda")
    batch = q.batch(0)

    def fwd():  # type: ignore[no-untyped-def]
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return q.model(**batch)

    drop_cublas_workspaces("cuda")
    before = torch.cuda.memory_allocated()
    m, out = measure(fwd, model=q.model, device="cuda", roots=lambda o: o.loss, inputs=batch)
    drop_cublas_workspaces("cuda")
    kept_on_device = torch.cuda.memory_allocated() - before - m.output_bytes
    assert kept_on_device <= 1 << 20, f"{kept_on_device} B still on the device with save_on_cpu"
    out.loss.backward()
    release(q.model)


def _trl_offload() -> Any:
    trl = pytest.importorskip("trl")
    from trl.models.activation_offloading import OffloadActivations

    if not (hasattr(torch, "accelerator") and torch.accelerator.current_accelerator() is not None):
        pytest.skip(
            f"trl {trl.__version__} OffloadActivations needs an accelerator (it asks "
            "torch.accelerator.current_accelerator() for the device to offload from)"
        )
    return OffloadActivations


def test_trl_offloading_leaves_nothing_referenced(device: str, qlora) -> None:
    OffloadActivations = _trl_offload()
    q = qlora(device)
    plain = run(q, 3).retained
    offloaded = run(
        q, 3, lambda: OffloadActivations(use_streams=torch.device(device).type == "cuda")
    ).retained
    assert offloaded == plain, (plain, offloaded)
