"""Minimal reproducer for TRL maintainers (no vramguard needed): TRL's ``OffloadActivations`` keeps, after
backward, the small saved tensors of graph branches that backward never runs (a logged metric computed with
grad, as SFTTrainer's entropy / token accuracy are): they stay in ``OffloadActivations.tracker`` (tensors
under ``min_offload_size`` are kept on the device by reference) until the next ``__enter__``. Without
offloading they are freed with the graph. A small *view* keeps its whole storage.

Needs a CUDA device. usage: python docs/upstream/trl-offload-keeps-saved-tensors.py
prints the device bytes live after each step above those before it, without and with offloading.
"""

import contextlib
import gc

import torch
from trl.models.activation_offloading import OffloadActivations

torch.manual_seed(0)
w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
x = torch.randn(4096, 1024, device="cuda")


def step(ctx) -> None:
    with ctx:
        h = x @ w  # 16 MiB output
        loss = h.square().mean()
        metric = h[:2, :100].abs().sum()  # a logged metric: abs saves an 800 B view of h's 16 MiB storage
    loss.backward()
    metric.item()  # logged, never backpropagated
    w.grad = None


def left_after_steps(ctx) -> list[int]:
    """Device bytes live after each of three steps, above those live before the first."""
    step(contextlib.nullcontext())  # warm-up: cuBLAS's workspace
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    left = []
    for _ in range(3):
        step(ctx)
        torch.cuda.synchronize()
        gc.collect()
        left.append(torch.cuda.memory_allocated() - base)
    return left


print(
    "without offloading:", left_after_steps(contextlib.nullcontext()), "B left on the device after each step"
)
offload = OffloadActivations()
print("with OffloadActivations:", left_after_steps(offload), "B left on the device after each step")
print(
    "OffloadActivations.tracker after the last step:",
    {k: tuple(v[0].shape) for k, v in offload.tracker.items()},
)
