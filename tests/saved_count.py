"""An independent count of what one forward pass keeps for backward, written without vramguard's code.

Two probes, as anyone would write them from torch's documentation: ``torch.autograd.graph.saved_tensors_hooks``
(every tensor an op or ``save_for_backward`` packs), and a walk of the autograd graph from the loss into the
``ctx`` of custom ``autograd.Function`` nodes, whose plain tensor attributes no hook sees (bitsandbytes'
``MatMul4Bit`` keeps its input there). Each storage is counted once, by its address; the model's parameters,
buffers and bitsandbytes' quantization state were there before the pass and are left out.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def _tensors(value: Any, depth: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth <= 0:
        return []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, depth - 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v, depth - 1)]
    if hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        return [t for v in vars(value).values() for t in _tensors(v, depth - 1)]
    return []


def resident_storages(model: torch.nn.Module) -> set[int]:
    """Addresses of the storages of ``model``'s parameters, buffers and their quantization state."""
    out: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        out.add(t.untyped_storage().data_ptr())
        for q in _tensors(getattr(t, "quant_state", None), 3):
            out.add(q.untyped_storage().data_ptr())
    return out


def graph_nodes(root: Any) -> list[Any]:
    """Every autograd node reachable from ``root`` (a ``grad_fn``), each once."""
    seen: set[int] = set()
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


class Held:
    """What the pack hook gives autograd in place of a tensor: while autograd keeps it, the graph keeps the
    tensor for backward; when the node that saved it is freed (a branch the loss does not reach, such as the
    vision tower's layers after the one whose features are used), so is this."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def saved_storages(
    model: torch.nn.Module, batch: dict[str, Any], walk_ctx: bool = True
) -> tuple[dict[int, int], torch.Tensor]:
    """(address -> bytes of every storage one forward of ``model(**batch)`` and its loss keep for backward,
    the loss); ``walk_ctx=False``: what the hooks alone see."""
    held: list[tuple[weakref.ref[Held], int, int]] = []

    def pack(t: torch.Tensor) -> Held:
        s = t.untyped_storage()
        # detached: t itself may hold its grad_fn, which holds this: a cycle through C++ that gc cannot see
        h = Held(t.detach())
        held.append((weakref.ref(h), s.data_ptr(), s.nbytes()))
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
        loss = model(**batch).loss
    # the model's storages as the forward left them: a first forward may replace a parameter's (bitsandbytes casts
    # a 4-bit layer's bias to the input's dtype), and the old one, if autograd keeps it, is no parameter any more
    resident = resident_storages(model)
    # the storages of the tensors the graph still holds (alive storages have distinct addresses)
    packed = {ptr: n for ref, ptr, n in held if ref() is not None and ptr not in resident and n}
    for node in graph_nodes(loss.grad_fn) if walk_ctx else ():
        if not isinstance(node, torch.autograd.function.BackwardCFunction):
            continue  # a built-in op's saved tensors went through the hooks
        for name, value in vars(node).items():
            if name.startswith("_") or name in ("saved_tensors", "needs_input_grad", "next_functions"):
                continue
            for t in _tensors(value, 2):
                s = t.untyped_storage()
                if s.data_ptr() not in resident and s.nbytes():
                    packed[s.data_ptr()] = s.nbytes()
    return packed, loss


def independent_saved_bytes(model: torch.nn.Module, batch: dict[str, Any]) -> int:
    """Bytes kept alive for backward by one forward and loss of ``model(**batch)``, each storage once (the
    backward runs, so the graph is freed)."""
    packed, loss = saved_storages(model, batch)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return sum(packed.values())
