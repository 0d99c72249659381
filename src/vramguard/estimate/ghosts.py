"""Identical decoder layers priced from one: a deep model's meta step runs four of its layers.

A decoder of L identical layers (every layer the same modules, parameter shapes, dtypes and settings) runs
the same ops in every layer but the first and the last: layer k's forward frees layer k-1's output where
layer k-1's frees k-2's, keeps what it saves until its own backward, and its backward frees the gradient
layer k+1 passed it and passes one on. The estimate runs layers 0, 1, 2 and L-1 (the decoder's loop takes
the slice of the layers it runs, or iterates over them) and prices layers 3..L-2 from layer 2, in the
tracker's count (:meth:`vramguard.measure.tracker.StorageTracker.add`); where the loop treats leading layers
apart (Qwen3-VL's DeepStack: :data:`LEADING`), those and one more run, and the layer after them is the one
priced from. A vision-language model's text layers are priced so (its tower runs whole):

* a *span* is layer 2's forward (from its call to the call of the next layer run) and its backward (from the
  gradient of its output to that of its input, the recompute of a checkpointed layer inside): the bytes live
  at its start ``s``, its highest ``p`` and its end ``e``. Its n = L-4 copies start at ``e``, ``e + (e-s)``,
  ...: they add ``n (e-s)`` bytes and reach ``e + (p-s) + max(0, (n-1)(e-s))`` (a sum of identical steps
  is highest at its first or its last);
* what a span made and still holds at its end leaves, in the copies, as its original leaves: in the copies'
  own backward for what the forward kept for backward (the backward span frees it, copied with it), else when
  the original is freed (the autocast cache at the forward's end, the graph's tensors after backward:
  :meth:`~vramguard.measure.tracker.StorageTracker.shadow`); the output a span passes to the next layer is
  freed by the next copy's span;
* the copies' LoRA gradients, counted by the backward's copies, are made real on layers 3..L-2's own
  parameters (:meth:`~vramguard.measure.tracker.StorageTracker.adopt`): the optimizer, the gradient clipping
  and ``zero_grad`` run over every parameter of the model, which is built whole;
* the counters of the step's contexts (forced decisions, autocast's) gain n times a span's counts, and the
  ledger's report gets layer 2's records under each copy's name.

Not used (the step runs every layer) where any of this is not known to hold: an allocation log (it lists
every storage), a mixture of experts, activation offloading, Liger, another method than QLoRA, a sharded or
multi-device step, fewer than :data:`MIN_LAYERS` layers, a decoder whose loop is over none of :data:`LOOPS` or
whose loop uses a layer's index but to read a config list or a :data:`LEADING` sequence
whose items for layers 1..L-1 are alike (``enumerate`` counts the layers run: Granite SWA's per-layer RoPE
theta, Gemma 4's first shared-KV layer), a config list of one item a layer that differs over layers 1..L-1
(a layer may read it by its ``layer_idx``), layers that differ, a counter that cannot add; or with
:data:`ALL_LAYERS` set. tests/test_ghost_layers.py holds the reports equal to running every layer, byte for
byte.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vramguard.measure.ledger import LedgerReport, SavedRecord, replaced, report_hook
from vramguard.measure.storage import StorageKey
from vramguard.measure.tracker import FrameStats, MemoryTracker, StorageTracker
from vramguard.workload.training import repeatable

ALL_LAYERS = "VRAMGUARD_ALL_LAYERS"
"""Set (to anything but empty or 0), a meta step runs every decoder layer (the reference of
tests/test_ghost_layers.py)."""

MIN_LAYERS = 8
"""Fewer layers than this run whole: the four run are most of them."""

RUN = 2
"""The layer whose spans stand for the ones not run (layers 0, 1, 2 and the last run), unless the loop treats
leading layers apart (:data:`LEADING`): then the first layer after them and the one after that."""


def _deepstack_layers(config: Any) -> int | None:
    """How many leading text layers get a DeepStack embedding: one per index of the vision config's
    ``deepstack_visual_indexes``; None where the config has none (Cohere Compass's text model alone,
    ``cohere_compass_text``, whose loop is Qwen3-VL's)."""
    indexes = getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None)
    return None if indexes is None else len(indexes)


LEADING: dict[str, Callable[[Any], int | None]] = {
    # Qwen3-VL's text model adds one DeepStack visual embedding to the output of each of its first layers
    "deepstack_visual_embeds": _deepstack_layers,
}
"""A sequence the decoder's loop indexes by the layer's index (``X[i]``, ``i in range(len(X))``) -> how many
leading layers it reaches, from the model's config: those layers run, and so does the next (whose gradient ends
the backward span of the layer priced from). A loop that indexes another, or one whose count the config does not
tell (None), runs every layer."""

LOOPS = ("self.layers[: self.config.num_hidden_layers]", "self.layers")
"""What a decoder's loop may iterate over (plain or in ``enumerate``) for the layers not run to be taken out of it
(the slice of the layers, or the layers themselves: Qwen2-VL's and Qwen2.5-VL's text models)."""


def decoder_of(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(qualified name, module list) of ``model``'s decoder layers: a ``ModuleList`` called ``layers`` of
    ``config.num_hidden_layers`` modules whose owner's config is the model's text config (a vision tower's
    layers are not these) and whose ``forward`` loops over one of :data:`LOOPS`; None otherwise."""
    top = getattr(model, "config", None)
    text = top.get_text_config() if hasattr(top, "get_text_config") else top
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or name.rsplit(".", 1)[-1] != "layers":
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        config = getattr(parent, "config", None)
        if config is not text or getattr(config, "num_hidden_layers", None) != len(module):
            continue
        try:
            source = inspect.getsource(type(parent).forward)
        except (OSError, TypeError):
            continue
        if _loop_reads(source) is not None:
            return name, module
    return None


def _loop_reads(source: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """What the decoder's loop (over one of :data:`LOOPS`) reads at a layer's index ``i`` (``for i, layer in
    enumerate(self.layers)``): the config lists (``self.config.X[i]``) and the local sequences (``X[i]``, ``i in
    range(len(X))``: :data:`LEADING`'s), each set empty for a loop without the index; None where the loop uses the
    index any other way (``i == self.first_kv_shared_layer_idx``, ``per_layer_inputs[:, :, i]``) or is not found.
    Its layers run, ``i`` counts the layers run (0, 1, 2, 3), not their places in the model."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    loops = {ast.unparse(ast.parse(loop, mode="eval").body) for loop in LOOPS}
    lists: set[str] = set()
    local: set[str] = set()
    found = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.For) or not _iterates(node.iter, loops):
            continue
        found = True
        if isinstance(node.target, ast.Name) and ast.unparse(node.iter) in loops:
            continue
        it, target = node.iter, node.target
        if not (
            isinstance(it, ast.Call)
            and ast.unparse(it.func) == "enumerate"
            and len(it.args) == 1
            and not it.keywords
            and ast.unparse(it.args[0]) in loops
            and isinstance(target, ast.Tuple)
            and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)
        ):
            return None
        index = target.elts[0].id  # type: ignore[attr-defined]
        read: set[int] = set()  # the index's Name nodes in an allowed use
        for sub in ast.walk(node):
            if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Name) and sub.slice.id == index:
                if isinstance(sub.value, ast.Attribute) and ast.unparse(sub.value.value) == "self.config":
                    read.add(id(sub.slice))
                    lists.add(sub.value.attr)
                elif isinstance(sub.value, ast.Name):
                    read.add(id(sub.slice))
                    local.add(sub.value.id)
            name = _below_len(sub, index)
            if name is not None:
                read.add(id(sub.left))  # type: ignore[attr-defined]
                local.add(name)
        for sub in ast.walk(node):
            other = sub is not target.elts[0] and id(sub) not in read
            if isinstance(sub, ast.Name) and sub.id == index and other:
                return None
    return (frozenset(lists), frozenset(local)) if found else None


def _below_len(node: ast.AST, index: str) -> str | None:
    """``X`` where ``node`` is ``index in range(len(X))``, else None."""
    if not (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and node.left.id == index
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.In)
    ):
        return None
    bound = node.comparators[0]
    if (
        isinstance(bound, ast.Call)
        and ast.unparse(bound.func) == "range"
        and len(bound.args) == 1
        and isinstance(bound.args[0], ast.Call)
        and ast.unparse(bound.args[0].func) == "len"
        and len(bound.args[0].args) == 1
        and isinstance(bound.args[0].args[0], ast.Name)
    ):
        return bound.args[0].args[0].id
    return None


def _iterates(node: ast.expr, loops: set[str]) -> bool:
    """Whether a ``for`` loop's iterable is one of ``loops`` or uses one (``enumerate(self.layers)``,
    ``zip(self.layers, ...)``: the latter not taken, see :func:`_loop_reads`)."""
    return any(
        ast.unparse(sub) in loops for sub in ast.walk(node) if isinstance(sub, (ast.Attribute, ast.Subscript))
    )


def _per_layer_alike(config: Any, layers: int, reads: frozenset[str]) -> bool:
    """Whether every per-layer list of ``config`` (a list or tuple of ``layers`` items: ``layer_types``,
    ``layer_rope_theta``) has the same item for layers 1..L-1, and each the loop reads (``reads``) is one:
    the layers run read items 0, 1, 2 and 3 (:func:`_loop_reads`), a layer its own by its ``layer_idx`` (left
    out of :func:`signature`)."""
    values = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == layers}
    if any(name not in values for name in reads):
        return False
    return all(all(item == v[1] for item in v[2:]) for v in values.values())


def _plain(value: Any) -> Any:
    """A comparable form of a module attribute: values as they are, containers element by element, a tensor
    (one kept as a plain attribute, neither parameter nor buffer) by its class, shape, dtype and
    ``requires_grad``, any other object by its type (its identity differs per layer where its settings do
    not)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return (type(value).__qualname__, tuple(value.shape), repr(value.dtype), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(v) for v in value))
    return type(value).__qualname__


def signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    """What makes two decoder layers the same step: every submodule's name, class and plain attributes (but
    ``layer_idx``, which only a cache reads), every parameter's and buffer's name, class, shape, dtype and
    ``requires_grad``, and a 4-bit weight's quantized shape."""
    parts: list[Any] = []
    for name, sub in layer.named_modules():
        attributes = tuple(
            sorted(
                (k, _plain(v))
                for k, v in vars(sub).items()
                if not k.startswith("_") and k not in ("training", "layer_idx")
            )
        )
        parts.append((name, type(sub).__qualname__, attributes))
    for name, t in (*layer.named_parameters(), *layer.named_buffers()):
        state = getattr(t, "quant_state", None)
        quantized = tuple(getattr(state, "shape", ())) if state is not None else None
        parts.append((name, type(t).__qualname__, tuple(t.shape), t.dtype, t.requires_grad, quantized))
    return tuple(parts)


def eligible(q: Any, events: Any, counters: list[Any]) -> tuple[str, torch.nn.ModuleList, int] | None:
    """(name, layers, the layer priced from: :data:`RUN` or later, see :data:`LEADING`) of the decoder whose
    layers after that one but the last are priced from it in ``q``'s meta step, or None where the step must run
    them (see the module)."""
    if os.environ.get(ALL_LAYERS, "") not in ("", "0") or events is not None:
        return None
    config = q.config
    if config.offload_activations or config.use_liger_kernel:
        return None
    if config.method != "qlora" or str(getattr(q, "device", "meta")) != "meta":
        return None
    model = q.model
    if hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync"):
        return None
    if repeatable(counters) is None:
        return None
    found = decoder_of(model)
    if found is None:
        return None
    name, layers = found
    parent = model.get_submodule(name.rpartition(".")[0])
    reads = _loop_reads(inspect.getsource(type(parent).forward))
    if reads is None or any(local not in LEADING for local in reads[1]):
        return None
    leading = [LEADING[local](model.config) for local in reads[1]]
    if None in leading:
        return None
    run = max([RUN, *(n + 1 for n in leading if n is not None)])
    if len(layers) < max(MIN_LAYERS, run + 4) or not _per_layer_alike(parent.config, len(layers), reads[0]):
        return None
    if any("experts" in n for n, _ in layers[run].named_modules()):
        return None
    first = signature(layers[1])
    if any(signature(layer) != first for layer in list(layers)[2:]):
        return None
    return name, layers, run


def _runs_some(cls: type, run: frozenset[int]) -> type:
    """``cls`` (a ``ModuleList``) whose slices and iteration hold only the layers in ``run`` (by identity)."""

    class RunsSome(cls):  # type: ignore[misc, valid-type]
        def __getitem__(self, idx: Any) -> Any:
            if isinstance(idx, slice):
                kept = [m for m in list(self._modules.values())[idx] if id(m) in run]
                return torch.nn.ModuleList(kept)
            return super().__getitem__(idx)

        def __iter__(self) -> Iterator[torch.nn.Module]:
            return (m for m in self._modules.values() if id(m) in run)

    RunsSome.__name__ = RunsSome.__qualname__ = cls.__name__
    return RunsSome


def _storage(value: Any) -> StorageKey | None:
    t = value[0] if isinstance(value, (tuple, list)) and value else value
    if isinstance(getattr(t, "hidden_states", None), torch.Tensor):
        t = t.hidden_states
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None


def _tensor(value: Any) -> torch.Tensor | None:
    t = value[0] if isinstance(value, (tuple, list)) and value else value
    return t if isinstance(t, torch.Tensor) else None


class _Span:
    """One span of the layer run (its forward or its backward): where it started and what the counters read."""

    def __init__(self, tracker: MemoryTracker, counters: list[Any]) -> None:
        self.tracker, self.counters = tracker, counters
        self.frame = tracker.open_frame(FrameStats("ghosts"))
        self.source: StorageTracker = tracker.source  # type: ignore[assignment]
        self.marks = self.source.marks()
        self.counts = [c.counts() for c in counters]

    def end(self, copies: int, passed_on: frozenset[StorageKey]) -> dict[StorageKey, int]:
        """Close the span and count ``copies`` more of it; what it made and still holds (but ``passed_on``,
        which the next copy frees): key -> bytes."""
        stats = self.tracker.close_frame(self.frame)
        start, top, end = stats.start_bytes, stats.peak_bytes, stats.end_bytes
        step = end - start
        self.source.add(copies * step, end + (top - start) + max(0, (copies - 1) * step))
        for counter, before in zip(self.counters, self.counts, strict=True):
            counter.add({name: copies * (n - before.get(name, 0)) for name, n in counter.counts().items()})
        made = self.source.born_since(self.marks)
        return {key: nbytes for key, nbytes in made.items() if key not in passed_on}


class GhostLayers:
    """The context of a meta step in which ``layers`` (named ``prefix``) run only 0..``run`` (:data:`RUN`, or
    later: :data:`LEADING`) and the last; ``tracker``: the step's tracker when it runs (a trainer's callback makes it at ``train()``);
    ``counters``: the step's contexts' counters (``counts``/``add``). See the module."""

    def __init__(
        self,
        prefix: str,
        layers: torch.nn.ModuleList,
        tracker: Callable[[], MemoryTracker | None],
        counters: list[Any],
        run: int = RUN,
    ) -> None:
        self.prefix, self.layers, self.tracker_of, self.run = prefix, layers, tracker, run
        self.counters = repeatable(counters) or []
        self.last = len(layers) - 1
        self.copies = self.last - run - 1  # layers run+1..L-2
        self.forward: _Span | None = None
        self.backward: _Span | None = None
        self.output: frozenset[StorageKey] = frozenset()
        self.kept: frozenset[StorageKey] = frozenset()  # what the forward span made and held at its end

    # the context ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self) -> Iterator[GhostLayers]:
        """Inside: the decoder's loop runs layers 0..``run`` and the last, and the hooks price the others
        (a layer not run that is called anyway is an internal error); after it, every layer runs again."""
        layers = self.layers
        run = frozenset(id(layers[i]) for i in (*range(self.run + 1), self.last))
        original = type(layers)
        handles = [
            layers[self.run].register_forward_pre_hook(self._forward_begins),
            layers[self.run].register_forward_hook(self._forward_output),
            layers[self.last].register_forward_pre_hook(self._forward_ends),
            layers[self.run - 1].register_forward_hook(self._input_made),
            *(layers[i].register_forward_pre_hook(_not_run) for i in range(self.run + 1, self.last)),
        ]
        layers.__class__ = _runs_some(original, run)
        try:
            with report_hook(self._records):
                yield self
        finally:
            layers.__class__ = original
            for h in handles:
                h.remove()

    # forward -----------------------------------------------------------------------------------
    def _tracking(self) -> MemoryTracker | None:
        tracker = self.tracker_of()
        if tracker is None or not isinstance(tracker.source, StorageTracker) or not tracker.source.seeing:
            return None
        return tracker

    def _forward_begins(self, module: Any, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if self.backward is not None:
            raise RuntimeError(
                "a forward began inside a priced layer's backward span (vramguard.estimate.ghosts)"
            )
        tracker = self._tracking()
        if tracker is not None:
            self.forward = _Span(tracker, self.counters)

    def _forward_output(self, module: Any, args: Any, output: Any) -> None:
        if self.forward is None:
            return
        key = _storage(output)
        self.output = frozenset() if key is None else frozenset({key})
        t = _tensor(output)
        if t is not None and t.requires_grad:
            t.register_hook(self._backward_begins)

    def _forward_ends(self, module: Any, args: Any) -> None:
        span, self.forward = self.forward, None
        if span is None:
            return
        kept = span.end(self.copies, self.output)
        self.kept = frozenset(kept)
        for key, nbytes in kept.items():
            span.source.shadow(key, self.copies * nbytes)
        self._casts_of_copies()

    def _casts_of_copies(self) -> None:
        """A parameter or buffer the priced layer's forward replaced by another dtype (bitsandbytes' Linear4bit
        casts its bias to the input's dtype on its first call), replaced so on the layers not run too: the new
        storages' bytes were counted with the span's copies, and the model's weights are read from it."""
        run = self.layers[self.run]
        theirs = {**dict(run.named_parameters()), **dict(run.named_buffers())}
        with _unseen():
            for i in range(self.run + 1, self.last):
                layer = self.layers[i]
                for name, t in (*layer.named_parameters(), *layer.named_buffers()):
                    if t.dtype != theirs[name].dtype:
                        t.data = torch.empty_like(theirs[name].data)

    # backward ----------------------------------------------------------------------------------
    def _input_made(self, module: Any, args: Any, output: Any) -> None:
        t = _tensor(output)
        if t is not None and t.requires_grad and torch._C._current_graph_task_id() == -1:
            t.register_hook(self._backward_ends)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        tracker = self._tracking()
        if tracker is None:
            return
        self.backward = _Span(tracker, self.counters)
        # what the forward span kept and its copies free in their own backward: the copied span frees them
        self.backward.source.held = self.kept

    def _backward_ends(self, grad: torch.Tensor) -> None:
        span, self.backward = self.backward, None
        if span is None:
            return
        source = span.source
        layer = self.layers[self.run]
        grads = {p.grad.untyped_storage()._cdata for p in layer.parameters() if p.grad is not None}
        made = span.end(self.copies, frozenset({grad.untyped_storage()._cdata, *grads}))
        source.held = frozenset()
        for key, nbytes in made.items():
            source.shadow(key, self.copies * nbytes)
        self._gradients_of_copies(source)

    def _gradients_of_copies(self, source: StorageTracker) -> None:
        """The gradients the backward's copies counted, made on the layers not run's own parameters (the
        optimizer steps them): counted already, adopted, not added."""
        named = dict(self.layers[self.run].named_parameters())
        with _unseen():
            for i in range(self.run + 1, self.last):
                for name, p in self.layers[i].named_parameters():
                    grad = named[name].grad
                    if grad is None or p.grad is not None:
                        continue
                    p.grad = torch.empty_like(grad)
                    source.adopt(p.grad.untyped_storage())

    # the ledger --------------------------------------------------------------------------------
    def _records(self, report: LedgerReport) -> LedgerReport:
        """``report`` with the priced layer's records copied under each layer not run, and each storage saved
        in more layers than one (the rotary embedding's, the mask) also saved by the copies of that layer's
        nodes."""
        run = f"{self.prefix}.{self.run}"
        names = [f"{self.prefix}.{i}" for i in range(self.run + 1, self.last)]
        mine = [r for r in report.records if _under(r.module, run)]
        records = [_also_saved(r, run, names) for r in report.records]
        records += [_renamed(r, run, name) for name in names for r in mine]
        records.sort(key=lambda r: (-r.bytes, r.module))
        resident = [_also_saved(r, run, names) for r in report.resident]
        at = max((i for i, r in enumerate(resident) if _under(r.module, run)), default=None)
        if at is not None:
            theirs = [r for r in resident if _under(r.module, run)]
            resident[at + 1 : at + 1] = [_renamed(r, run, name) for name in names for r in theirs]
        report.records, report.resident = records, resident
        return report


@contextlib.contextmanager
def _unseen() -> Iterator[None]:
    """Nothing the step's modes see (the tracker's dispatch mode, autocast's function mode, which counts what it
    routes): the storages made here are priced already."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _not_run(module: Any, args: Any) -> None:
    raise RuntimeError(
        "a decoder layer priced from another ran (vramguard.estimate.ghosts): an internal error"
    )


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _rename(value: str | None, run: str, name: str) -> str | None:
    return name + value[len(run) :] if value is not None and _under(value, run) else value


def _renamed(record: SavedRecord, run: str, name: str) -> SavedRecord:
    """``record`` of layer ``run`` as the layer ``name`` not run has it."""
    return replaced(
        record,
        module=_rename(record.module, run, name),
        owner=_rename(record.owner, run, name),
        saved_in=tuple(_rename(m, run, name) for m in record.saved_in),
        key=None,
    )


def _also_saved(record: SavedRecord, run: str, names: list[str]) -> SavedRecord:
    """``record`` of a storage layer ``run``'s nodes also saved (first saved elsewhere) with the nodes of
    each layer in ``names`` after them, as the forward of every layer saves it."""
    if _under(record.module, run):
        return record
    inside = [i for i, module in enumerate(record.saved_in) if _under(module, run)]
    if not inside:
        return record
    at = inside[-1] + 1
    nodes = tuple(record.also_saved_by[i] for name in names for i in inside)
    modules = tuple(_rename(record.saved_in[i], run, name) or "" for name in names for i in inside)
    return replaced(
        record,
        also_saved_by=record.also_saved_by[:at] + nodes + record.also_saved_by[at:],
        saved_in=record.saved_in[:at] + modules + record.saved_in[at:],
    )


def ghost_layers(
    q: Any, tracker: Callable[[], MemoryTracker | None], counters: list[Any], events: Any = None
) -> contextlib.AbstractContextManager[Any]:
    """The context pricing ``q``'s identical decoder layers from one (see the module), or one that does
    nothing where the step must run them all."""
    found = eligible(q, events, counters)
    if found is None:
        return contextlib.nullcontext()
    prefix, layers, run = found
    return GhostLayers(prefix, layers, tracker, counters, run).running()
