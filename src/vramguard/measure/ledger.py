"""The saved-tensor ledger: per module, what a forward pass leaves alive for backward.

Two probes, because one is not enough:

* ``hook``: :func:`torch.autograd.graph.saved_tensors_hooks` sees every tensor packed through
  ``save_for_backward`` and by built-in ops;
* ``ctx``: custom ``autograd.Function`` contexts can keep tensors as plain attributes
  (bitsandbytes' ``ctx.tensors``, ``ctx.A``, ``ctx.state``), which no hook sees. At the end of
  the pass the ledger walks the autograd graph from the outputs and looks into those contexts
  (one level into tuples/lists, two into objects such as ``QuantState``).

Bytes are counted per storage, once (views and repeated saves share a storage), in the storage that holds
them on this process (a ``DTensor``'s local shard, not its global wrapper); storages of parameters, buffers
and their quantization state are *resident*, not saved. Under a sharding engine (FSDP2, FSDP1) the unsharded
weights a forward computes with live in all-gather buffers the engine frees after forward and gathers again
before backward (:func:`~vramguard.measure.storage.gathered_storages`): a saved one is a *gathered-weight*,
at its gathered size, not an activation the graph keeps, and not in the saved bytes. A record is a
``weight-copy`` when it has the logical shape of a quantized or frozen weight of its module (a 2-D weight, or
a mixture of experts' 3-D expert stack) and is no dropout mask (LoRA dropout's, of a tiny model's batch x seq
rows equal to a weight's rows: a bool, or on the CPU and meta a float saved inside the dropout module): the
signature of "the dequantized weight was saved for backward".

The ledger never extends a tensor's lifetime: the pack hook stores a detached alias in a slot
object that only autograd references, and the ledger keeps a weak reference to that object.
Double backward (``create_graph=True``) through the ledger is not supported.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from types import TracebackType
from typing import Any, Literal

import torch
from torch.autograd.function import BackwardCFunction
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from vramguard.measure.decoder import decoder_layer
from vramguard.measure.modules import OUTSIDE, ModuleStack
from vramguard.measure.offload import hooks_in_force
from vramguard.measure.storage import (
    ResidentWalk,
    StorageKey,
    gathered_storages,
    local_tensor,
    resident_storages,
    storage_of,
    tensor_leaves,
    tensors_in,
)

Source = Literal["hook", "ctx", "tracker"]
"""Which probe saw a storage first: ``saved_tensors_hooks`` (hook), the walk of custom Functions'
contexts (ctx), or only the live-storage tracker (:func:`vramguard.measure.meters.measure`)."""
Kind = Literal["activation", "weight-copy", "resident", "gathered-weight", "unexplained"]
"""What a kept storage is; ``gathered-weight``: a sharding engine's all-gather buffer of unsharded weights
(transient: freed after forward and gathered again for backward, or for the root unit kept gathered until
backward); ``unexplained``: alive after the block, held by no hook or ctx (tracker only)."""


@dataclass(frozen=True)
class SavedRecord:
    """One storage kept alive for backward (or, with kind ``resident``, one that was already there)."""

    module: str
    node: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    source: Source
    kind: Kind
    device: str
    attribute: str | None = None
    owner: str | None = None
    also_saved_by: tuple[str, ...] = ()
    key: StorageKey | None = field(default=None, compare=False, repr=False)
    """The storage's identity in this process while it lives (not written to JSON); None for a storage that
    died before the report was built (offloaded: the offloader holds a copy), whose address may now be
    another storage's."""
    new: bool | None = None
    """Whether the measured block created the storage: known only when the live tracker ran along
    (:func:`vramguard.measure.meters.measure`); not written to JSON."""
    saved_in: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The module of each node of ``also_saved_by``, in its order; not written to JSON."""

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON: shape and ``also_saved_by`` as lists; the process-local ``key``, ``new`` and
        ``saved_in`` are left out."""
        d = asdict(self)
        del d["key"], d["new"], d["saved_in"]
        d["shape"] = list(self.shape)
        d["also_saved_by"] = list(self.also_saved_by)
        return d

    def describe(self) -> str:
        """One line a maintainer can act on."""
        where = f"ctx.{self.attribute}" if self.source == "ctx" and self.attribute else self.source
        age = " (pre-existing)" if self.new is False else ""
        return (
            f"{self.module or '<root>'} {self.node}: {self.kind} {tuple(self.shape)} {self.dtype} "
            f"{self.bytes} B via {where}{age}"
        )


@dataclass
class LedgerReport:
    """What one forward pass left alive for backward, storage by storage."""

    records: list[SavedRecord] = field(default_factory=list)
    resident: list[SavedRecord] = field(default_factory=list)
    gathered: list[SavedRecord] = field(default_factory=list)
    """Saved all-gathered weights of a sharded model (kind ``gathered-weight``), each at its gathered size;
    not in :attr:`saved_bytes`. Empty on one device."""
    gathered_held_bytes: int = 0
    """Of :attr:`gathered_bytes`, what was still gathered when the forward ended (the root unit, which FSDP
    does not reshard after forward); the rest was freed and is gathered again, one unit at a time, in
    backward."""

    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive for backward (activations and weight copies), each storage once; resident storages
        are not included."""
        return sum(r.bytes for r in self.records)

    @property
    def weight_copy_bytes(self) -> int:
        """Saved bytes in storages with the shape of a quantized or frozen weight of their module: dequantized
        weights kept for backward."""
        return sum(r.bytes for r in self.records if r.kind == "weight-copy")

    @property
    def activation_bytes(self) -> int:
        """Saved bytes in activations: every saved storage that is no weight copy."""
        return sum(r.bytes for r in self.records if r.kind == "activation")

    @property
    def resident_bytes(self) -> int:
        """Bytes of the model's own storages (parameters, buffers, quantization state) that the pass saved for
        backward: there before it, so not counted in :attr:`saved_bytes`."""
        return sum(r.bytes for r in self.resident)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the all-gathered weights the backward needs (each buffer once, at its gathered size): one
        unit at a time is gathered, so this is no amount held at once (see :attr:`gathered_held_bytes`)."""
        return sum(r.bytes for r in self.gathered)

    def bytes_by(self, source: Source | None = None) -> int:
        """Saved bytes of the records a probe saw first (``hook`` or ``ctx``); None: all of them, as
        :attr:`saved_bytes`."""
        return sum(r.bytes for r in self.records if source is None or r.source == source)

    def by_module(self) -> dict[str, int]:
        """Saved bytes per module (qualified name; ``OUTSIDE`` for ops outside every module): each storage
        under the innermost module whose forward saved it, not added up into its parents."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.module] += r.bytes
        return dict(out)

    def group(self, key: Callable[[SavedRecord], str | None]) -> dict[str, list[SavedRecord]]:
        """Records grouped by ``key`` (records mapped to None are left out)."""
        out: dict[str, list[SavedRecord]] = defaultdict(list)
        for r in self.records:
            k = key(r)
            if k is not None:
                out[k].append(r)
        return dict(out)

    def by_layer(self) -> dict[str, list[SavedRecord]]:
        """Records grouped by decoder layer (``layers.N``, the one rule of :mod:`vramguard.measure.decoder`);
        records outside every decoder layer are left out."""
        return self.group(lambda r: decoder_layer(r.module))

    def under(self, prefix: str) -> list[SavedRecord]:
        """Records of ``prefix`` and its submodules."""
        return [r for r in self.records if r.module == prefix or r.module.startswith(prefix + ".")]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON: the byte totals, then every saved and every resident record
        (:meth:`SavedRecord.to_dict`)."""
        return {
            "saved_bytes": self.saved_bytes,
            "activation_bytes": self.activation_bytes,
            "weight_copy_bytes": self.weight_copy_bytes,
            "resident_bytes": self.resident_bytes,
            "gathered_bytes": self.gathered_bytes,
            "gathered_held_bytes": self.gathered_held_bytes,
            "records": [r.to_dict() for r in self.records],
            "resident": [r.to_dict() for r in self.resident],
            "gathered": [r.to_dict() for r in self.gathered],
        }


_REPORT_HOOKS: list[Callable[[LedgerReport], LedgerReport]] = []


@contextlib.contextmanager
def report_hook(hook: Callable[[LedgerReport], LedgerReport]) -> Iterator[None]:
    """Every ledger report made inside the block is ``hook``'s of it: the records of the decoder layers an
    estimate prices without running them (:mod:`vramguard.estimate.ghosts`)."""
    _REPORT_HOOKS.append(hook)
    try:
        yield
    finally:
        _REPORT_HOOKS.remove(hook)


class SavedSlot:
    """What a pack hook hands to autograd: autograd alone owns it, the hook's owner only a weakref (the
    ledger's list of packs, the :class:`~vramguard.measure.meters.SavedBytesMeter`'s finalizer), so the
    slot's death says autograd let go of the saved tensor. The one slot of every saved-tensor hook pair in
    vramguard; a meter that needs only the tensor leaves the rest at their defaults.

    Under an outer ``saved_tensors_hooks`` (``save_on_cpu``, TRL's ``OffloadActivations``) the slot holds
    what the outer pack hook returned, not the tensor, so offloading goes on while the ledger is open.

    The slot also carries what the ledger notes about the saved tensor (one object per saved tensor, and
    the notes of a released one go with it): its storage's key, life (which storage of that key, see
    ``SavedTensorLedger._life_of``) and bytes, the module saving it, and the sequence number of the node
    created last; under an outer hook also the tensor's shape, dtype and device (else read off ``tensor``).
    """

    __slots__ = ("__weakref__", "key", "life", "meta", "module", "nbytes", "outer", "seq", "tensor")

    def __init__(
        self,
        tensor: torch.Tensor | None,
        outer: Any = None,
        key: StorageKey | None = None,
        life: int = 0,
        nbytes: int = 0,
        module: str = "",
        seq: int = 0,
        meta: tuple[torch.Size, torch.dtype, torch.device] | None = None,
    ) -> None:
        self.tensor = tensor
        self.outer = outer
        self.key = key
        self.life = life
        self.nbytes = nbytes
        self.module = module
        self.seq = seq
        self.meta = meta


class _NodeClock:
    """Sequence number of the autograd node created last on this thread.

    PyTorch numbers nodes in creation order from a thread-local counter; ``_get_sequence_nr()`` reads
    the next number without creating a node. Where torch lacks it, a one-element probe op is run per
    reading and its own number discounted (including runs of probes with no real node between them).
    The probe tensor exists only then: a tracker running beside the ledger counted its 4 B while the
    ledger lived, which on CPU (not on meta) depended on when the garbage collector freed the ledger.
    """

    def __init__(self) -> None:
        self._next = getattr(torch._C._autograd, "_get_sequence_nr", None)
        self._probe = None if self._next is not None else torch.zeros((), requires_grad=True)
        self._last_probe = -2
        self._last_real = -1

    @property
    def probe(self) -> torch.Tensor | None:
        """The one-element tensor whose op the clock runs per reading (None where torch numbers nodes itself)."""
        return self._probe

    def now(self) -> int:
        if self._next is not None:
            return int(self._next()) - 1
        assert self._probe is not None
        with torch.enable_grad():
            fn = self._probe.neg().grad_fn
        if fn is None:  # inference mode: no node can have been created either
            return self._last_real
        seq = int(fn._sequence_nr())
        if seq - 1 != self._last_probe:
            self._last_real = seq - 1
        self._last_probe = seq
        return self._last_real


def _no_clock() -> int:
    raise RuntimeError("the ledger's node clock runs only inside its block")


def _weight_shapes(named: Iterable[tuple[str, torch.nn.Module]]) -> dict[str, set[tuple[int, ...]]]:
    """Logical 2-D weight shapes (both orientations) of quantized or frozen layers, and the 3-D shapes of
    frozen expert stacks (:func:`_frozen_stacks`), by module name (of ``named``: a model's
    ``named_modules()``)."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for name, module in named:
        # PEFT wrappers compute with their base layer's weight (a submodule: read from ``_modules``, as
        # ``getattr`` would, without its slow miss on the other modules)
        base = module._modules.get("base_layer")
        target = base if isinstance(base, torch.nn.Module) else module
        stacks = _frozen_stacks(target)
        if stacks:  # a mixture of experts' fused 3-D expert weights (W or W + LoRA's delta, per expert)
            shapes[name] = stacks
        weight = target._parameters.get("weight")
        if weight is None:
            continue
        module = target
        quant_state = getattr(weight, "quant_state", None)
        quantized = quant_state is not None or weight.dtype in (torch.int8, torch.uint8)
        if not quantized and weight.requires_grad:
            continue
        if quant_state is not None and getattr(quant_state, "shape", None) is not None:
            logical = tuple(int(d) for d in quant_state.shape)
        elif hasattr(module, "out_features") and hasattr(module, "in_features"):
            logical = (int(module.out_features), int(module.in_features))
        else:
            logical = tuple(int(d) for d in weight.shape)
        if len(logical) == 2:
            shapes[name] = shapes.get(name, set()) | {logical, logical[::-1]}
    return shapes


def _frozen_stacks(module: torch.nn.Module) -> set[tuple[int, ...]]:
    """Shapes (both orientations of the last two dimensions) of ``module``'s own frozen 3-D parameters: a
    mixture of experts' fused expert weights, which bitsandbytes leaves unquantized. A parameter PEFT wraps
    with a parametrization (``target_parameters``) is its ``parametrizations.<name>.original``."""
    params = list(module._parameters.values())
    wrapped = module._modules.get("parametrizations")
    if isinstance(wrapped, torch.nn.Module):
        params += [getattr(p, "original", None) for p in wrapped._modules.values()]
    shapes = set()
    for p in params:
        if isinstance(p, torch.Tensor) and p.dim() == 3 and not p.requires_grad:
            e, a, b = (int(d) for d in p.shape)
            shapes |= {(e, a, b), (e, b, a)}
    return shapes


def _under(owners: Iterable[str], names: Iterable[str]) -> frozenset[str]:
    """The names equal to or under one of ``owners`` (``""``, the root, owns every name)."""
    owners = set(owners)
    if "" in owners:
        return frozenset(names)
    out = set()
    for name in names:
        prefix = name
        while prefix:
            if prefix in owners:
                out.add(name)
                break
            prefix = prefix.rpartition(".")[0]
    return frozenset(out)


def iter_graph(roots: Iterable[torch.Tensor]) -> Iterator[Any]:
    """Every autograd node reachable from ``roots``' grad_fns, each once (depth first)."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: set[Any] = set()  # the nodes themselves (hashed by identity), held while the walk runs
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        # (a node seen already is not pushed again: the same order, fewer pops)
        stack += [fn for fn, _ in node.next_functions if fn is not None and fn not in seen]


class SavedTensorLedger:
    """Context manager around a forward pass; ``report`` is filled when the block exits.

    >>> with SavedTensorLedger(model) as ledger:
    ...     loss = model(x).sum()
    >>> ledger.report.saved_bytes

    Outputs of ``model``'s own forward are the roots of the graph walk; add others (a loss
    computed outside the model) with :meth:`add_roots`.
    """

    def __init__(self, model: torch.nn.Module | None = None, roots: Iterable[torch.Tensor] = ()) -> None:
        self.model = model
        self.report = LedgerReport()
        self._roots: list[weakref.ref[torch.Tensor]] = []
        self.add_roots(*roots)
        self._packs: list[weakref.ref[SavedSlot]] = []
        self._zero3: dict[tuple[StorageKey, int], int] = {}
        """Saved DeepSpeed ZeRO-3 parameters, gathered when saved: (storage, life) -> their whole bytes."""
        # the running modules; a module's forward spans the autograd nodes created between its entry and exit
        self._modules = ModuleStack({}, self._enter_module, self._exit_module)
        self._intervals: list[tuple[int, int, int, str]] = []  # (start, end, depth, module)
        self._handles: list[Any] = []
        self._root_handle: Any = None
        self._aborted = False
        self._with_inputs: frozenset[str] = frozenset()  # modules whose inputs the weight-copy rule needs
        self._clock: _NodeClock | None = None
        self._now: Callable[[], int] = _no_clock
        self._seq_index: tuple[int, list[str]] | None = None  # (first sequence number, module of each)
        self._hooks: Any = None
        self._outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None
        self._resident: dict[StorageKey, str] = {}
        self._residents: ResidentWalk | None = None  # the entry's walk, checked at exit
        self._registered = False  # whether a parameter, buffer or module was registered in the block
        self._weights: dict[str, set[tuple[int, ...]]] = {}
        self._trainable: frozenset[str] = frozenset()
        self._dropouts: frozenset[str] = frozenset()  # dropout modules (their masks are activations)
        # storages passed into each module, as (key, life)
        self._inputs: dict[str, set[tuple[StorageKey, int]]] = defaultdict(set)
        # key -> (weakref to the storage last seen under it, its life number): a key is a StorageImpl
        # address, unique only while that storage lives. Under offloading the saved storage may die in the
        # forward and a later one be allocated at its address: a new life, a record of its own
        self._lives: dict[StorageKey, tuple[weakref.ref[Any], int]] = {}

    @property
    def resident_keys(self) -> frozenset[StorageKey]:
        """The storages of the model's parameters, buffers and quantization state (as of the block's end)."""
        return frozenset(self._resident)

    def _pop_saved_tensors_hooks(self) -> None:
        """Take the ledger's saved-tensor hooks off autograd's stack (once)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def abort(self) -> None:
        """Stop recording now, from a forward hook of the model's whose forward raised: the saved-tensor hooks
        come off autograd's stack (the pair pushed on top of them, by whatever ran the forward, is gone
        already), the global module hooks are removed and what was recorded is dropped. The hook on the
        model's own forward stays, inert, until ``__exit__`` (torch is iterating over that module's hooks);
        no report is built."""
        self._pop_saved_tensors_hooks()
        self._modules.__exit__(None, None, None)
        root = self._root_handle
        for h in self._handles:
            if h is not root:
                h.remove()
        self._handles = [root] if root is not None else []
        self._aborted = True
        self._packs.clear()
        self._zero3.clear()
        self._inputs.clear()
        self._lives.clear()
        self._roots.clear()
        self._intervals.clear()

    def current_module(self) -> str:
        """The qualified name of the innermost module whose forward is running now (``OUTSIDE`` when none)."""
        return self._modules.current()

    @property
    def probe_tensor(self) -> torch.Tensor | None:
        """The tensor the ledger's node clock makes for its own readings while the block runs, on a torch that
        does not number autograd nodes itself (None otherwise): it is the ledger's, not the block's."""
        return self._clock.probe if self._clock is not None else None

    def add_roots(self, *tensors: Any) -> None:
        """Add tensors (in any nesting of tuples, lists and dicts) where the graph walk starts, e.g. a loss
        computed outside the model. Call it inside the block: the walk runs when the block exits. Only weak
        references are kept, so a root freed before then is not walked."""
        for t in tensor_leaves(tensors):
            self._roots.append(weakref.ref(t))

    # -- recording ---------------------------------------------------------------------------

    def __enter__(self) -> SavedTensorLedger:
        self._clock = _NodeClock()
        self._now = self._clock.now
        self._seq_index = None
        if self.model is not None:
            named = list(self.model.named_modules())
            self._residents = ResidentWalk(self.model, named)
            self._resident = self._residents.owners
            self._registered = False
            self._handles += [
                register(self._on_register)
                for register in (
                    register_module_parameter_registration_hook,
                    register_module_buffer_registration_hook,
                    register_module_module_registration_hook,
                )
            ]
            self._weights = _weight_shapes(named)
            # leaf modules with a 2-D weight of their own that trains (LoRA's A and B): what they compute is
            # an adapter's, never a copy of a frozen weight around them (under autocast lora_A casts its input
            # inside: a (tokens, in_features) tensor that has the frozen weight's shape when tokens == out).
            # Not DoRA's magnitude (1-D): its forward dequantizes the base weight and keeps it (with dropout)
            self._trainable = frozenset(
                n
                for n, m in named
                if not m._modules
                and any(p is not None and p.requires_grad and p.dim() == 2 for p in m._parameters.values())
            )
            # dropout modules (PEFT's lora_dropout): what they save is a mask of their input, a float in its
            # dtype on the CPU and on meta (a bool with CUDA's native_dropout), never a copy of a weight
            dropout = torch.nn.modules.dropout._DropoutNd
            self._dropouts = frozenset(n for n, m in named if isinstance(m, dropout))
            self._with_inputs = _under(self._weights, (n for n, _ in named))
            self._modules.names = {id(m): n for n, m in named}
            self._modules.__enter__()
            self._root_handle = self.model.register_forward_hook(self._root_output)
            self._handles.append(self._root_handle)
        self._outer = (
            hooks_in_force()
        )  # activation offloading goes on inside the block: the ledger calls them
        unpack = self._unpack if self._outer is None else self._unpack_outer
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pop_saved_tensors_hooks()
        self._modules.__exit__(exc_type, exc, tb)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if exc_type is None:
            if self.model is not None:
                # what is resident is decided at the end: a forward may replace a parameter's storage
                # (bitsandbytes' Linear4bit casts its bias to the input dtype on the first call), and
                # the freed storage's key may then be reused by an activation, or the old storage
                # be kept by autograd: neither is a parameter any more (names as first seen). Walked again
                # only where the entry's walk may be out of date (a storage replaced, a module registered)
                assert self._residents is not None
                if self._registered or not self._residents.unchanged():
                    self._resident = resident_storages(self.model, first_names=self._resident)
            report = self._build_report()
            for hook in _REPORT_HOOKS:
                report = hook(report)
            self.report = report
        self._packs.clear()
        self._zero3.clear()
        self._inputs.clear()
        self._lives.clear()
        self._residents = None

    def _enter_module(self, name: str, module: torch.nn.Module) -> int:
        return self._now()

    def _exit_module(
        self, name: str, start: int, module: torch.nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        self._intervals.append((start, self._now(), len(self._modules.stack), name))
        self._seq_index = None
        if name in self._with_inputs:  # the call's arguments are alive until it returns: same storages
            inputs = self._inputs[name]
            # (most calls pass tensors as plain positional arguments: no flattening then)
            if kwargs or not all(type(a) is torch.Tensor for a in args):
                args = tensor_leaves((args, kwargs))
            for t in args:
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, wrappers)
                    continue
                inputs.add((storage._cdata, self._life_of(storage)))

    def _on_register(self, module: torch.nn.Module, *_: Any) -> None:
        # (a forward may fill a new container with the model's modules: transformers slices its layers)
        if id(module) in self._modules.names:
            self._registered = True

    def _root_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._aborted:
            self.add_roots(output)

    def _life_of(self, storage: Any) -> int:
        """The life number of ``storage`` under its key: the same while that storage lives, a new one for a
        storage allocated at the address of one that died."""
        key = storage._cdata
        seen = self._lives.get(key)
        if seen is not None and seen[0]() is storage:
            return seen[1]
        life = seen[1] + 1 if seen is not None else 0
        self._lives[key] = (weakref.ref(storage), life)
        return life

    def _pack(self, tensor: torch.Tensor) -> SavedSlot:
        # runs once per saved tensor: _life_of and ModuleStack.current inlined
        storage = tensor.untyped_storage() if type(tensor) is torch.Tensor else storage_of(tensor)
        key = storage._cdata
        seen = self._lives.get(key)
        if seen is not None and seen[0]() is storage:
            life = seen[1]
        else:
            life = seen[1] + 1 if seen is not None else 0
            self._lives[key] = (weakref.ref(storage), life)
        stack = self._modules.stack
        module = stack[-1] if stack else OUTSIDE
        if (
            self._outer is None
            and type(tensor) is not torch.Tensor
            and getattr(tensor, "ds_id", None) is not None
        ):
            return self._pack_zero3(tensor, key, life, storage.nbytes(), module)
        if self._outer is None:
            slot = SavedSlot(tensor.detach(), None, key, life, storage.nbytes(), module, self._now())
        else:
            meta = (tensor.shape, tensor.dtype, tensor.device)
            slot = SavedSlot(
                None, self._outer[0](tensor), key, life, storage.nbytes(), module, self._now(), meta
            )
        self._packs.append(weakref.ref(slot))
        return slot

    def _pack_zero3(self, param: Any, key: StorageKey, life: int, nbytes: int, module: str) -> SavedSlot:
        """A DeepSpeed ZeRO-3 parameter saved for backward (its ``LinearFunctionForZeroStage3`` saves the weight):
        kept as the parameter itself, as autograd keeps it, not a detached alias of the storage gathered now,
        which would hold that all-gather alive past the engine's release; DeepSpeed gathers the parameter
        again before backward uses it. Recorded as a ``gathered-weight`` at its whole size; a persistent
        parameter (never released) is resident."""
        if not getattr(param, "ds_persist", False):
            self._zero3[(key, life)] = int(param.ds_numel) * param.element_size()
        slot = SavedSlot(param, None, key, life, nbytes, module, self._now())
        self._packs.append(weakref.ref(slot))
        return slot

    @staticmethod
    def _unpack(slot: SavedSlot) -> torch.Tensor:
        return slot.tensor  # type: ignore[return-value]

    def _unpack_outer(self, slot: SavedSlot) -> torch.Tensor:
        assert self._outer is not None
        return self._outer[1](slot.outer)

    # -- accounting --------------------------------------------------------------------------

    def module_of_node(self, node: Any) -> str:
        """The innermost module (qualified name) whose forward created autograd ``node`` while the ledger
        was open, or ``OUTSIDE``: the node -> module map behind each record's ``module``. Valid after
        the block, for nodes of the recorded forward (e.g. to name backward's work per module)."""
        return self._module_of_seq(int(node._sequence_nr()))

    def _module_of_seq(self, seq: int) -> str:
        if self._seq_index is None:
            self._seq_index = self._index_intervals()
        first, modules = self._seq_index
        i = seq - first
        return modules[i] if 0 <= i < len(modules) else OUTSIDE

    def _index_intervals(self) -> tuple[int, list[str]]:
        """The innermost module of every sequence number the intervals cover: each interval ``(start, end]``
        painted over its parents (forwards nest, so deeper intervals lie inside shallower ones; at one depth
        they are disjoint). One list entry per node the forward created."""
        if not self._intervals:
            return 0, []
        first = min(start for start, _, _, _ in self._intervals) + 1
        last = max(end for _, end, _, _ in self._intervals)
        modules = [OUTSIDE] * max(0, last - first + 1)
        order = sorted(range(len(self._intervals)), key=lambda i: (self._intervals[i][2], -i))
        for i in order:
            start, end, _, name = self._intervals[i]
            if end > start:
                modules[start + 1 - first : end + 1 - first] = [name] * (end - start)
        return first, modules

    def _kind(
        self, module: str, shape: tuple[int, ...], dtype: Any, key: StorageKey, life: int, alive: bool
    ) -> Kind:
        if (
            alive and key in self._resident
        ):  # (a storage that died is no parameter, whatever took its address)
            return "resident"
        if len(shape) in (2, 3) and self._weights:
            if dtype == torch.bool or module in self._dropouts:  # a mask (dropout's) with a weight's shape
                return "activation"
            owner = module  # the owners of weights that ``module`` is inside: itself, its parents, the root
            while True:
                if owner in self._trainable and owner not in self._weights:
                    return "activation"
                shapes = self._weights.get(owner)
                if shapes is not None and shape in shapes and not self._passed_in((key, life), module, owner):
                    return "weight-copy"
                if not owner:
                    return "activation"
                owner = owner.rpartition(".")[0]
        return "activation"

    def _passed_in(self, key: tuple[StorageKey, int], module: str, owner: str) -> bool:
        """Whether the storage was an input of ``module`` or of an enclosing module up to ``owner``:
        then it is an activation that merely has a weight's shape (a LoRA-A input of batch*seq
        rows equal to the layer's out_features), not a copy made from the weight."""
        name = module
        while True:
            if key in self._inputs.get(name, ()):
                return True
            if name == owner or not name:
                return False
            name = name.rpartition(".")[0]

    def _build_report(self) -> LedgerReport:
        roots = [t for t in (r() for r in self._roots) if t is not None]
        nodes = list(iter_graph(roots))
        by_seq = {n._sequence_nr(): n for n in nodes}
        # (storage key, life) -> [module, shape, dtype, bytes, device, source, attribute, node sequence numbers]
        entries: dict[tuple[StorageKey, int], list[Any]] = {}

        for ref in self._packs:
            slot = ref()
            if slot is None:  # autograd already released it (graph freed or consumed)
                continue
            key = (slot.key, slot.life)
            e = entries.get(key)
            if e is None:
                t = slot.tensor
                shape, dtype, device = (t.shape, t.dtype, t.device) if t is not None else slot.meta
                entries[key] = [slot.module, shape, dtype, slot.nbytes, device, "hook", None, [slot.seq]]
            elif slot.seq not in e[7]:
                e[7].append(slot.seq)

        for node in nodes:
            if not isinstance(node, BackwardCFunction):
                continue
            seq = node._sequence_nr()
            module = self._module_of_seq(seq)
            for attr, value in list(vars(node).items()):
                if attr.startswith("_") or attr in ("saved_tensors", "to_save"):
                    continue
                for path, t in tensors_in(value):
                    # (a DTensor, e.g. FSDP2's sharded parameters in its post-backward hook's context:
                    # its local shard holds its bytes here, its wrapper's storage has the global size)
                    t = local_tensor(t)
                    storage = t.untyped_storage()
                    key = (storage._cdata, self._life_of(storage))
                    e = entries.get(key)
                    if e is None:
                        entries[key] = [
                            module,
                            t.shape,
                            t.dtype,
                            storage.nbytes(),
                            t.device,
                            "ctx",
                            attr + path,
                            [seq],
                        ]
                    elif seq not in e[7]:
                        e[7].append(seq)

        names: dict[int, str] = {}  # node names, dtype and device strings: each made once
        strings: dict[Any, str] = {}

        def node_name(seq: int) -> str:
            name = names.get(seq)
            if name is None:
                node = by_seq.get(seq)
                name = names[seq] = node.name() if node is not None else "<unknown>"
            return name

        def string(value: Any) -> str:
            name = strings.get(value)
            if name is None:
                name = strings[value] = str(value).removeprefix("torch.")
            return name

        report = LedgerReport()
        resident = self._resident
        lives = self._lives
        gathered = gathered_storages(self.model) if self.model is not None else {}
        for (key, life), (module, shape, dtype, nbytes, device, source, attribute, seqs) in entries.items():
            shape = tuple(shape)
            seen = lives.get(key)
            storage = seen[0]() if seen is not None and seen[1] == life else None
            alive = storage is not None
            zero3 = self._zero3.get((key, life))
            if zero3 is not None:
                # a ZeRO-3 parameter gathered when saved: released after its module's forward (held past the
                # forward only where its storage is still alive and full)
                kind = "gathered-weight"
                nbytes = zero3
                if alive and storage.nbytes():
                    report.gathered_held_bytes += nbytes
            elif alive and key in gathered:
                # an all-gather buffer: at its gathered size (a hook saw it full, a ctx walk after the
                # engine freed it sees 0 B); held past the forward only where the engine did not free it
                kind = "gathered-weight"
                nbytes = gathered[key]
                if storage.nbytes():
                    report.gathered_held_bytes += nbytes
            elif alive and key in resident:
                kind = "resident"
            else:
                kind = self._kind(module, shape, dtype, key, life, alive)
            record = _record(
                module=module,
                node=node_name(seqs[0]),
                shape=shape,
                dtype=string(dtype),
                bytes=nbytes,
                source=source,
                kind=kind,
                device=string(device),
                attribute=attribute,
                owner=resident.get(key) if alive else None,
                also_saved_by=tuple(node_name(seq) for seq in seqs[1:]) if len(seqs) > 1 else (),
                saved_in=tuple(self._module_of_seq(seq) for seq in seqs[1:]) if len(seqs) > 1 else (),
                key=key if alive else None,
                new=None,
            )
            if kind == "resident":
                report.resident.append(record)
            elif kind == "gathered-weight":
                report.gathered.append(record)
            else:
                report.records.append(record)
        report.records.sort(key=lambda r: (-r.bytes, r.module))
        report.gathered.sort(key=lambda r: (-r.bytes, r.module))
        return report


_RECORD_FIELDS = frozenset(f.name for f in fields(SavedRecord))


def replaced(record: SavedRecord, **values: Any) -> SavedRecord:
    """``record`` with ``values`` in place of its own (a cheap ``dataclasses.replace``, see :func:`_record`)."""
    return _record(**{**vars(record), **values})


def _record(**values: Any) -> SavedRecord:
    """``SavedRecord(**values)`` with every field given, made the way ``dataclasses.replace`` copies are
    not: its frozen ``__init__`` sets each field through ``object.__setattr__``, which for the hundreds of
    records of a report is most of the report's cost; here the instance dict is filled at once."""
    assert values.keys() == _RECORD_FIELDS
    record = object.__new__(SavedRecord)
    record.__dict__.update(values)
    return record
