"""The one module-stack tracker: which forwards are running, entries and exits with their arguments."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from vramguard.measure.modules import OUTSIDE, ModuleStack, module_names


class Inner(nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        if scale.sum() < 0:
            raise ValueError("negative scale")
        return x * scale


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        try:
            return self.inner(x, scale=scale)
        except ValueError:
            return x


def test_entries_and_exits_nest_with_names_and_keyword_arguments() -> None:
    model, other = Outer(), nn.Linear(2, 2)
    events: list[tuple[Any, ...]] = []
    seen: list[str] = []

    def on_enter(name: str, module: nn.Module) -> int:
        seen.append(stack.current())
        events.append(("enter", name, len(stack.stack)))
        return len(events)

    def on_exit(name: str, entered: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        events.append(("exit", name, entered, len(stack.stack), sorted(kwargs), output is not None))

    x, scale = torch.ones(2), torch.full((2,), 2.0)
    stack = ModuleStack(module_names(model), on_enter, on_exit)
    assert stack.current() == OUTSIDE
    with stack:
        model(x, scale)
        other(torch.ones(2))  # not in the names: unseen
    model(x, scale)  # after the block: the hooks are gone
    assert events == [
        ("enter", "", 1),
        ("enter", "inner", 2),
        ("exit", "inner", 2, 1, ["scale"], True),
        ("exit", "", 1, 0, [], True),
    ]
    assert seen == ["", "inner"]


def test_a_forward_that_raised_is_dropped_at_its_parents_exit() -> None:
    model = Outer()
    exits: list[str] = []
    stack = ModuleStack(module_names(model), on_exit=lambda name, *rest: exits.append(name))
    with stack:
        model(torch.ones(2), torch.full((2,), -1.0))  # inner raises, outer catches it
        assert stack.stack == []
    assert exits == [""]


def test_discover_names_modules_on_first_sight() -> None:
    model = Outer()
    calls: list[str] = []

    def discover(module: nn.Module) -> str | None:
        calls.append(type(module).__name__)
        return "the inner one" if isinstance(module, Inner) else None

    def on_exit(name, entered, module, args, kwargs, output):
        calls.append(f"exit {name}")

    stack = ModuleStack(
        {}, on_enter=lambda name, module: calls.append(f"enter {name}"), on_exit=on_exit, discover=discover
    )
    with stack:
        model(torch.ones(2), torch.ones(2))
        assert stack.stack == []  # the discovered module's frame closed at its exit
        model(torch.ones(2), torch.ones(2))  # known now: not discovered again
    assert calls == [
        "Outer",
        "Inner",
        "enter the inner one",
        "exit the inner one",
        "Outer",
        "enter the inner one",
        "exit the inner one",
    ]


def test_no_global_hook_state_is_left_behind() -> None:
    hooks = (
        torch_module._global_forward_pre_hooks,
        torch_module._global_forward_hooks,
        getattr(torch_module, "_global_forward_hooks_with_kwargs", {}),
    )
    before = [len(h) for h in hooks]
    for _ in range(3):
        with ModuleStack({}):
            pass
    assert [len(h) for h in hooks] == before


@pytest.mark.parametrize("as_kwarg", [False, True])
def test_ledger_keeps_inputs_passed_by_keyword(as_kwarg: bool) -> None:
    """An input of a frozen layer's shape is an activation, whether it came in positionally or by keyword."""
    from vramguard.measure.ledger import SavedTensorLedger

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 4), requires_grad=False)
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s  # saves x, of the weight's shape (6, 4), for the gradient of s

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = Frozen()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.frozen(x=x) if as_kwarg else self.frozen(x)

    model, x = Caller(), torch.randn(6, 4) + 0  # made before the block, as a caller's input
    with SavedTensorLedger(model) as ledger:
        out = model(x)  # noqa: F841
    assert [(r.shape, r.kind, r.module) for r in ledger.report.records] == [((6, 4), "activation", "frozen")]
