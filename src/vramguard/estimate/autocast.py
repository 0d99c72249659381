"""Trainer's autocast on the meta device, by the target device's own autocast policy.

Autocast is a dispatch key that only tensors of an autocast device carry, and its kernels cast only
tensors whose device is that device: a meta tensor gets no autocast, whatever the TLS says. A
``FakeTensor`` (torch's, ``torch._subclasses.fake_tensor``) is a meta tensor that reports another device,
with that device's dispatch keys: CUDA's (or the CPU's) real autocast kernels cast it, on a machine
without a GPU. :class:`TargetAutocast` asks them: every torch function of the meta step that takes a
floating-point meta tensor while the target's autocast is on (``torch.set_autocast_enabled(target)``,
which :func:`vramguard.estimate.meta.target_autocast` sets for ``torch.autocast``) first runs on fake
aliases of its arguments, with no tracker and no autograd, until its first op that is not one of
autocast's casts; the casts seen are then made on the meta tensors (``.to(dtype)``, each with its autograd
node, as ``cached_cast`` makes them) and the function runs on meta with autocast off, as the autocast
kernel redispatches. No op list is written here: which ops run in which dtype, and so what is saved in
which dtype, is the target's autocast's own answer.

Autocast's cast cache is kept as ``cached_cast`` keeps it: the cast of an fp32 leaf that requires grad (a
LoRA weight) to the autocast dtype is made once and held until the outermost autocast region exits.
Autograd does not run on the fake aliases (on a CPU-only build it cannot record a CUDA tensor at all).
Not replayed: a cast autocast would make inside a composite op that has no autocast kernel of its own, on
one of its intermediates (the probe stops at the op's first kernel); the CPU estimate equals the CPU audit
to the byte on the models tested, which it would not if such a cast were missed there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

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
"""Tensor methods that ask about a tensor or its autograd state and compute nothing: autocast has nothing to
say about them, so no probe is run."""


class TargetAutocast(TorchFunctionMode):
    """While ``target``'s autocast is enabled, each torch function on floating-point meta tensors gets the
    casts ``target``'s own autocast kernel makes (asked of it on fake aliases, :meth:`autocast_inputs`), then
    runs on meta with autocast off, as the autocast kernel redispatches; ``routed`` counts them."""

    def __init__(self, target: str) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        # the probes' mode (their fake tensors die with each probe)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.target = target
        self.device = torch.device(target, 0) if target == "cuda" else torch.device(target)
        self._fake_class = FakeTensor
        self.kept: dict[int, torch.Tensor] = {}  # autocast's cast cache: id(parameter) -> its cast
        self.routed = 0
        self.unprobed: set[str] = set()  # functions the fake device could not run up to their first kernel
        # what a probe saw, by what it was asked (:func:`_probe_key`): the casts, as (input's index, dtype)
        self.probed: dict[Any, tuple[tuple[int, torch.dtype], ...]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = self.target
        if not _autocast_enabled(target) or _passed_on(func):
            return func(*args, **kwargs)
        leaves, spec = _flatten(args, kwargs)
        if not _floating_meta(leaves):
            return func(*args, **kwargs)
        self.routed += 1
        args, kwargs = self.autocast_inputs(func, args, kwargs, (leaves, spec))
        torch.set_autocast_enabled(target, False)  # as autocast_off (enabled: asked above), inline: every call
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(target, True)

    def autocast_inputs(
        self, func: Any, args: Any, kwargs: dict[str, Any], flat: tuple[list[Any], Any] | None = None
    ) -> tuple[Any, Any]:
        """``(args, kwargs)`` with every meta tensor cast as ``target``'s autocast kernel of ``func`` casts it
        before the op's own kernel runs (see the module docstring). The probe's answer is kept by what it was
        asked (:func:`_probe_key`): a call asked the same is answered without a probe (a model's identical
        layers ask the same of each op). ``flat``: ``(args, kwargs)`` flattened (:func:`_flatten`), where the
        caller has it."""
        leaves, spec = flat if flat is not None else _flatten(args, kwargs)
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == META]
        key = _probe_key(func, spec, leaves, self.target)
        plan = self.probed.get(key) if key is not None else None
        if plan is None:
            plan = self.probe(func, args, kwargs, metas)
            if key is not None:
                self.probed[key] = plan
        elif plan and plan[0][0] < 0:  # the fake device could not run it (see probe)
            self.unprobed.add(getattr(func, "__name__", str(func)))
        casts: dict[int, list[torch.Tensor]] = {}
        if not plan or plan[0][0] < 0:
            return args, kwargs
        with autocast_off(self.target):
            for index, dtype in plan:
                src = metas[index]
                casts.setdefault(id(src), []).append(self._cast(src, dtype))
        return tree_map(
            lambda t: casts[id(t)].pop(0) if isinstance(t, torch.Tensor) and casts.get(id(t)) else t,
            (args, kwargs),
        )

    def probe(
        self, func: Any, args: Any, kwargs: dict[str, Any], metas: list[torch.Tensor]
    ) -> tuple[tuple[int, torch.dtype], ...]:
        """The casts ``target``'s autocast kernel of ``func`` makes of ``metas`` (the call's meta tensors), as
        (index in ``metas``, dtype) in the order it makes them, asked on fake aliases up to the first kernel
        that is not a cast; ``((-1, ...),)`` where the fake device cannot run ``func`` up to it."""
        probe = _FirstKernel()
        with _disable_current_modes(), torch.no_grad():
            mode = self.fake_mode
            aliases = {id(t): self._fake_class(mode, t.detach(), self.device) for t in metas}
            for t in metas:
                probe.inputs[id(aliases[id(t)])] = t
            fargs, fkwargs = tree_map(
                lambda t: aliases.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
            try:
                with mode, probe:
                    func(*fargs, **fkwargs)
            except _Stop:
                pass
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                # the fake device cannot run this function before its first kernel (indexing asks CUDA for
                # a device guard a CPU-only torch lacks): no autocast cast was seen before it
                self.unprobed.add(getattr(func, "__name__", str(func)))
                return ((-1, torch.float32),)
        index = {}
        for i, t in enumerate(metas):
            index.setdefault(id(t), i)
        return tuple((index[id(src)], dtype) for src, dtype in probe.casts)

    def _cast(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``src.to(dtype)`` as autocast's ``cached_cast`` makes it: from its cache for a leaf fp32 tensor
        that requires grad, cast to the autocast dtype with the cache on."""
        cacheable = (
            dtype == torch.get_autocast_dtype(self.target)
            and src.dtype == torch.float32
            and src.requires_grad
            and src.is_leaf
            and not src._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return src.to(dtype)
        kept = self.kept.get(id(src))
        if kept is None:
            kept = self.kept[id(src)] = src.to(dtype)
        return kept

    def region_exited(self) -> None:
        """The outermost autocast region exited: autocast drops its cast cache, so does this."""
        self.kept.clear()


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
            src = self.inputs.get(id(args[0]))
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


_autocast_enabled = torch._C.is_autocast_enabled
"""torch's own ``is_autocast_enabled``: a trainer's step on meta patches ``torch.is_autocast_enabled`` to answer
for ``meta`` (:func:`vramguard.estimate.trainer._autocast_asked_as`); the mode asks of its target, never of meta,
once per torch function of the step."""


def _flatten(args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``'s leaves, in its order, with a key of the call's structure in place of its
    spec: plain tuples, lists and dicts (what torch functions take) are walked here, their types, lengths and
    dict keys in order making the key (a walk in preorder with counts: one structure, one key); a call with any
    other container (a named tuple, a registered node, a subclass) is torch's own ``tree_flatten``, its spec the
    key. ``tree_flatten`` of every routed call and the hashing of its spec cost more than the rest of the mode."""
    leaves: list[Any] = []
    shape: list[Any] = []
    if _walk((args, kwargs), leaves, shape):
        return leaves, tuple(shape)
    return tree_flatten((args, kwargs))  # type: ignore[no-any-return]


def _walk(tree: Any, leaves: list[Any], shape: list[Any]) -> bool:
    """Append ``tree``'s leaves and structure (:func:`_flatten`); False at a container it does not walk."""
    kind = type(tree)
    if kind is tuple or kind is list:
        shape.append((kind, len(tree)))
        for v in tree:
            if not _walk(v, leaves, shape):
                return False
        return True
    if kind is dict:
        shape.append((dict, tuple(tree)))
        for v in tree.values():
            if not _walk(v, leaves, shape):
                return False
        return True
    if kind in SUPPORTED_NODES or isinstance(tree, (tuple, list, dict)):
        return False  # torch's pytree decides (a named tuple is a node, another subclass a leaf)
    leaves.append(tree)
    shape.append(None)
    return True


def _floating_meta(leaves: list[Any]) -> bool:
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_meta and t.is_floating_point():
            return True
    return False


def _inplace(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


_PASSED_ON: dict[Any, bool] = {}
""":func:`_passed_on` of each function seen (a function of its name alone)."""


def _passed_on(func: Any) -> bool:
    """Whether ``func`` runs as it is, never routed: a tensor method that computes nothing
    (:data:`_NOT_ROUTED`) or an in-place one (autocast casts no input of an in-place op)."""
    try:
        return _PASSED_ON[func]
    except KeyError:
        passed = getattr(func, "__name__", "") in _NOT_ROUTED or _inplace(func)
        if len(_PASSED_ON) < 65536:  # a function object made anew for each call is not kept for ever
            _PASSED_ON[func] = passed
        return passed
    except TypeError:  # unhashable: asked each time
        return getattr(func, "__name__", "") in _NOT_ROUTED or _inplace(func)


def _probe_key(func: Any, spec: Any, leaves: list[Any], target: str) -> Any:
    """What a probe of ``func`` is asked, as a key, or None where it cannot be keyed: the call's structure
    (``spec``); each tensor's type, device type, dtype, shape and stride, and the first place it is given (the
    answer names its inputs by place: ``mm(x, x)`` is not ``mm(x, y)``), but not its offset (a view's place in
    its storage, which differs between the chunks of a chunked loss); every other argument itself (by value, a
    slice of int bounds as its bounds: :func:`_slice_key`; an unhashable one gives None); and the target's
    autocast dtype and cache flag. Autocast's casts are a function of these: its kernels read the op and its
    inputs' dtypes, and a composite function's way to its first kernel reads no more than its arguments."""
    parts: list[Any] = [func, spec, torch.get_autocast_dtype(target), torch.is_autocast_cache_enabled()]
    first: dict[int, int] = {}  # a tensor given twice (mm(x, x)) is keyed apart from two tensors (mm(x, y))
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            try:
                stride = leaf.stride()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no strides
                stride = None
            place = first.setdefault(id(leaf), i)
            parts.append((type(leaf), leaf.device.type, leaf.dtype, leaf.shape, stride, place))
        elif type(leaf) is slice:
            parts.append((slice, _slice_key(leaf)))
        else:
            parts.append((type(leaf), leaf))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _slice_key(index: slice) -> Any:
    """An index's slice by value, (start, stop, step), where each is an int or None; else the slice itself. A
    slice is unhashable before Python 3.12, so ``x[:, :n]`` (every ``__getitem__`` with a slice) left its call
    unkeyed and probed every time (2,466 of a 70B step's 2,595 probes); one with a tensor bound stays unkeyed."""
    bounds = (index.start, index.stop, index.step)
    if all(b is None or type(b) is int for b in bounds):
        return bounds
    return index
