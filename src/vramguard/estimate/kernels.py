"""What CUDA kernels allocate inside themselves, which an op-level count on meta does not see.

The meta run counts each op's outputs (:class:`~vramguard.measure.tracker.StorageTracker`). A CUDA kernel may
also allocate a block for the time it runs and free it before it returns; the caching allocator's peak holds
it, the meta kernel never makes it. An H100 named the ones that decide a QLoRA step's peak
(``docs/measurements/gpu-op-temporaries.py``: the allocator read around every op of a step, torch 2.11,
``docs/measurements/2026-11-25-h100``): the highest point of every checkpointed, eager or sliding-window step
of 2026-11-22 (7.8-10.4 % below it) fell inside ``_softmax_backward_data``, whose CUDA kernel holds one
more tensor the size of its incoming gradient (256 MiB for the 1B shape at batch 2 x 1,024, the `s x s`
tensor the estimate was short by). :func:`cuda_kernel_temporaries` gives those blocks, for the tracker to
count from before the op until after it (:attr:`StorageTracker.kernel_temporaries`).

Priced (each measured on the H100; ``_safe_softmax`` less the 512 B block of its zero scalar):

* ``aten._softmax_backward_data``: one tensor like ``grad_output`` (its shape and dtype): the math attention's
  and eager attention's softmax backward, every layer;
* ``aten._safe_softmax`` (the math attention composite's softmax; CompositeExplicitAutograd, which meta runs as
  one kernel): the boolean ``self == -inf`` mask and its all-masked rows (``self``'s shape and its shape with
  the softmax dimension 1, one byte each); its softmax output is the op's output.

Seen and left out (none reaches a step's peak in the H100's cases; said in docs/estimate.md):
``bitsandbytes.gemm_4bit`` (the dequantized weight, up to 34 MiB per call for the 1B shape's MLP) and the
memory-efficient attention backward (1.3 MB for a tiny Gemma 3).
"""

from __future__ import annotations

from typing import Any

import torch


_SOFTMAX_BACKWARD = torch.ops.aten._softmax_backward_data.default
_SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
_PRICED = frozenset({_SOFTMAX_BACKWARD, _SAFE_SOFTMAX})  # asked of every op of a CUDA estimate: a set's answer


def cuda_kernel_temporaries(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The blocks ``func``'s CUDA kernel holds while it runs, beyond its outputs, as meta tensors (on the
    inputs' device, which on meta allocates nothing real): see the module docstring; [] for any other op."""
    if func not in _PRICED:
        return []
    if func is _SOFTMAX_BACKWARD:
        grad = args[0] if args else kwargs["grad_output"]
        return [torch.empty_like(grad)]
    if func is _SAFE_SOFTMAX:
        x = args[0] if args else kwargs["self"]
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        rows = list(x.shape)
        if rows:
            rows[dim % len(rows)] = 1  # (torch has refused a dim out of range before its kernel runs)
        return [
            torch.empty(x.shape, dtype=torch.bool, device=x.device),
            torch.empty(rows, dtype=torch.bool, device=x.device),
        ]
    return []
