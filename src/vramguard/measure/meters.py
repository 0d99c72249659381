"""Judging a forward pass against a saved-bytes budget, with three probes that must agree.

Why three: each probe alone can be fooled.

* ``hook``: ``saved_tensors_hooks`` sees ``save_for_backward`` and built-in ops' saves, but not a
  tensor an ``autograd.Function`` keeps as a plain ``ctx`` attribute;
* ``ctx``: the ledger's walk of the autograd graph into custom Functions' contexts sees those,
  but not a tensor kept outside the graph (a module attribute, a module-level cache);
* ``tracker``: the live-storage tracker (a dispatch mode) sees every storage an op created during
  the measured block and still alive after it, wherever it is referenced -- but it cannot say
  why it is alive, nor see storages created before the block (the caller's input).

:func:`measure` runs a block under the ledger and the tracker at once and returns a
:class:`Measurement`: every kept storage once, with the probe that saw it. Storages the tracker
sees alive that neither the hooks nor the ctx walk account for, and that are not the block's
outputs, are ``tracker``-only records ("unexplained"): a stray cache or a private copy.

A :class:`SavedLimit` limits the bytes of one selection (all, a module prefix, new storages only).
:func:`check_limit` compares **both** totals with it -- the ledger's (hook + ctx) and the tracker's
(its new live storages plus the ledger's pre-existing ones, which it cannot see) -- and demands
that they agree within ``tolerance``. :func:`assert_within_budget` turns violations into one
line (module, tensor, shape, dtype, bytes, budget, probe) and puts the itemised detail in a
report section of the pytest item.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vramguard.measure.decoder import decoder_layers_of
from vramguard.measure.ledger import OUTSIDE, SavedRecord, SavedSlot, SavedTensorLedger, Source
from vramguard.measure.modules import ModuleStack
from vramguard.measure.storage import (
    StorageKey,
    resident_storages,
    storage_key,
    storage_nbytes,
    tensor_leaves,
)
from vramguard.measure.tracker import StorageTracker
from vramguard.units import format_bytes


@dataclass
class Measurement:
    """Storages a block left alive for backward, each once, with the probe that saw it."""

    kept: list[SavedRecord] = field(default_factory=list)
    output_bytes: int = 0
    allocator_delta: int | None = None

    def select(
        self,
        prefix: str | None = None,
        new_only: bool = False,
        predicate: Callable[[SavedRecord], bool] | None = None,
    ) -> list[SavedRecord]:
        """The kept records of one selection: module ``prefix`` and its submodules (None: every module), only
        storages the block created with ``new_only``, and only those ``predicate`` accepts."""
        out = []
        for k in self.kept:
            if prefix is not None and not (k.module == prefix or k.module.startswith(prefix + ".")):
                continue
            if new_only and not k.new:
                continue
            if predicate is not None and not predicate(k):
                continue
            out.append(k)
        return out

    def ledger_bytes(self, items: Iterable[SavedRecord] | None = None) -> int:
        """What the saved-tensor probes (hook + ctx) account for."""
        return sum(k.bytes for k in (self.kept if items is None else items) if k.source != "tracker")

    def tracker_bytes(self, items: Iterable[SavedRecord] | None = None) -> int:
        """What the live tracker sees kept (new storages), plus pre-existing ones it cannot see."""
        return sum(k.bytes for k in (self.kept if items is None else items) if k.new or k.source != "tracker")

    def bytes_by(self, source: Source, items: Iterable[SavedRecord] | None = None) -> int:
        """Bytes of the records (``items``, default: all kept) that probe ``source`` saw first: ``hook``,
        ``ctx``, or ``tracker`` (the unexplained)."""
        return sum(k.bytes for k in (self.kept if items is None else items) if k.source == source)

    @property
    def hook_bytes(self) -> int:
        """Kept bytes the ``saved_tensors_hooks`` saw."""
        return self.bytes_by("hook")

    @property
    def ctx_bytes(self) -> int:
        """Kept bytes only the walk of custom Functions' ``ctx`` attributes found (no hook saw them)."""
        return self.bytes_by("ctx")

    @property
    def unexplained_bytes(self) -> int:
        """Kept bytes the live tracker alone sees: created by the block, alive after it, held by no
        saved-tensor hook or ctx (a cache or a private copy)."""
        return self.bytes_by("tracker")

    def table(self, items: Iterable[SavedRecord] | None = None, limit: int = 60) -> str:
        """The records (``items``, default: all kept) as :meth:`SavedRecord.describe` lines, largest first; at
        most ``limit`` lines, then a count of the rest."""
        rows = sorted(self.kept if items is None else items, key=lambda k: (-k.bytes, k.module))
        lines = [k.describe() for k in rows[:limit]]
        if len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more")
        return "\n".join(lines)


class _AnnotatedTracker(StorageTracker):
    """A StorageTracker that also remembers, per new storage, the op, shape, dtype and module."""

    def __init__(self, device_type: str | None, module_of: Callable[[], str]) -> None:
        super().__init__(device_type)
        self.meta: dict[StorageKey, tuple[str, tuple[int, ...], str, str]] = {}
        self._module_of = module_of

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tensor_leaves(out):
            before = self.live_count
            self.track(t)
            if self.live_count != before:
                key = storage_key(t)
                name = getattr(func, "__name__", str(func))
                self.meta[key] = (
                    name,
                    tuple(t.shape),
                    str(t.dtype).removeprefix("torch."),
                    self._module_of(),
                )
        return out


def _tracker_device(device: str | torch.device) -> str:
    return torch.device(device).type


def measure(
    fn: Callable[[], Any],
    model: torch.nn.Module | None = None,
    device: str | torch.device = "cpu",
    roots: Callable[[Any], Any] | None = None,
    inputs: Any = (),
) -> tuple[Measurement, Any]:
    """Run ``fn()`` (a forward pass) under the ledger and the live tracker; return what it kept.

    The result of ``fn`` is returned as well, alive, so the caller can run backward. Its tensors
    are the graph's roots (``roots(result)`` picks others) and count as outputs, not as kept.
    ``inputs``: tensors the caller made before the block (and holds): never "new", even when the
    tracker first meets their storage through a view taken inside the block.
    """
    pre = {storage_key(t) for t in tensor_leaves(inputs)}
    ledger = SavedTensorLedger(model)
    tracker = _AnnotatedTracker(_tracker_device(device), ledger.current_module)
    cuda = torch.device(device).type == "cuda"
    # young garbage from before the block (an earlier ledger's cycles) must not be freed by the collection
    # inside it: the CUDA allocator's delta would fall by its bytes (seen on an H100 under pytest -n)
    gc.collect(1)
    if cuda:
        alloc_before = _allocated_without_workspaces()
    tracker.start()
    try:
        with ledger:
            result = fn()
            root_obj = roots(result) if roots is not None else result
            ledger.add_roots(*_outputs(root_obj))
        gc.collect(1)  # cycles made by the block are young; a full collection costs ~0.5 s
        live = {k: v for k, v in tracker.live().items() if k not in pre}
        meta = dict(tracker.meta)
    finally:
        tracker.stop()
    outs = {storage_key(t): storage_nbytes(t) for t in _outputs(result)}
    probe = ledger.probe_tensor
    if probe is not None:  # the ledger's one-element probe is not the block's
        outs[storage_key(probe)] = 0
    outs.update({storage_key(t): storage_nbytes(t) for t in _outputs(root_obj)})
    m = Measurement(output_bytes=sum(outs.values()))  # (the clock probe counts 0)
    if cuda:
        m.allocator_delta = _allocated_without_workspaces() - alloc_before
    saved = ledger.report.records + ledger.report.resident + ledger.report.gathered
    keyed = {r.key for r in saved if r.key is not None}
    for r in ledger.report.records:  # (resident ones are the model's, not kept)
        if r.key is None:  # its storage died in the block (offloaded): kept as a copy elsewhere, age unknown
            m.kept.append(r)
        elif r.key not in outs:
            m.kept.append(replace(r, new=r.key in live))
    resident = set(ledger.resident_keys)
    if model is not None:  # parameters whose storage the forward replaced (Linear4bit casts its bias
        resident |= set(resident_storages(model))  # in place): the model's from now on, not kept
    for key, nbytes in live.items():
        # a view of a parameter made during the block is a "new" storage to the tracker only
        # because the weights predate it; resident storages are the model's, not the block's
        if key in keyed or key in outs or key in resident:
            continue
        op, shape, dtype, module = meta.get(key, ("<unknown>", (), "?", OUTSIDE))
        m.kept.append(
            SavedRecord(
                module=module,
                node=op,
                shape=shape,
                dtype=dtype,
                bytes=nbytes,
                source="tracker",
                kind="unexplained",
                device=str(device),
                key=key,
                new=True,
            )
        )
    m.kept.sort(key=lambda k: (-k.bytes, k.module))
    return m, result


def drop_cublas_workspaces(device: str | torch.device) -> None:
    """On CUDA, free cuBLAS's workspaces before reading the allocator: one per handle (32 MiB each on an H100,
    one for the forward's thread and one for autograd's), taken from the caching allocator at a handle's first
    call and kept for the process, so whether a measured block pays for one depends on what ran before it in
    the same process (an H100 under pytest -n: a whole-model forward's delta 32 MiB above what it kept,
    docs/measurements/2026-11-25-h100). The workspaces are no tensor the block kept. Elsewhere, nothing."""
    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize(device)
    # a private torch function: where it is absent, nothing is freed
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _allocated_without_workspaces() -> int:
    """The CUDA allocator's bytes in use once cuBLAS's workspaces are freed (:func:`drop_cublas_workspaces`)."""
    drop_cublas_workspaces("cuda")
    return torch.cuda.memory_allocated()


def _outputs(obj: Any) -> list[torch.Tensor]:
    """Tensors of a forward's result: tensors, tuples, dicts, HF ModelOutput."""
    if hasattr(obj, "to_tuple") and callable(obj.to_tuple):
        obj = obj.to_tuple()
    return tensor_leaves(obj)


@dataclass(frozen=True)
class SavedLimit:
    """At most ``max_bytes`` (and, with ``min_bytes``, at least that: a band) kept by a selection.

    ``prefix``: only storages attributed to this module and its submodules. ``new_only``: only
    storages the block created (what the block adds, the caller's own inputs aside).
    ``tolerance``: allowed disagreement between the probes, in bytes.
    """

    name: str
    max_bytes: int
    min_bytes: int | None = None
    prefix: str | None = None
    new_only: bool = False
    predicate: Callable[[SavedRecord], bool] | None = None
    tolerance: int = 0
    formula: str = ""


@dataclass
class LimitVerdict:
    """The result of :func:`check_limit`: the selection's bytes per probe, its records, and one line per
    violated rule (none: within the budget, and the probes agree within its tolerance)."""

    budget: SavedLimit
    ledger_bytes: int
    tracker_bytes: int
    hook_bytes: int
    ctx_bytes: int
    unexplained_bytes: int
    items: list[SavedRecord]
    failures: list[str]

    @property
    def ok(self) -> bool:
        """Whether nothing failed: both totals within the budget's bounds and the unexplained bytes within its
        tolerance."""
        return not self.failures

    def detail(self, m: Measurement) -> str:
        """The itemised text for the pytest report section: the budget (and its formula), each probe's total,
        the CUDA allocator delta when there is one, and the selection's kept records from ``m``."""
        b = self.budget
        band = (
            f"[{format_bytes(b.min_bytes)}, {format_bytes(b.max_bytes)}]"
            if b.min_bytes is not None
            else (f"<= {format_bytes(b.max_bytes)}")
        )
        head = [
            f"budget {b.name}: {band} ({b.max_bytes} B){' = ' + b.formula if b.formula else ''}",
            f"  ledger (hook+ctx): {self.ledger_bytes} B   hook: {self.hook_bytes} B   ctx: {self.ctx_bytes} B",
            f"  tracker: {self.tracker_bytes} B   unexplained (tracker only): {self.unexplained_bytes} B",
        ]
        if m.allocator_delta is not None:
            head.append(
                f"  CUDA allocator delta over the block: {m.allocator_delta} B (outputs {m.output_bytes} B)"
            )
        return "\n".join(head + ["  kept:"] + ["    " + line for line in m.table(self.items).splitlines()])


def check_limit(m: Measurement, budget: SavedLimit) -> LimitVerdict:
    """Both totals against the budget, and the probes against each other."""
    items = m.select(budget.prefix, budget.new_only, budget.predicate)
    led, trk = m.ledger_bytes(items), m.tracker_bytes(items)
    unexplained = m.bytes_by("tracker", items)
    failures: list[str] = []
    top_over = max(items, key=lambda k: k.bytes, default=None)

    def culprit(probe_filter: Callable[[SavedRecord], bool]) -> str:
        cands = [k for k in items if probe_filter(k)]
        k = max(cands, key=lambda k: k.bytes, default=top_over)
        return f"largest: {k.describe()}" if k is not None else "nothing kept"

    for probe, total, filt in (
        ("ledger (hook+ctx)", led, lambda k: k.source != "tracker"),
        ("tracker", trk, lambda k: True),
    ):
        if total > budget.max_bytes:
            failures.append(
                f"{budget.name}: {probe} sees {total} B kept > budget {budget.max_bytes} B "
                f"(+{total - budget.max_bytes} B); {culprit(filt)}"
            )
        elif budget.min_bytes is not None and total < budget.min_bytes:
            failures.append(
                f"{budget.name}: {probe} sees {total} B kept < band minimum {budget.min_bytes} B "
                f"({budget.min_bytes - total} B missing: is the probe blind, or the formula stale?)"
            )
    if unexplained > budget.tolerance:
        failures.append(
            f"{budget.name}: tracker sees {unexplained} B alive that no saved-tensor hook or ctx holds "
            f"(a cache or private copy); {culprit(lambda k: k.source == 'tracker')}"
        )
    return LimitVerdict(
        budget, led, trk, m.bytes_by("hook", items), m.bytes_by("ctx", items), unexplained, items, failures
    )


def report_section(request: Any, title: str, text: str) -> None:
    """Attach ``text`` to the test's report (shown with its failure) and to its user_properties."""
    node = getattr(request, "node", request)
    if node is None:
        return
    if hasattr(node, "add_report_section"):
        node.add_report_section("call", f"vramguard: {title}", text)
    props = getattr(node, "user_properties", None)
    if props is not None:
        props.append((f"vramguard:{title}", text))


def assert_within_budget(m: Measurement, budget: SavedLimit, request: Any = None) -> LimitVerdict:
    """Fail with one line per violated check (the first is the message); detail in the report."""
    verdict = check_limit(m, budget)
    if request is not None:
        report_section(request, budget.name, verdict.detail(m))
    if verdict.failures:
        extra = (
            f" (+{len(verdict.failures) - 1} more, see 'vramguard: {budget.name}' section)"
            if len(verdict.failures) > 1
            else ""
        )
        raise AssertionError(verdict.failures[0] + extra)
    return verdict


# --- live meters for the pytest markers ---------------------------------------------------------


class SavedBytesMeter:
    """Peak bytes held by saved-tensor hooks, counted per storage, over a block.

    Each packed tensor goes into a slot object owned by autograd alone; a weakref finalizer
    subtracts its storage when the last slot holding that storage dies (the graph was freed by
    backward or dropped). ``peak`` is therefore the most bytes ever kept alive for backward at
    once during the block. Tensors hidden in ``ctx`` attributes are not seen: pair it with
    ``vram_budget``, whose live tracker sees them. Saved-tensor hooks do not nest: packs made
    under an inner ``saved_tensors_hooks`` (the ledger, ``save_on_cpu``) are not seen either.

    The same definition as the ledger's (and ``vramguard audit``'s): storages of parameters, buffers and
    the quantization state hanging off them (LoRA A/B, norm weights, an fp32 ``lm_head`` saved by the ops
    that use them) are resident, not saved, and are not counted. They are found from every module whose
    forward runs in the block (its whole tree, the first time it is seen).

    ``per_layer``: also attribute each storage to the running decoder layer (``layers.N``, the
    rule of :mod:`vramguard.measure.decoder`) and keep each layer's peak in ``layer_peaks``.
    """

    def __init__(self, device_type: str | None = None, per_layer: bool = False) -> None:
        self._device_type = device_type
        self._counts: dict[StorageKey, list[Any]] = {}
        self.current = 0
        self.peak = 0
        self.largest: tuple[int, tuple[int, ...], str] | None = None
        self.per_layer = per_layer
        self.layer_current: dict[str, int] = {}
        self.layer_peaks: dict[str, int] = {}
        #: bytes of resident storages (parameters etc.) that ops saved: not counted, reported apart
        self.resident_saved: dict[StorageKey, int] = {}
        self._names: dict[int, str] = {}  # decoder layer id -> layers.N
        # the running decoder layers (no model is given: every module is looked at, named on first sight)
        self._layers = ModuleStack(self._names, discover=self._discover)
        self._seen: set[int] = set()
        self._resident: set[StorageKey] = set()
        self._hooks: Any = None

    def _scan(self, module: torch.nn.Module) -> None:
        """First sight of a module tree: its resident storages."""
        for sub in module.modules():
            self._seen.add(id(sub))
        self._resident.update(resident_storages(module))

    def _discover(self, module: torch.nn.Module) -> str | None:
        """A module that is no named decoder layer starts: scan it if new, name the decoder layers it holds."""
        if id(module) not in self._seen:
            self._scan(module)
        if not self.per_layer:
            return None
        for name, layer in decoder_layers_of(module):  # a parent runs before its layers
            if id(layer) not in self._names:
                taken = set(self._names.values())
                unique, k = name, 1
                while unique in taken:  # a second stack of layers (e.g. another model in the test)
                    unique, k = f"{name}#{k}", k + 1
                self._names[id(layer)] = unique
        return self._names.get(id(module))

    def _pack(self, tensor: torch.Tensor) -> Any:
        slot = SavedSlot(tensor.detach())
        if self._device_type is None or tensor.device.type == self._device_type:
            key, nbytes = storage_key(tensor), storage_nbytes(tensor)
            if key in self._resident:
                self.resident_saved[key] = nbytes
                return slot
            entry = self._counts.get(key)
            if entry is None:
                layers = self._layers.stack
                layer = layers[-1] if layers else None
                self._counts[key] = [nbytes, 1, layer]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
                if layer is not None:
                    self.layer_current[layer] = self.layer_current.get(layer, 0) + nbytes
                    self.layer_peaks[layer] = max(self.layer_peaks.get(layer, 0), self.layer_current[layer])
                if self.largest is None or nbytes > self.largest[0]:
                    self.largest = (nbytes, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            else:
                entry[1] += 1
            weakref.finalize(slot, self._release, key)
        return slot

    def _release(self, key: StorageKey) -> None:
        entry = self._counts.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            if entry[2] is not None:
                self.layer_current[entry[2]] -= entry[0]
            del self._counts[key]

    @staticmethod
    def _unpack(slot: Any) -> torch.Tensor:
        return slot.tensor

    def __enter__(self) -> SavedBytesMeter:
        self._layers.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._layers.__exit__(None, None, None)


class PeakMeter:
    """Peak live bytes above the start of a block: the storage tracker (CPU, meta) or the CUDA
    allocator's peak (``cuda``), whichever the device calls for."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.start = 0
        self.peak_above_start = 0
        self._tracker: StorageTracker | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = StorageTracker(self.device.type)
            self._tracker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_above_start = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            assert self._tracker is not None
            self.peak_above_start = self._tracker.peak()
            self._tracker.stop()
