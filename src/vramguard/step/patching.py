"""The one helper that patches a library's globals for a block: set on entry, the original restored on exit (an
error included), in the reverse order of setting. Every technique and forced decision that replaces a library
function (transformers' masking, torch's sdpa, dropout and autocast, the optimizers' device lists) goes
through it, so none writes its own save and restore."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any


_INHERITED = object()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` within the block and its original after it; yields the original as read
    (``getattr``: what the replacement calls for the cases it leaves alone). What is restored is what ``owner``
    itself held, as it held it (a class's ``classmethod`` object, not the bound method ``getattr`` gives), or
    nothing where ``owner`` held none of its own (a class's method on an instance, a base class's attribute): the
    attribute is then deleted, and lookup finds what it found before."""
    original = getattr(owner, name)
    held = _held(owner, name, original)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        if held is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, held)


def _held(owner: Any, name: str, original: Any) -> Any:
    """What restores ``owner.name``: its own value as stored; ``original`` where setting does not store it in
    ``owner.__dict__`` (a data descriptor of its type: a property's setter, a slot; an instance whose type has its
    own ``__setattr__``: an ``nn.Module``'s parameters, a transformers config's aliases) or ``owner`` has no
    ``__dict__``; else :data:`_INHERITED` (deleted on exit, so lookup finds what it found before)."""
    try:
        own = vars(owner)
    except TypeError:
        return original
    if name in own:
        return own[name]
    kind = type(owner)  # a class's attribute is set through its metaclass
    if not isinstance(owner, type) and kind.__setattr__ is not object.__setattr__:
        return original
    if hasattr(inspect.getattr_static(kind, name, None), "__set__"):
        return original
    return _INHERITED


def patch_all(stack: contextlib.ExitStack, patches: list[tuple[Any, str, Any]]) -> None:
    """Enter :func:`patched` for each ``(owner, name, value)`` of ``patches`` on ``stack``, in order: all are
    restored when the stack closes."""
    for owner, name, value in patches:
        stack.enter_context(patched(owner, name, value))
