"""Parameters built on the meta device are not initialised: a meta tensor has no values to draw.

``nn.Linear`` draws its weight when it is made (``reset_parameters``), PEFT draws and zeroes each LoRA matrix, and
on meta each draw runs torch's Python decomposition of ``uniform_`` for nothing (1.6 s of CPU of the 70B
preset's estimate, 10 %). :func:`values_not_drawn` makes ``torch.nn.init``'s in-place initialisers return a meta
tensor as it is, for the block of a meta build; they allocate nothing there either way (an in-place op on meta
makes no storage), so no byte the step is measured by changes; any other device's tensor is initialised as ever.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vramguard.step.patching import patch_all

META = "meta"

INITIALISERS: tuple[str, ...] = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
"""``torch.nn.init``'s in-place initialisers (each takes the tensor first and returns it)."""


def _skipping(init: Callable[..., Any], meta_only: bool) -> Callable[..., Any]:
    @functools.wraps(init)
    def initialise(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and (tensor.device.type == META or not meta_only):
            return tensor
        return init(tensor, *args, **kwargs)

    return initialise


@contextlib.contextmanager
def values_not_drawn(meta_only: bool = True) -> Iterator[None]:
    """``torch.nn.init``'s initialisers leave meta tensors as they are within the block; with ``meta_only``
    False, every tensor (a block whose tensors all end on meta: PEFT makes a LoRA matrix on the host and moves
    it to its base layer's device, meta, dropping what was drawn)."""
    with contextlib.ExitStack() as stack:
        patch_all(
            stack,
            [
                (torch.nn.init, name, _skipping(getattr(torch.nn.init, name), meta_only))
                for name in INITIALISERS
                if hasattr(torch.nn.init, name)
            ],
        )
        yield
