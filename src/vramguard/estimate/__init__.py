"""``vramguard estimate``: the memory of a QLoRA step at full size, from a meta-device run of the
libraries' own code (no GPU, no weights). See :mod:`vramguard.estimate.meta` for how the model is
built and which data-dependent decisions are forced, :mod:`vramguard.estimate.run` for the step."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    from vramguard.estimate.cli import register as _register

    _register(subparsers)


__all__ = ["register"]
