"""The allocation events behind the tracker's numbers: every storage it counts, when it was made and freed,
where (phase, module stack, autograd node) and, once the step is understood, what it was (category).

:class:`StorageTracker <vramguard.measure.tracker.StorageTracker>` adds to current bytes when it counts a
storage and subtracts when that storage dies; with an :class:`AllocationLog` attached it also appends an
``alloc`` or ``free`` event there, at the same moment and with the same size. The running sum of the log's
events is therefore the tracker's :meth:`current`, event by event, and its maximum the tracker's peak: there
is no second accounting to disagree with the first. The storages that existed before tracking began (the
model's weights, its trainable parameters, their quantization state) are not counted by the tracker; the
log knows them as *pre-existing* blocks, so that a picture of the step can stand them under the rest.

Categories are given after the fact (:meth:`AllocationLog.label`), by what each storage turned out to be:
the ledger's saved activations and weight copies, the parameters' gradients, the optimizer's state; a
storage nobody labelled is a ``temporaries`` one if it died in the phase that made it, else ``unknown``.

:meth:`AllocationLog.snapshot` writes the log in PyTorch's memory-snapshot format (the dictionary that
``torch.cuda.memory._snapshot()`` returns, which ``torch.cuda._memory_viz.trace_plot`` and the viewer at
pytorch.org/memory_viz read): plain dicts, lists, strings and ints only, addresses from a bump allocator of
the log's own (a meta storage has none; CPU addresses are the host allocator's business).
"""

from __future__ import annotations

import pickle
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vramguard.measure.storage import resident_tensors

WEIGHTS = "weights"
TRAINABLE = "trainable"
SAVED = "saved activations"
WEIGHT_COPIES = "weight copies"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer state"
HOST = "host copies"
TEMPORARIES = "temporaries"
UNKNOWN = "unknown"
CATEGORIES: tuple[str, ...] = (
    WEIGHTS,
    TRAINABLE,
    SAVED,
    WEIGHT_COPIES,
    GRADIENTS,
    OPTIMIZER,
    HOST,
    TEMPORARIES,
    UNKNOWN,
)
"""Every category an allocation can get, in the order the views stack them (bottom first). ``unknown`` is
last and always listed: PyTorch's viewer fails on a snapshot whose categories lack it."""

ALIGN = 512
"""Addresses the log hands out are multiples of this (the CUDA caching allocator's rounding)."""

PICKLE_PROTOCOL = 4
"""The viewer's own unpickler reads protocols 2 to 4 (and a subset of their opcodes: no classes, no bytes)."""

Context = tuple[str, int, tuple[str, ...], str | None]
"""Where an allocation happened: (phase, its call number from 1, the module stack outermost first,
the autograd node running in backward or None)."""

_NOWHERE: Context = ("", 0, (), None)


class Allocation:
    """One storage's life in the log: its address, bytes, device type, context and category, the index of
    the event that made it (``-1`` for a pre-existing one) and of the one that freed it (None: alive at the
    end)."""

    __slots__ = ("addr", "born", "category", "context", "device", "died", "size")

    def __init__(self, addr: int, size: int, device: str, context: Context, born: int) -> None:
        self.addr = addr
        self.size = size
        self.device = device
        self.context = context
        self.born = born
        self.died: int | None = None
        self.category: str | None = None

    @property
    def preexisting(self) -> bool:
        """Whether the storage existed before the log started (the tracker never counted it)."""
        return self.born < 0

    def where(self) -> str:
        """The innermost module of the context (or the autograd node, or the phase) as one short string."""
        phase, _, modules, node = self.context
        if modules:
            return modules[-1] or "<root>"
        return node or phase or "<outside the phases>"


@dataclass
class PhaseSpan:
    """One call of a phase: its name, its call number (1 for the first step's; with gradient accumulation the
    forward and backward are called once a micro-batch, so their calls count micro-batches), and the event
    indices it spans (``start`` inclusive, ``end`` exclusive)."""

    name: str
    call: int
    start: int
    end: int


class AllocationLog:
    """The alloc/free events of the storages one tracker counted, in the order they happened.

    The tracker calls :meth:`alloc` and :meth:`free`; the :class:`~vramguard.measure.tracker.MemoryTracker`
    it runs under sets :attr:`context` (where the step is now) and calls :meth:`begin` / :meth:`end` around
    its phases; :meth:`add_preexisting` names the storages that were there before. Not thread-safe beyond
    what the tracker's own lock gives (the tracker calls it under that lock).
    """

    def __init__(self) -> None:
        self.events: list[tuple[bool, Allocation, int]] = []  # (is an alloc, the allocation, time in us)
        self.preexisting: list[Allocation] = []
        self.phases: list[PhaseSpan] = []
        self.context: Callable[[], Context] = lambda: _NOWHERE
        self._live: dict[int, Allocation] = {}
        self._pre_refs: dict[int, weakref.KeyedRef] = {}
        self._pre_live: dict[int, Allocation] = {}
        self.device = "cpu"
        """The device the run is on (``meta``, ``cpu``, ``cuda:0``): an unlabelled storage on the host during
        a run elsewhere is a ``host copies`` one."""
        self._next = 0
        self._open: list[PhaseSpan] = []
        self._calls: dict[str, int] = {}

    # -- the tracker's side ---------------------------------------------------------------------------
    def _address(self, size: int) -> int:
        addr = self._next
        self._next += max(ALIGN, -(-size // ALIGN) * ALIGN)
        return addr

    def alloc(self, key: int, size: int, device: str) -> None:
        """A storage counted now: ``key`` its identity while it lives, ``size`` its bytes."""
        a = Allocation(self._address(size), size, device, self.context(), len(self.events))
        self._live[key] = a
        self.events.append((True, a, time.perf_counter_ns() // 1000))

    def free(self, key: int) -> None:
        """The storage counted under ``key`` died (a key the log never saw is ignored)."""
        a = self._live.pop(key, None)
        if a is not None:
            a.died = len(self.events)
            self.events.append((False, a, time.perf_counter_ns() // 1000))

    def resize(self, key: int, size: int, device: str) -> None:
        """A counted storage resized in place: its old bytes freed, its new ones allocated."""
        self.free(key)
        self.alloc(key, size, device)

    def add_preexisting(self, storages: Iterable[tuple[Any, str, str]]) -> None:
        """Storages (``untyped_storage()`` objects) that exist before the log starts, each with its category and
        its owner's name; each counted once, and its death (a forward may replace a parameter's storage)
        recorded as a free."""
        for storage, category, owner in storages:
            key = int(storage._cdata)
            if key in self._pre_refs:
                continue
            size = int(storage.nbytes())
            a = Allocation(self._address(size), size, storage.device.type, ("", 0, (owner,), None), -1)
            a.category = category
            self.preexisting.append(a)
            self._pre_refs[key] = weakref.KeyedRef(storage, self._pre_died, key)
            self._pre_live[key] = a

    def _pre_died(self, ref: weakref.KeyedRef) -> None:
        if self._pre_refs.get(ref.key) is not ref:
            return
        del self._pre_refs[ref.key]
        a = self._pre_live.pop(ref.key)
        a.died = len(self.events)
        self.events.append((False, a, time.perf_counter_ns() // 1000))

    def stop(self) -> None:
        """Stop following the pre-existing storages (their later deaths are no events of the run)."""
        self._pre_refs.clear()
        self._pre_live.clear()

    def begin(self, name: str) -> None:
        """A phase call starts now."""
        call = self._calls[name] = self._calls.get(name, 0) + 1
        span = PhaseSpan(name, call, len(self.events), len(self.events))
        self._open.append(span)
        self.phases.append(span)

    def end(self, name: str) -> None:
        """The innermost open call of phase ``name`` ends now."""
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].name == name:
                self._open.pop(i).end = len(self.events)
                return

    def phase_now(self) -> tuple[str, int]:
        """The innermost open phase and its call number (``("", 0)`` outside every phase)."""
        return (self._open[-1].name, self._open[-1].call) if self._open else ("", 0)

    # -- labels ---------------------------------------------------------------------------------------
    def label(self, keys: Iterable[int], category: str) -> int:
        """Give ``category`` to the live allocations of these storage keys that have none yet; how many got it.
        The first label given stays (a gradient is not optimizer state because the optimizer read it)."""
        n = 0
        for key in keys:
            a = self._live.get(key)
            if a is not None and a.category is None:
                a.category = category
                n += 1
        return n

    def label_tensors(self, tensors: Iterable[torch.Tensor], category: str) -> int:
        """:meth:`label` for the storages behind ``tensors``."""
        keys = []
        for t in tensors:
            try:
                keys.append(int(t.untyped_storage()._cdata))
            except (RuntimeError, NotImplementedError):
                continue
        return self.label(keys, category)

    def label_saved(self, records: Iterable[Any]) -> int:
        """Label what a ledger found kept for backward (:class:`~vramguard.measure.ledger.SavedRecord` s, read
        right after the forward while their storages live): ``weight copies`` or ``saved activations``."""
        n = 0
        for r in records:
            if r.key is not None and r.kind in ("activation", "weight-copy"):
                n += self.label([r.key], WEIGHT_COPIES if r.kind == "weight-copy" else SAVED)
        return n

    # -- what the log tells -----------------------------------------------------------------------------
    def categories(self) -> dict[int, str]:
        """``id(allocation) -> category`` for every allocation: its label; else ``host copies`` for a storage
        on the host in a run on another device; else ``temporaries`` when it died inside the innermost phase
        call that made it; else ``unknown``."""
        out: dict[int, str] = {}
        owner = self._innermost_span()
        for a in self.preexisting:
            out[id(a)] = a.category or UNKNOWN
        for is_alloc, a, _ in self.events:
            if not is_alloc or id(a) in out:
                continue
            if a.category is not None:
                out[id(a)] = a.category
            elif a.device == "cpu" and self.device not in ("cpu", "any"):
                out[id(a)] = HOST
            elif a.died is not None and owner[a.born] is not None and owner[a.born] is owner[a.died]:
                out[id(a)] = TEMPORARIES
            else:
                out[id(a)] = UNKNOWN
        return out

    def _innermost_span(self) -> list[PhaseSpan | None]:
        """The innermost phase call at each event index (None outside every phase)."""
        owner: list[PhaseSpan | None] = [None] * (len(self.events) + 1)
        for span in sorted(self.phases, key=lambda s: -(s.end - s.start)):  # wider first, narrower over them
            owner[span.start : span.end] = [span] * (span.end - span.start)
        return owner

    def replay(self) -> tuple[int, int]:
        """(peak, index): the highest running sum of the events of storages the log saw made (what the
        tracker counted: its peak) and the event index where it was first reached."""
        current = peak = 0
        at = -1
        for i, (is_alloc, a, _) in enumerate(self.events):
            if a.preexisting:
                continue
            current += a.size if is_alloc else -a.size
            if current > peak:
                peak, at = current, i
        return peak, at

    def snapshot(self) -> dict[str, Any]:
        """The log as a PyTorch memory snapshot (device 0): ``segments`` (one segment over the log's address
        space, its blocks those alive at the end, pre-existing ones included) and ``device_traces`` (an
        ``alloc`` event per allocation, ``free_requested`` and ``free_completed`` per free, each with
        ``addr``, ``size``, ``stream``, ``frames``, ``category`` and ``time_us``), ended by a ``snapshot``
        event of category ``unknown`` (the viewer needs that category listed). Plain types only."""
        cats = self.categories()
        frames = _Frames()
        trace: list[dict[str, Any]] = []
        for is_alloc, a, t in self.events:
            common = {"addr": a.addr, "size": a.size, "stream": 0, "frames": frames.of(a.context)}
            if is_alloc:
                trace.append({"action": "alloc", **common, "category": cats[id(a)], "time_us": t})
            else:
                for action in ("free_requested", "free_completed"):
                    trace.append({"action": action, **common, "category": cats[id(a)], "time_us": t})
        end = self.events[-1][2] if self.events else time.perf_counter_ns() // 1000
        trace.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "frames": [],
                "category": UNKNOWN,
                "time_us": end,
            }
        )
        alive = sorted(
            (a for a in [*self.preexisting, *(a for ok, a, _ in self.events if ok)] if a.died is None),
            key=lambda a: a.addr,
        )
        blocks: list[dict[str, Any]] = []
        addr = 0
        for a in alive:
            if a.addr > addr:
                blocks.append(
                    {"address": addr, "size": a.addr - addr, "requested_size": 0, "state": "inactive"}
                )
            blocks.append(
                {
                    "address": a.addr,
                    "size": a.size,
                    "requested_size": a.size,
                    "state": "active_allocated",
                    "frames": frames.of(a.context),
                    "category": cats[id(a)],
                }
            )
            addr = a.addr + a.size
        total = max(self._next, addr, ALIGN)
        if total > addr:
            blocks.append({"address": addr, "size": total - addr, "requested_size": 0, "state": "inactive"})
        allocated = sum(a.size for a in alive)
        segment = {
            "device": 0,
            "address": 0,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": allocated,
            "stream": 0,
            "segment_type": "large",
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        }
        return {"segments": [segment], "device_traces": [trace], "allocator_settings": {}}


class _Frames:
    """Frames in the snapshot's format, each distinct list made once (pickle then stores repeats as references)."""

    def __init__(self) -> None:
        self._lists: dict[Context, list[dict[str, Any]]] = {}
        self._frames: dict[tuple[str, int, str], dict[str, Any]] = {}

    def _frame(self, filename: str, line: int, name: str) -> dict[str, Any]:
        key = (filename, line, name)
        f = self._frames.get(key)
        if f is None:
            f = self._frames[key] = {"filename": filename, "line": line, "name": name}
        return f

    def of(self, context: Context) -> list[dict[str, Any]]:
        """Innermost first, as CUDA snapshots list them: the autograd node, the modules (innermost first), the
        phase call. A module frame reads ``model.layers.0.mlp:0:forward`` (``backward``: recomputed in
        backward)."""
        frames = self._lists.get(context)
        if frames is None:
            phase, call, modules, node = context
            frames = []
            if node:
                frames.append(self._frame("<autograd>", 0, node))
            frames += [self._frame(m or "<root>", 0, phase or "resident") for m in reversed(modules)]
            if phase:
                frames.append(self._frame(f"<step {call}>", call, phase))
            self._lists[context] = frames
        return frames


def dump_snapshot(snapshot: dict[str, Any]) -> bytes:
    """The snapshot pickled the way PyTorch's viewer can read it (protocol :data:`PICKLE_PROTOCOL`)."""
    return pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL)


@dataclass
class Timeline:
    """The step's memory through time for a picture: bytes alive per category at sampled event indices
    (pre-existing storages included), the phase calls, and the peak with what is alive there.

    ``peak_bytes`` is the highest total (pre-existing + traced); ``traced_peak_bytes`` the highest of the
    traced storages alone (the tracker's peak); ``at_peak`` bytes per category at ``peak_index`` and
    ``top_at_peak`` the largest storages alive there (bytes, category, where)."""

    events: int
    categories: list[str]
    index: list[int]
    bytes: dict[str, list[int]]
    phases: list[PhaseSpan]
    peak_index: int
    peak_bytes: int
    traced_peak_bytes: int
    at_peak: dict[str, int]
    top_at_peak: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (the report's ``timeline``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Inverse of :meth:`to_dict`."""
        d = dict(data)
        d["phases"] = [PhaseSpan(**p) for p in d["phases"]]
        return cls(**d)

    def totals(self) -> list[int]:
        """Bytes alive at each sampled index, all categories."""
        return [sum(v[i] for v in self.bytes.values()) for i in range(len(self.index))]


def timeline(log: AllocationLog, points: int = 1500, top: int = 8) -> Timeline:
    """The :class:`Timeline` of ``log``: at most ``points`` samples, each the highest moment of its bucket of
    events (so the peak is always a sample), per category."""
    cats = log.categories()
    order = [c for c in CATEGORIES if c in set(cats.values())] or [UNKNOWN]
    col = {c: i for i, c in enumerate(order)}
    running = [0] * len(order)
    for a in log.preexisting:
        running[col[cats[id(a)]]] += a.size
    n = len(log.events)
    bucket = max(1, -(-n // points)) if n else 1
    index: list[int] = []
    series: list[list[int]] = []
    traced = best_traced = 0
    peak_total, peak_index = sum(running), -1
    best_in_bucket: tuple[int, int, list[int]] | None = None
    index.append(-1)
    series.append(list(running))
    for i, (is_alloc, a, _) in enumerate(log.events):
        c = col[cats[id(a)]]
        delta = a.size if is_alloc else -a.size
        running[c] += delta
        if not a.preexisting:
            traced += delta
            best_traced = max(best_traced, traced)
        total = sum(running)
        if total > peak_total:
            peak_total, peak_index = total, i
        if best_in_bucket is None or total > best_in_bucket[0]:
            best_in_bucket = (total, i, list(running))
        if (i + 1) % bucket == 0 or i == n - 1:
            assert best_in_bucket is not None
            _, at, values = best_in_bucket
            index.append(at)
            series.append(values)
            best_in_bucket = None
    at_peak = dict.fromkeys(order, 0)
    alive = []
    for a in [*log.preexisting, *(a for ok, a, _ in log.events if ok)]:
        if a.born <= peak_index and (a.died is None or a.died > peak_index):
            at_peak[cats[id(a)]] += a.size
            alive.append(a)
    alive.sort(key=lambda a: -a.size)
    return Timeline(
        events=n,
        categories=order,
        index=index,
        bytes={c: [s[j] for s in series] for j, c in enumerate(order)},
        phases=[PhaseSpan(p.name, p.call, p.start, p.end) for p in log.phases],
        peak_index=peak_index,
        peak_bytes=peak_total,
        traced_peak_bytes=best_traced,
        at_peak=at_peak,
        top_at_peak=[{"bytes": a.size, "category": cats[id(a)], "where": a.where()} for a in alive[:top]],
    )


def model_storages(model: torch.nn.Module) -> Iterable[tuple[Any, str, str]]:
    """The model's own storages for :meth:`AllocationLog.add_preexisting`: parameters, buffers and their
    quantization state, each with ``trainable`` or ``weights`` and its owner's name."""
    for name, t in resident_tensors(model):
        yield t.untyped_storage(), TRAINABLE if t.requires_grad else WEIGHTS, name


def optimizer_state(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (``optimizer.optimizer``'s for a wrapper such as accelerate's)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return [
        t
        for state in getattr(inner, "state", {}).values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    ]
