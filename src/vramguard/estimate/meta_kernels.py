"""Meta kernels put in place of torch's own for the duration of a meta step.

Where the meta step answers one op differently from torch's meta kernel (``.item()`` of a meta scalar in a
trainer's step, ``_grouped_mm`` of fp32 experts), the answer is that op's ``Meta`` kernel, registered with
``torch.library`` over the step (:func:`meta_kernels`), not a ``TorchDispatchMode``: a mode is called from Python
for every op of the step (about 73,000 in a 70B-shaped step, a few microseconds each for a mode that passes them
on), a kernel only for its own op. The dispatcher keeps every kernel registered for an op and key and runs the
last; destroying the step's library removes its kernels, so torch's own is the op's ``Meta`` kernel again once
the block ends (``tests/test_meta_kernels.py`` holds it).

What the other modes of the step see is unchanged: a mode sees the op before any kernel runs (the tracker, the
shape cache), and a mode that answers the op itself (``_AnswerScalars``, the routed values, Liger's answers)
still answers it first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


@contextlib.contextmanager
def meta_kernels(kernels: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Within the block each ``aten`` operator named in ``kernels`` (an overload name: ``"_local_scalar_dense"``,
    ``"_grouped_mm"``) runs its function as its ``Meta`` kernel, called with the op's arguments as a dispatch
    mode gets them; torch's own kernel is back when the block ends, however it ends."""
    unknown = set(kernels) - STEP_KERNELS
    if unknown:  # the shape cache must leave these ops to their kernel: it reads STEP_KERNELS
        raise ValueError(f"meta kernels not in STEP_KERNELS: {', '.join(sorted(unknown))}")
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, kernel in kernels.items():
            library.impl(name, kernel, "Meta")
        yield
    finally:
        library._destroy()


def answer_items(scalar: torch.Tensor) -> bool | int:
    """``_local_scalar_dense`` (``.item()``, ``bool()``) of a meta scalar answered with 1 (``True`` for a bool):
    a trainer's logging asks it (:mod:`vramguard.estimate.trainer`); no value exists on meta."""
    return True if scalar.dtype is torch.bool else 1


STEP_KERNELS = frozenset({"_local_scalar_dense", "_grouped_mm"})
"""Every op whose ``Meta`` kernel a meta step may register (:func:`meta_kernels` refuses any other): the
step's shape cache (:class:`vramguard.estimate.meta.ShapeCache`) never answers them, their kernels count what
they answer."""

ITEMS_ANSWERED = {"_local_scalar_dense": answer_items}
"""The trainer step's meta kernels (:func:`meta_kernels`): ``.item()`` of a meta scalar answered."""
