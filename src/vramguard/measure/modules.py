"""Which modules' forwards are running now: the one module-stack tracker every measurer composes.

The ledger (which module saved a tensor, which module created an autograd node), the memory tracker
(a frame per module call) and the saved-bytes meter (which decoder layer is running) all need the
same thing: the modules whose ``forward`` is on the call stack, innermost last. :class:`ModuleStack`
keeps that stack with one global pair of forward hooks (``register_module_forward_pre_hook`` /
``register_module_forward_hook``) instead of a hook pair on every module, and tells its owner of each
entry and exit through two callbacks.

Like PyTorch's ``torch.distributed._tools.mod_tracker.ModTracker`` (which ``mem_tracker`` composes), but
smaller: no backward tracking, and the exit callback gets the call's keyword arguments (the ledger keeps
the storages passed into a module), which ``ModTracker``'s pre-hooks do not see.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.nn.modules import module as _module
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

OUTSIDE = "<outside>"
"""Module name for work done outside any module's forward (e.g. a loss computed by the caller)."""

EnterCallback = Callable[[str, torch.nn.Module], Any]
"""``on_enter(name, module)``, called when a forward starts; what it returns comes back to ``on_exit``."""
ExitCallback = Callable[[str, Any, torch.nn.Module, Any, Any, Any], None]
"""``on_exit(name, entered, module, args, kwargs, output)``, called when a forward returns, with the module
already popped; ``entered`` is what ``on_enter`` returned for this call."""


def module_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(module) -> qualified name`` for every module of ``model`` (each once, as ``named_modules``)."""
    return {id(m): n for n, m in model.named_modules()}


class ModuleStack:
    """The forwards running now, innermost last: :attr:`stack` holds their qualified names.

    ``names`` (``id(module) -> name``, :func:`module_names`) says which modules count; others run unseen,
    unless ``discover(module)`` (called for each module not in ``names``) returns a name for it. The
    hooks are installed while the stack is entered (``with`` or :meth:`__enter__` / :meth:`__exit__`).

    A forward that raised is popped with the next exit of an enclosing module (no callback for it).
    """

    def __init__(
        self,
        names: dict[int, str],
        on_enter: EnterCallback | None = None,
        on_exit: ExitCallback | None = None,
        discover: Callable[[torch.nn.Module], str | None] | None = None,
    ) -> None:
        self.names = names
        self.stack: list[str] = []
        self._entered: list[Any] = []
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._discover = discover
        self._handles: list[Any] = []

    def current(self) -> str:
        """The innermost running module's name, or ``OUTSIDE``."""
        return self.stack[-1] if self.stack else OUTSIDE

    def __enter__(self) -> ModuleStack:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, with_kwargs=True),
        ]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._handles:
            h.remove()
            # torch keeps a global hook's with_kwargs flag after the hook is removed: one entry per measurer
            getattr(_module, "_global_forward_hooks_with_kwargs", {}).pop(h.id, None)
        self._handles.clear()
        self.stack.clear()
        self._entered.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            if self._discover is None:
                return
            name = self._discover(module)
            if name is None:
                return
            self.names[id(module)] = name  # known from now on, to its exit hook too
        self.stack.append(name)
        self._entered.append(self._on_enter(name, module) if self._on_enter is not None else None)

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        stack = self.stack
        i = len(stack) - 1
        while i >= 0 and stack[i] != name:
            i -= 1
        if i < 0:  # entered before the hooks were installed
            return
        entered = self._entered[i]
        del stack[i:], self._entered[i:]
        if self._on_exit is not None:
            self._on_exit(name, entered, module, args, kwargs, output)
