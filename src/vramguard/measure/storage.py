"""Storage identity and residency: the unit in which memory is counted, once.

Memory is owned by storages, not tensors: views share one storage, and a saved view keeps the
whole storage alive. Everything in vramguard therefore counts ``untyped_storage().nbytes()``
per storage, keyed by the StorageImpl pointer (``_cdata``), which stays unique while the storage
is alive on every device, meta included (where ``data_ptr()`` is always 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

StorageKey = int

_MAX_DEPTH = 2


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this process: ``t`` itself, or the local shard of a
    ``DTensor`` (FSDP2's sharded parameters, their gradients and optimizer state). A ``DTensor`` is a wrapper
    whose own storage has the *global* size (all ranks' shards), so counting it would charge every rank with
    the whole tensor."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_of(t: torch.Tensor) -> Any:
    """The untyped storage holding ``t``'s bytes on this process (of its local shard, for a ``DTensor``)."""
    return local_tensor(t).untyped_storage()


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of the storage behind ``t`` (shared by all of its views)."""
    return int(storage_of(t)._cdata)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``t``: what keeping ``t`` alive costs."""
    return int(storage_of(t).nbytes())


# leaves ``torch.utils._pytree`` never looks into, and that are no tensors: skipped without asking it
_SCALARS = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
# module attributes of these exact types hold no tensor the resident walk looks at (it looks into plain
# objects, tuples and lists): skipped by one set lookup
_NOT_WALKED = _SCALARS | {dict, set, frozenset, type}
# the attributes torch.nn.Module.__init__ sets: private, or the bool ``training``; a module with no others
# (containers, activations, most wrappers) has no attribute the resident walk looks into
_MODULE_OWN = frozenset(vars(torch.nn.Module()))


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or result, or a forward's: those among ``tree_flatten(tree)[0]``
    (torch's pytree leaves), found faster; at any depth (a depth limit silently loses tensors).

    Plain tuples, lists and dicts (what ops take and return) are walked here, to any depth; every other
    container (named tuples, ``torch.return_types``, ``OrderedDict``, registered nodes) is handed to
    torch's own flattener, so the tensors found are exactly those of ``tree_flatten``.
    """
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(tree: Any, found: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for v in tree:
            _collect(v, found)
    elif kind is dict:
        for v in tree.values():
            _collect(v, found)
    elif kind in _SCALARS:
        return
    elif kind is torch.Tensor or (isinstance(tree, torch.Tensor) and kind not in SUPPORTED_NODES):
        found.append(tree)
    else:
        found.extend(v for v in tree_flatten(tree)[0] if isinstance(v, torch.Tensor))


def tensors_in(
    obj: Any, depth: int = _MAX_DEPTH, _seen: set[int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from ``obj``: the object itself, items of tuples/lists/dicts, and
    ``depth`` levels into plain objects' attributes (bitsandbytes' ``QuantState``, ``MatmulLtState``).

    Yields ``(path, tensor)`` with ``path`` relative to ``obj``: ``""``, ``"[1]"``, ``".absmax"``,
    ``".state2.code"``. (Collected in one walk before the first is yielded.)
    """
    found: list[tuple[str, torch.Tensor]] = []
    _tensors_into(obj, depth, _seen if _seen is not None else set(), "", found)
    return iter(found)


def _tensors_into(
    obj: Any, depth: int, seen: set[int], base: str, found: list[tuple[str, torch.Tensor]]
) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.append((base, obj))
        return
    if isinstance(obj, (tuple, list)):
        items: Iterable[tuple[Any, Any]] = enumerate(obj)
        fmt = "{}[{}]"
    elif isinstance(obj, dict):
        items = ((repr(k), v) for k, v in obj.items())
        fmt = "{}[{}]"
    elif depth > 0 and _is_plain_object(obj):
        items = list(vars(obj).items())
        fmt = "{}.{}"
        depth -= 1
    else:
        return
    for k, value in items:
        if type(value) in _SCALARS:  # (no tensor, nothing to look into: the common case, skipped first)
            continue
        if isinstance(value, torch.Tensor):
            found.append((fmt.format(base, k), value))
        elif isinstance(value, (tuple, list, dict)) or (depth > 0 and _is_plain_object(value)):
            _tensors_into(value, depth, seen, fmt.format(base, k), found)


def _is_plain_object(obj: Any) -> bool:
    """Objects worth looking into: user classes with a ``__dict__`` (not modules, not types)."""
    return (
        hasattr(obj, "__dict__")
        and not isinstance(obj, (type, torch.nn.Module, torch.dtype, torch.device))
        and not callable(obj)
    )


def resident_storages(
    model: torch.nn.Module,
    named: Iterable[tuple[str, torch.nn.Module]] | None = None,
    first_names: Mapping[StorageKey, str] | None = None,
) -> dict[StorageKey, str]:
    """Storages that exist before any forward pass: parameters, buffers and the quantization state
    hanging off them (``Params4bit.quant_state``, ``Int8Params.SCB``, ``Linear8bitLt.state``).

    Maps storage key to the qualified name of its owner. Saving one of these for backward costs
    nothing extra, so the ledger reports them as resident, never as saved. ``named``: the model's
    ``named_modules()``, when the caller has walked them already. ``first_names``: the names an earlier
    walk gave (its result): a storage found again keeps that name (names as first seen), and no name is
    built for it.
    """
    return ResidentWalk(model, named, first_names).owners


class ResidentWalk:
    """The walk of :func:`resident_storages` (its result in :attr:`owners`), with what it read kept, so
    that :meth:`unchanged` can tell cheaply whether walking again would find the same storages."""

    def __init__(
        self,
        model: torch.nn.Module,
        named: Iterable[tuple[str, torch.nn.Module]] | None = None,
        first_names: Mapping[StorageKey, str] | None = None,
    ) -> None:
        owners: dict[StorageKey, str] = {}
        known = first_names if first_names is not None else {}
        walked: dict[int, tuple[Any, list[tuple[str, StorageKey]]]] = {}
        # each parameter and buffer: (its dict, its name, its storage, the ids of its attributes' values)
        self._slots: list[tuple[dict[str, Any], str, StorageKey, tuple[int, ...]]] = []

        def inside(value: Any) -> list[tuple[str, StorageKey]]:
            # one walk per object: a QuantState hangs off its weight and its module, a model config off
            # every layer (the object is held in ``walked``, so its id stays its own during the walk)
            hit = walked.get(id(value))
            if hit is None:
                hit = walked[id(value)] = (value, [(path, storage_key(t)) for path, t in tensors_in(value)])
            return hit[1]

        # the tensors in the order ``_resident_tensors`` yields them, the first owner kept; a name is
        # built only for a storage seen first here
        for mod_name, module in model.named_modules() if named is None else named:
            prefix = f"{mod_name}." if mod_name else ""
            for group in (module._parameters, module._buffers):
                for name, tensor in group.items():
                    if tensor is None:
                        continue
                    key = storage_key(tensor)
                    if key not in owners:
                        owners[key] = known.get(key) or prefix + name
                    extra = _attributes(tensor)
                    self._slots.append((group, name, key, tuple(map(id, extra.values()))))
                    for attr, value in extra.items() if extra else ():
                        if type(value) not in _SCALARS:
                            for path, key in inside(value):
                                if key not in owners:
                                    owners[key] = known.get(key) or f"{prefix}{name}.{attr}{path}"
            attrs = vars(module)
            if attrs.keys() <= _MODULE_OWN:  # only what torch.nn.Module sets itself: nothing to look into
                continue
            for attr, value in attrs.items():
                # (most attributes are scalars, dicts or private: skipped before the checks below)
                if (
                    type(value) in _NOT_WALKED
                    or attr[0] == "_"
                    or isinstance(value, (torch.Tensor, torch.nn.Module))
                ):
                    continue
                if _is_plain_object(value) or isinstance(value, (tuple, list)):
                    for path, key in inside(value):
                        if key not in owners:
                            owners[key] = known.get(key) or f"{prefix}{attr}{path}"
        self.owners = owners
        # each object looked into, and the storages found in it
        self._objects = [(value, [key for _, key in found]) for value, found in walked.values()]

    def unchanged(self) -> bool:
        """Whether the parameters and buffers walked still have the same storages and the same attribute
        objects, and the objects looked into (``QuantState``, ``MatmulLtState``, configs) hold the same
        storages. What this does not see (and a full walk would): a parameter or buffer added without
        ``register_parameter``/``register_buffer`` (the ledger watches those through torch's registration
        hooks), and a module attribute set to a new object holding tensors."""
        for group, name, key, ids in self._slots:
            tensor = group.get(name)
            if tensor is None or storage_key(tensor) != key:
                return False
            if tuple(map(id, _attributes(tensor).values())) != ids:
                return False
        for value, keys in self._objects:
            if [storage_key(t) for _, t in tensors_in(value)] != keys:
                return False
        return True


def gathered_storages(model: torch.nn.Module) -> dict[StorageKey, int]:
    """Storages a sharding engine all-gathers a unit's weights into, with the bytes each holds while gathered.

    FSDP2 (``fully_shard``) gathers each parameter into its ``all_gather_outputs`` (the unsharded parameter is
    a view of them) and the unit into its group's flat buffer; FSDP1 into each flat parameter's
    ``_full_param_padded``. Both free these with ``storage.resize_(0)`` after forward (all but the root unit,
    which stays gathered until backward) and gather them again before backward: the storage object lives on,
    so its key is stable while its size comes and goes. The bytes are the padded unsharded size, read off the
    buffer's shape (its storage may hold 0 bytes now). Empty for a model no engine shards."""
    out: dict[StorageKey, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = local_tensor(t)
            storage = t.untyped_storage()
            nbytes = max(int(storage.nbytes()), (t.storage_offset() + t.numel()) * t.element_size())
            key = int(storage._cdata)
            out[key] = max(out.get(key, 0), nbytes)

    for module in model.modules():
        if getattr(type(module), "_get_fsdp_state", None) is not None:  # FSDP2
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is None:
                continue
            add(getattr(group, "_all_gather_output", None))
            for fp in group.fsdp_params:
                for t in [
                    *getattr(fp, "all_gather_outputs", ()),
                    *getattr(fp, "_unsharded_inner_tensors", ()),
                ]:
                    add(t)
                add(fp.__dict__.get("_unsharded_param"))
        for p in module._parameters.values():  # FSDP1's FlatParameter
            if p is not None and hasattr(p, "_full_param_padded"):
                add(getattr(p, "_full_param_padded", None))
                add(getattr(p, "_full_prec_full_param_padded", None))
    return out


def frozen_resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the resident storages that training does not update: frozen (quantized) weights with
    their quantization state, and buffers. Trainable parameters are left out."""
    trainable = {storage_key(p) for p in model.parameters() if p.requires_grad}
    for p in model.parameters():  # DeepSpeed ZeRO-3 keeps a parameter's partition as ``ds_tensor``
        partition = getattr(p, "ds_tensor", None)
        if p.requires_grad and isinstance(partition, torch.Tensor):
            trainable.add(storage_key(partition))
    sizes: dict[StorageKey, int] = {}
    for _, tensor in _resident_tensors(model):
        key = storage_key(tensor)
        if key not in trainable:
            sizes.setdefault(key, storage_nbytes(tensor))
    return sum(sizes.values())


def resident_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(owner name, tensor) for every parameter, buffer and tensor hanging off them or their module (the
    storages :func:`resident_storages` names; a storage may come more than once)."""
    return _resident_tensors(model)


def _resident_tensors(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.nn.Module]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(owner name, tensor) for every parameter, buffer and tensor hanging off them or their module."""
    walked: dict[int, tuple[Any, list[tuple[str, torch.Tensor]]]] = {}

    def inside(value: Any) -> list[tuple[str, torch.Tensor]]:
        # one walk per object: a QuantState hangs off its weight and its module, a model config off
        # every layer (the object is held in ``walked``, so its id stays its own during the walk)
        hit = walked.get(id(value))
        if hit is None:
            hit = walked[id(value)] = (value, list(tensors_in(value)))
        return hit[1]

    for mod_name, module in model.named_modules() if named is None else named:
        prefix = f"{mod_name}." if mod_name else ""
        # the module's own dicts, as ``named_parameters(recurse=False)`` reads them (that call walks
        # ``named_modules`` again per module); a tensor listed twice yields its owners in the same order
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None:
                continue
            yield prefix + name, tensor
            for attr, value in _attributes(tensor).items():
                if type(value) not in _SCALARS:
                    for path, t in inside(value):
                        yield f"{prefix}{name}.{attr}{path}", t
        for attr, value in list(vars(module).items()):
            # (most attributes are private or scalars: skipped before the checks below)
            if (
                attr[0] == "_"
                or type(value) in _SCALARS
                or isinstance(value, (torch.Tensor, torch.nn.Module))
            ):
                continue
            if _is_plain_object(value) or isinstance(value, (tuple, list)):
                for path, t in inside(value):
                    yield f"{prefix}{attr}{path}", t


def _attributes(tensor: torch.Tensor) -> dict[str, Any]:
    """Python attributes set on a parameter object (e.g. ``quant_state``), tensors' own internals aside."""
    try:
        return {k: v for k, v in vars(tensor).items() if not k.startswith("_")}
    except TypeError:
        return {}
