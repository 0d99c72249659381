"""Trainer's autocast on the meta device, by the target device's own autocast policy.

Autocast is a dispatch key that only tensors of an autocast device carry, and its kernels cast only
tensors whose device is that device: a meta tensor gets no autocast, whatever the TLS says. A
``FakeTensor`` (torch's, ``torch._subclasses.fake_tensor``) is a meta tensor that reports another device,
with that device's dispatch keys: CUDA's (or the CPU's) real autocast kernels cast it, on a machine
without a GPU. :class:`TargetAutocast` runs every torch function of the meta step that takes a
floating-point meta tensor, while the target's autocast is on (``torch.set_autocast_enabled(target)``,
which :func:`vramguard.estimate.meta.forced_decisions` sets for ``torch.autocast``), on fake tensors of the
target device that share the meta tensors' storages: the casts, the op and its autograd node are the
target's own, every storage is still a meta storage the tracker and the ledger count, and the results
come back as meta tensors (a pair of autograd functions carries the gradients across). No op list is
written here.

The one thing a fake alias changes is autocast's cast cache: ``cached_cast`` keeps the low-precision copy
of a leaf fp32 parameter that requires grad until the outermost autocast region exits, and a parameter's
fake alias is no leaf. :class:`_CastCache` keeps those copies (and hands the same storage to a second
cast) until the region exits, as the cache does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

META = "meta"

_NOT_ROUTED = frozenset(
    {
        "__get__",
        "__set__",
        "__setitem__",
        "__repr__",
        "__format__",
        "__bool__",
        "__len__",
        "__hash__",
        "__reduce_ex__",
        "__deepcopy__",
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "data_ptr",
        "untyped_storage",
        "item",
        "tolist",
        "backward",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "requires_grad_",
        "detach",
        "detach_",
    }
)
"""Tensor methods that ask about a tensor or its autograd state, and never compute in a dtype: called on
the meta tensor itself (a fake alias would answer with its device, or lose the autograd identity)."""


def _meta_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor on ``t``'s storage (same size, strides, offset), made where no mode sees it."""
    with _disable_current_modes():
        return torch.empty((0,), dtype=t.dtype, device=META).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )


class TargetAutocast(TorchFunctionMode):
    """While ``target``'s autocast is enabled, torch functions on floating-point meta tensors run on fake
    ``target`` tensors sharing their storages (see the module docstring); ``routed`` counts them."""

    def __init__(self, target: str) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        self.target = target
        self.device = torch.device(target, 0) if target == "cuda" else torch.device(target)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._fake_class = FakeTensor
        self.cache = _CastCache(self)
        self.routed = 0
        mode = self

        class ToFake(torch.autograd.Function):
            transparent = True  # the ledger names the op behind it (vramguard.measure.ledger)

            @staticmethod
            def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
                return mode.fake(t)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return _meta_alias(grad) if isinstance(grad, FakeTensor) else grad

        class ToMeta(torch.autograd.Function):
            transparent = True

            @staticmethod
            def forward(ctx: Any, f: torch.Tensor) -> torch.Tensor:
                return _meta_alias(f)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return mode.fake(grad) if grad.device.type == META else grad

        self._to_fake, self._to_meta = ToFake, ToMeta

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        """A fake ``target`` tensor on meta tensor ``t``'s storage (no autograd history)."""
        with _disable_current_modes():
            return self._fake_class(self.fake_mode, t.detach(), self.device)

    def _in(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != META or isinstance(t, self._fake_class):
            return t
        if t.requires_grad and torch.is_grad_enabled():
            f = self._to_fake.apply(t)
        else:
            f = self.fake(t)
        self.cache.sources[f.untyped_storage()._cdata] = t
        return f

    def _out(self, t: Any) -> Any:
        if not isinstance(t, self._fake_class):
            return t
        if t.requires_grad and torch.is_grad_enabled():
            return self._to_meta.apply(t)
        return _meta_alias(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            not torch.is_autocast_enabled(self.target)
            or getattr(func, "__name__", "") in _NOT_ROUTED
            or not _floating_meta((args, kwargs))
            or _inplace(func)
        ):
            return func(*args, **kwargs)
        self.routed += 1
        fargs, fkwargs = tree_map(self._in, (args, kwargs))
        try:
            with self.fake_mode, self.cache:
                out = func(*fargs, **fkwargs)
        finally:
            self.cache.sources.clear()
        return tree_map(self._out, out)

    def autocast_inputs(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``(args, kwargs)`` with every meta tensor cast as ``target``'s autocast kernel of ``func`` casts it
        before the op's own kernel runs (for an op whose kernel the estimate picks itself: attention).

        Asked of autocast itself: ``func`` runs on fake aliases under the target's autocast, where no
        tracker sees it, until the first op that is not one of autocast's casts; the casts seen are then
        made on the meta tensors (each an op of the step, with its autograd node, as autocast's own)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        leaves, _ = tree_flatten((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == META]
        probe = _FirstKernel()
        with _disable_current_modes(), torch.no_grad():
            mode = FakeTensorMode(allow_non_fake_inputs=False)
            aliases = {id(t): self._fake_class(mode, t.detach(), self.device) for t in metas}
            for t in metas:
                probe.inputs[aliases[id(t)].untyped_storage()._cdata] = t
            fargs, fkwargs = tree_map(
                lambda t: aliases.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
            with contextlib.suppress(_Stop), mode, probe:
                func(*fargs, **fkwargs)
        cast = {id(t): dtype for t, dtype in probe.casts}
        with autocast_off(self.target):
            return tree_map(
                lambda t: t.to(cast[id(t)]) if isinstance(t, torch.Tensor) and id(t) in cast else t,
                (args, kwargs),
            )

    def region_exited(self) -> None:
        """The outermost autocast region exited: autocast drops its cache, so does :class:`_CastCache`."""
        self.cache.clear()


class _Stop(Exception):
    pass


class _FirstKernel(TorchDispatchMode):
    """Records autocast's casts of the probe's inputs and stops at the first op that is not one."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[int, torch.Tensor] = {}
        self.casts: list[tuple[torch.Tensor, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src = self.inputs.get(args[0].untyped_storage()._cdata)
            if src is not None and kwargs.get("dtype") is not None:
                self.casts.append((src, kwargs["dtype"]))
            return func(*args, **kwargs)
        if func.namespace == "prim":  # prim.device: asked of a tensor, no op
            return func(*args, **kwargs)
        raise _Stop


@contextlib.contextmanager
def autocast_off(device: str) -> Iterator[None]:
    """``device``'s autocast disabled over the block (as an autocast kernel runs its op), then restored."""
    enabled = torch.is_autocast_enabled(device)
    torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, enabled)


def _floating_meta(tree: Any) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(
        isinstance(t, torch.Tensor) and t.device.type == META and t.is_floating_point()
        for t in tree_leaves(tree)
    )


def _inplace(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


class _CastCache(TorchDispatchMode):
    """Autocast's cast cache for fake aliases: a cast of a parameter's alias to the autocast dtype, where
    ``cached_cast`` would cache the parameter's own cast (an fp32 leaf that requires grad, no view, cache
    on), is kept until the outermost region exits, and a second cast gets the same storage."""

    def __init__(self, owner: TargetAutocast) -> None:
        super().__init__()
        self.owner = owner
        self.sources: dict[int, torch.Tensor] = {}  # fake alias storage -> the meta tensor it stands for
        self.kept: dict[int, torch.Tensor] = {}  # id(parameter) -> its cast (a fake tensor)

    def clear(self) -> None:
        self.kept.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten._to_copy.default or not torch.is_autocast_cache_enabled():
            return func(*args, **kwargs)
        src = self.sources.get(args[0].untyped_storage()._cdata)
        target = self.owner.target
        if (
            src is None
            or kwargs.get("dtype") != torch.get_autocast_dtype(target)
            or src.dtype != torch.float32
            or not (src.is_leaf and src.requires_grad)
            or src._is_view()
        ):
            return func(*args, **kwargs)
        kept = self.kept.get(id(src))
        if kept is not None:
            return torch.ops.aten.alias.default(kept)
        out = func(*args, **kwargs)
        self.kept[id(src)] = out
        return out
