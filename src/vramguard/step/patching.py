"""The one helper that patches a library's globals for a block: set on entry, the original restored on exit (an
error included), in the reverse order of setting. Every technique and forced decision that replaces a library
function (transformers' masking, torch's sdpa, dropout and autocast, the optimizers' device lists) goes
through it, so none writes its own save and restore."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` within the block and its original after it; yields the original (what the
    replacement calls for the cases it leaves alone)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def patch_all(stack: contextlib.ExitStack, patches: list[tuple[Any, str, Any]]) -> None:
    """Enter :func:`patched` for each ``(owner, name, value)`` of ``patches`` on ``stack``, in order: all are
    restored when the stack closes."""
    for owner, name, value in patches:
        stack.enter_context(patched(owner, name, value))
