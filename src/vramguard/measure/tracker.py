"""Live memory: current and peak bytes by phase (forward, backward, optimizer step) and per module.

Two sources answer "how many bytes are live now, and how high did it go since I last asked":

* :class:`StorageTracker` (CPU, meta, any device): a ``TorchDispatchMode`` that sees every tensor
  an op returns, counts each new storage once and subtracts it when the storage is freed. It
  needs no allocator, works on the meta device, with frozen parameters and with custom ops
  (bitsandbytes' ops are ordinary dispatcher ops). It sees tensors, not allocator internals:
  scratch buffers a kernel allocates and frees inside one op are invisible unless
  :attr:`StorageTracker.kernel_temporaries` names them (an estimate for CUDA does:
  :mod:`vramguard.estimate.kernels`), as are storages created before tracking started (the model's
  own weights), which is what a delta should omit.
* :class:`CudaAllocatorSource`: the caching allocator's own statistics (allocated, reserved and
  their peaks), which also see kernel scratch space and fragmentation.

:class:`MemoryTracker` folds either source's peak into every open frame (phase or module call)
at each boundary, so nested frames get exact peaks although the source keeps only one.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramguard.measure.events import AllocationLog, Context, model_storages
from vramguard.measure.modules import ModuleStack, module_names
from vramguard.measure.storage import StorageKey, storage_key, storage_of, tensor_leaves


class MemorySource(Protocol):
    """Anything that knows the bytes live now and the highest value since the last reset."""

    device: str

    def current(self) -> int:
        """Bytes live on the device now, as this source counts them."""

    def peak(self) -> int:
        """The highest live bytes since the last :meth:`reset_peak` (or :meth:`start`)."""

    def reset_peak(self) -> None:
        """Let the peak start again from the bytes live now."""

    def start(self) -> None:
        """Begin measuring, before the block: from here on :meth:`current` and :meth:`peak` describe it."""

    def stop(self) -> None:
        """End measuring, after the block; numbers read afterwards are no longer kept up to date."""


class StorageTracker(TorchDispatchMode):
    """Counts storages created by ops, from creation to destruction.

    ``device_type`` limits counting to one kind of device (``"cpu"``, ``"meta"``, ``"cuda"``);
    None counts all of them. With :attr:`events` set (an :class:`~vramguard.measure.events.AllocationLog`),
    every storage counted and every one freed is also an event there, at the same moment and with the same
    bytes.
    """

    def __init__(self, device_type: str | None = "cpu") -> None:
        super().__init__()
        self.device = device_type or "any"
        self._device_type = device_type
        self._live: dict[StorageKey, int] = {}
        # one weak reference per counted storage; its callback subtracts the storage when it is freed.
        # Dropping a reference (start/stop) silences its callback: storages of an earlier run never count
        self._refs: dict[StorageKey, weakref.KeyedRef] = {}
        self._current = 0
        self._peak = 0
        self._lock = threading.Lock()
        self._seeing = False
        self.allocations = 0
        self.events: AllocationLog | None = None
        # (func, args, kwargs) -> the blocks the op's kernel on the target device holds while it runs, beyond
        # its outputs (:func:`vramguard.estimate.kernels.cuda_kernel_temporaries`, for a meta run priced for
        # CUDA): counted from before the op until it returns
        self.kernel_temporaries: Callable[[Any, Any, dict[str, Any]], list[torch.Tensor]] | None = None
        # storage key -> bytes that leave with that counted storage: copies of it counted by :meth:`add` (the
        # identical decoder layers an estimate does not run, :mod:`vramguard.estimate.ghosts`); ``held``: keys
        # whose copies leave another way now (subtracted by another :meth:`add`)
        self._shadows: dict[StorageKey, int] = {}
        self.held: frozenset[StorageKey] = frozenset()

    # MemorySource -------------------------------------------------------------------------
    def current(self) -> int:
        """Bytes of the counted storages still alive: those ops created since :meth:`start` (storages made
        before it, such as the model's weights, are not among them)."""
        return self._current

    def peak(self) -> int:
        """The highest :meth:`current` since :meth:`start` or the last :meth:`reset_peak`, in bytes."""
        return self._peak

    def reset_peak(self) -> None:
        """Let the peak start again from the bytes live now (:class:`MemoryTracker` folds the old one into its
        open frames first)."""
        self._peak = self._current

    def start(self) -> None:
        """Enter the dispatch mode with nothing counted: storages of an earlier run are forgotten, and current
        and peak restart at 0. Storage resizes are watched from here on (:class:`_ResizeWatch`)."""
        with self._lock:  # storages of an earlier run are no longer followed: do not count them
            self._live.clear()
            self._refs.clear()
            self._shadows.clear()
            self._current = self._peak = 0
        self._seeing = True
        _RESIZES.add(self)
        self.__enter__()

    def stop(self) -> None:
        """Leave the dispatch mode and forget the storages counted: freeing them no longer subtracts, so
        :meth:`current` and :meth:`peak` keep the values they had at the stop."""
        self.__exit__(None, None, None)
        _RESIZES.discard(self)
        with self._lock:
            self._refs.clear()  # the callbacks of storages counted so far never run
            self._live.clear()
            self._shadows.clear()

    def pause(self) -> None:
        """Stop seeing ops (the dispatch mode is left, so ops run at full speed) while storages counted
        so far are still subtracted when freed. Storages made while paused are never counted: a peak
        taken across a pause is no measurement. :meth:`resume` undoes it."""
        self._seeing = False
        self.__exit__(None, None, None)

    def resume(self) -> None:
        """See ops again after :meth:`pause`."""
        self._seeing = True
        self.__enter__()

    @property
    def seeing(self) -> bool:
        """Whether ops are seen now: started and not paused."""
        return self._seeing

    def resized(self, storage: Any, old_nbytes: int) -> None:
        """``storage`` was resized in place from ``old_nbytes`` (``UntypedStorage.resize_``, which is no
        dispatcher op: FSDP frees and re-allocates its unsharded parameters this way, keeping the storage
        object). A counted storage takes its new size (shrunk to 0 it holds nothing); one not counted that
        grows from nothing while ops are seen is an allocation and is counted from now on."""
        if self._device_type is not None and storage.device.type != self._device_type:
            return
        if self._known(storage):
            return
        if old_nbytes == 0 and storage.nbytes() > 0 and self._seeing:
            self._count(storage)

    @property
    def live_count(self) -> int:
        """How many storages are counted and still alive."""
        return len(self._live)

    def live(self) -> dict[StorageKey, int]:
        """The storages counted and still alive: storage key -> bytes (a copy)."""
        with self._lock:
            return dict(self._live)

    # tracking ----------------------------------------------------------------------------
    def track(self, t: torch.Tensor, inputs: frozenset[StorageKey] = frozenset()) -> None:
        """Count ``t``'s storage if it is new (ops' outputs come here; callers may add others).

        ``inputs`` are the storages of the op's inputs: an output sharing one of them is a view
        (``weight.t()``) or an in-place result, never an allocation, even when that storage
        predates tracking and so is not counted.
        """
        if self._device_type is not None and t.device.type != self._device_type:
            return
        try:
            storage = storage_of(t)
        except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses without a storage
            return
        if not self._known(storage) and storage._cdata not in inputs:
            self._count(storage)

    def _known(self, storage: Any) -> bool:
        """Whether ``storage`` is counted already (then its size is brought up to date: resized in place)."""
        known = self._live.get(storage._cdata)
        if known is None:
            return False
        nbytes = storage.nbytes()
        if known != nbytes:
            with self._lock:
                self._current += nbytes - known
                self._live[storage._cdata] = nbytes
                self._peak = max(self._peak, self._current)
                if self.events is not None:
                    self.events.resize(storage._cdata, nbytes, storage.device.type)
        return True

    def _count(self, storage: Any) -> None:
        key = int(storage._cdata)
        nbytes = int(storage.nbytes())
        with self._lock:
            self._live[key] = nbytes
            self._refs[key] = weakref.KeyedRef(storage, self._free, key)
            self._current += nbytes
            self._peak = max(self._peak, self._current)
            self.allocations += 1
            if self.events is not None:
                self.events.alloc(key, nbytes, storage.device.type)

    def _free(self, ref: weakref.KeyedRef) -> None:
        with self._lock:
            if self._refs.get(ref.key) is not ref:  # a reference dropped by start/stop
                return
            del self._refs[ref.key]
            self._current -= self._live.pop(ref.key)
            if self._shadows:
                shadow = self._shadows.pop(ref.key, 0)
                if ref.key not in self.held:
                    self._current -= shadow
            if self.events is not None:
                self.events.free(ref.key)

    # bytes not made by ops (vramguard.estimate.ghosts) -----------------------------------------
    def add(self, nbytes: int, peak: int) -> None:
        """Count ``nbytes`` more (fewer, negative) live bytes that no storage here holds, and ``peak`` as a
        reading the peak takes in: what copies of a span the step did not run would have done."""
        with self._lock:
            self._current += nbytes
            self._peak = max(self._peak, peak, self._current)

    def marks(self) -> dict[StorageKey, Any]:
        """The storages counted now (key -> the reference that follows it), for :meth:`born_since`."""
        with self._lock:
            return dict(self._refs)

    def born_since(self, marks: dict[StorageKey, Any]) -> dict[StorageKey, int]:
        """The storages counted after ``marks`` (:meth:`marks`) and still alive: key -> bytes."""
        with self._lock:
            return {key: self._live[key] for key, ref in self._refs.items() if marks.get(key) is not ref}

    def shadow(self, key: StorageKey, nbytes: int) -> None:
        """``nbytes`` counted by :meth:`add` leave when the counted storage ``key`` is freed (unless ``key`` is
        :attr:`held` then)."""
        with self._lock:
            self._shadows[key] = self._shadows.get(key, 0) + nbytes

    def adopt(self, storage: Any) -> None:
        """Follow ``storage``, made outside the tracker, from now on: its bytes are among those counted
        (by :meth:`add`) already, so the count does not change until it is freed."""
        key = int(storage._cdata)
        with self._lock:
            self._live[key] = int(storage.nbytes())
            self._refs[key] = weakref.KeyedRef(storage, self._free, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        temporaries = self.kernel_temporaries(func, args, kwargs or {}) if self.kernel_temporaries else []
        for block in temporaries:
            self._count(block.untyped_storage())
        try:
            out = func(*args, **(kwargs or {}))
        except BaseException:
            temporaries.clear()  # the kernel never ran: its blocks go now, not with the traceback's frame
            raise
        outputs = (out,) if type(out) is torch.Tensor else tensor_leaves(out)
        # ``torch.tensor(data)`` builds its storage outside the dispatcher and only then lifts it:
        # the lifted tensor is an allocation although it shares its input's storage
        inputs: frozenset[StorageKey] | None = frozenset() if func in _LIFTS else None
        for t in outputs:
            if self._device_type is not None and t.device.type != self._device_type:
                continue
            try:
                # a DTensor's own storage has the global size: its local shard's is what this process holds
                storage = t.untyped_storage() if type(t) is torch.Tensor else storage_of(t)
            except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses without a storage
                continue
            if self._known(storage):
                continue
            if inputs is None:  # found only when an output's storage is new to the tracker
                inputs = _storage_keys(tensor_leaves((args, kwargs)))
            if storage._cdata not in inputs:
                self._count(storage)
        # freed once the outputs are counted, as the kernel frees them (their callbacks subtract them)
        del temporaries
        return out


_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default})


class _ResizeWatch:
    """The :class:`StorageTracker` objects started and not stopped, told of every in-place storage resize.

    ``UntypedStorage.resize_`` changes a storage's bytes without an op a dispatch mode could see; FSDP (both
    versions) frees each unsharded parameter after use with ``resize_(0)`` and allocates it again with
    ``resize_(n)`` on the same storage object. While at least one tracker is started, the method is wrapped
    (on ``torch.UntypedStorage``, which ``TypedStorage._resize_`` also reaches); the original is put back when
    the last one stops."""

    def __init__(self) -> None:
        self.trackers: list[StorageTracker] = []
        self._original: Any = None

    def add(self, tracker: StorageTracker) -> None:
        """Tell ``tracker`` of resizes from now on (the wrapper is installed with the first tracker)."""
        if tracker in self.trackers:
            return
        self.trackers.append(tracker)
        if self._original is None:
            original = self._original = torch.UntypedStorage.resize_
            watch = self

            def resize_(storage: Any, size: int) -> Any:
                old = storage.nbytes()
                result = original(storage, size)
                for t in list(watch.trackers):
                    t.resized(storage, old)
                return result

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def discard(self, tracker: StorageTracker) -> None:
        """Stop telling ``tracker``; the last one gone, ``resize_`` is torch's own again."""
        if tracker in self.trackers:
            self.trackers.remove(tracker)
        if not self.trackers and self._original is not None:
            torch.UntypedStorage.resize_ = self._original  # type: ignore[method-assign]
            self._original = None


_RESIZES = _ResizeWatch()


def _storage_keys(values: Iterable[torch.Tensor]) -> frozenset[StorageKey]:
    keys = set()
    for v in values:
        try:
            keys.add(storage_key(v))
        except (RuntimeError, NotImplementedError):
            pass
    return frozenset(keys)


class CudaAllocatorSource:
    """The CUDA caching allocator's statistics for one device."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self._device = torch.device(device)
        self.device = str(self._device)

    def current(self) -> int:
        """Bytes the caching allocator has handed to tensors on this device now
        (``torch.cuda.memory_allocated``); cached free blocks are not counted."""
        return int(torch.cuda.memory_allocated(self._device))

    def peak(self) -> int:
        """The highest allocated bytes since the last reset (``torch.cuda.max_memory_allocated``), kernel
        scratch space included."""
        return int(torch.cuda.max_memory_allocated(self._device))

    def reset_peak(self) -> None:
        """Reset the allocator's peak statistics (allocated and reserved) to the current values."""
        torch.cuda.reset_peak_memory_stats(self._device)

    def settle(self) -> None:
        """Wait for the device, then let the allocator take back the blocks whose free waits on another
        stream's work (``record_stream``: activation offloading's copy streams). Such a block counts as
        allocated until the allocator's next ``malloc`` looks at its events, so a reading right after a
        step would count tensors the program has already dropped; one small allocation makes that look."""
        torch.cuda.synchronize(self._device)
        torch.empty(1, dtype=torch.uint8, device=self._device)

    def reserved(self) -> int:
        """Bytes the caching allocator holds from the driver now (``torch.cuda.memory_reserved``): allocated
        bytes plus cached free blocks and fragmentation."""
        return int(torch.cuda.memory_reserved(self._device))

    def peak_reserved(self) -> int:
        """The highest reserved bytes since the last reset (``torch.cuda.max_memory_reserved``): what the
        process took from the device, fragmentation included."""
        return int(torch.cuda.max_memory_reserved(self._device))

    def start(self) -> None:
        """Collect the process's garbage, wait for the kernels already queued, then reset the peaks, so that they
        describe only what follows. The peaks are absolute allocator readings: a model of an earlier run in this
        process that only the cycle collector frees would count in them (on an H200 a second audit in one
        process read 1,138,176 B high, docs/measurements/2026-11-27-h200); Trainer collects at the same point
        (``accelerator.free_memory()`` before its loop). Cached segments are left alone: what the build left
        reserved is part of the run, as in a fresh process."""
        gc.collect()
        torch.cuda.synchronize(self._device)
        self.reset_peak()

    def stop(self) -> None:
        """Wait for the queued kernels, so that statistics read afterwards include all of the block's work."""
        torch.cuda.synchronize(self._device)


def source_for(device: str | torch.device) -> MemorySource:
    """The right source for a device: the allocator on CUDA, storage tracking elsewhere."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaAllocatorSource(dev)
    return StorageTracker(dev.type)


@dataclass
class FrameStats:
    """Memory of one phase or module, accumulated over its calls (peaks are maxima, deltas sums)."""

    name: str
    calls: int = 0
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    delta_bytes: int = 0
    peak_above_start: int = 0
    reserved_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stats as the audit's JSON records them: every field, bytes as integers (``reserved_peak_bytes``
        None off CUDA)."""
        return asdict(self)

    def merge(self, call: FrameStats) -> None:
        """Fold one call's stats into this aggregate."""
        if self.calls == 0:
            self.start_bytes = call.start_bytes
        self.calls += call.calls
        self.end_bytes = call.end_bytes
        self.peak_bytes = max(self.peak_bytes, call.peak_bytes)
        self.delta_bytes += call.delta_bytes
        self.peak_above_start = max(self.peak_above_start, call.peak_above_start)
        if call.reserved_peak_bytes is not None:
            self.reserved_peak_bytes = max(self.reserved_peak_bytes or 0, call.reserved_peak_bytes)


@dataclass(eq=False)
class Frame:
    """An open frame of a :class:`MemoryTracker` (:meth:`MemoryTracker.open_frame`): the stats it fills
    when closed, the bytes live when it opened, its peak so far, and the aggregate it is folded into.
    Frames are compared by identity: two open at the same bytes are still two frames."""

    stats: FrameStats
    start: int
    peak: int
    aggregate: FrameStats | None = None


@dataclass
class TrackerResult:
    """What a :class:`MemoryTracker` measured on ``device``: ``peak_bytes``, the highest live bytes of the
    whole ``with`` block as its source counts them (CPU/meta: storages made inside the block; CUDA: everything
    allocated), and per phase name and per module name the stats aggregated over their calls."""

    device: str
    peak_bytes: int
    phases: dict[str, FrameStats] = field(default_factory=dict)
    modules: dict[str, FrameStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON: device, peak bytes, and each phase's and module's
        :meth:`FrameStats.to_dict`."""
        return {
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "phases": {k: v.to_dict() for k, v in self.phases.items()},
            "modules": {k: v.to_dict() for k, v in self.modules.items()},
        }


class MemoryTracker:
    """Context manager: tracks live bytes on ``device``; phases via :meth:`phase`, modules via hooks.

    >>> with MemoryTracker("cpu", model=model) as tracker:
    ...     with tracker.phase("forward"):
    ...         loss = model(x).sum()
    ...     with tracker.phase("backward"):
    ...         loss.backward()
    >>> tracker.result.phases["forward"].peak_bytes

    ``events``: an :class:`~vramguard.measure.events.AllocationLog` that receives every allocation and free the
    source counts (a :class:`StorageTracker`: CPU, meta, or a device beside another source), each with the
    phase, the module stack and, in backward, the autograd node running when it happened; with ``model``, the
    model's storages that exist before the block are its pre-existing blocks (weights, trainable parameters).
    With another source (the CUDA allocator's) a :class:`StorageTracker` of the device's type records the events
    beside it: the figures stay the allocator's, the log holds the storages ops made (not cuBLAS's workspaces,
    nor what a kernel holds only while it runs: docs/measurements/2026-11-25-h100 compares it with the
    allocator's own history).
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        model: torch.nn.Module | None = None,
        source: MemorySource | None = None,
        events: AllocationLog | None = None,
    ) -> None:
        self.source: MemorySource = source or source_for(device)
        self.model = model
        self.result = TrackerResult(device=self.source.device, peak_bytes=0)
        self._open: list[Frame] = []
        self._modules = ModuleStack({}, self._enter_module, self._exit_module)
        self._recorder: StorageTracker | None = None
        if events is not None:
            # the source's device decides what is recorded (a CUDA allocator source: CUDA storages only)
            recorded = torch.device(self.source.device).type if self.source.device != "any" else None
            self._recorder = (
                self.source if isinstance(self.source, StorageTracker) else StorageTracker(recorded)
            )
        self.events = events

    def __enter__(self) -> MemoryTracker:
        if self.events is not None:
            assert self._recorder is not None
            self.events.device = self.source.device
            self.events.context = self._context
            if self.model is not None:
                self.events.add_preexisting(model_storages(self.model))
            self._recorder.events = self.events
            if self._recorder is not self.source:
                self._recorder.start()
        try:
            self.source.start()
            self._root = self.open_frame(FrameStats("total"))
            if self.model is not None:
                self._modules.names = module_names(self.model)
                self._modules.__enter__()
        except BaseException:
            self._stop_recording()  # no dispatch mode left behind for whatever runs next
            raise
        return self

    def _stop_recording(self) -> None:
        """Stop the events' recorder (a storage tracker beside another source) and close the log."""
        if self.events is None:
            return
        assert self._recorder is not None
        if self._recorder is not self.source:
            self._recorder.stop()
        self._recorder.events = None
        self.events.stop()

    def _context(self) -> Context:
        """Where the step is now, for :attr:`events`: phase, call, module stack and autograd node."""
        assert self.events is not None
        phase, call = self.events.phase_now()
        node = None
        if torch._C._current_graph_task_id() != -1:
            running = torch._C._current_autograd_node()
            node = running.name() if running is not None else None
        return (phase, call, tuple(self._modules.stack), node)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._modules.__exit__(exc_type, exc, tb)
            while len(self._open) > 1:
                self.close_frame()
            root = self.close_frame()
            self.result.peak_bytes = root.peak_bytes
            self.source.stop()
        finally:
            self._stop_recording()

    def current(self) -> int:
        """Bytes live now as the source counts them (a reading only: no frame's peak is updated)."""
        return self.source.current()

    def peak(self) -> int:
        """Highest live bytes since tracking began."""
        self._fold()
        return self._open[0].peak if self._open else self.result.peak_bytes

    @contextmanager
    def phase(self, name: str) -> Iterator[FrameStats]:
        """Measure a block; yields this call's stats (filled on exit), aggregated under ``name``."""
        call = FrameStats(name)
        frame = self.open_frame(call, self.result.phases.setdefault(name, FrameStats(name)))
        if self.events is not None:
            self.events.begin(name)
        try:
            yield call
        finally:
            if self.events is not None:
                self.events.end(name)
            self.close_frame(frame)

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(calls, delta bytes), the two sums of every phase's and module's aggregate, by (``phases`` or
        ``modules``, name): what :meth:`add_counts` adds to."""
        result = self.result
        return {
            (kind, name): (stats.calls, stats.delta_bytes)
            for kind, stats_of in (("phases", result.phases), ("modules", result.modules))
            for name, stats in stats_of.items()
        }

    def add_counts(self, before: dict[tuple[str, str], tuple[int, int]], times: int) -> None:
        """Add to every aggregate's sums ``times`` what they gained since ``before`` (:meth:`counts`): the
        aggregates as if that span had run ``times`` more times. Its peaks and its last call's end are those
        of every repeat, so they stay."""
        for (kind, name), (calls, delta) in self.counts().items():
            stats = getattr(self.result, kind)[name]
            calls0, delta0 = before.get((kind, name), (0, 0))
            stats.calls += times * (calls - calls0)
            stats.delta_bytes += times * (delta - delta0)

    # frames -------------------------------------------------------------------------------
    def _fold(self) -> None:
        peak = self.source.peak()
        for frame in self._open:
            frame.peak = max(frame.peak, peak)
        self.source.reset_peak()

    def open_frame(self, stats: FrameStats, aggregate: FrameStats | None = None) -> Frame:
        """Open a frame that ``stats`` describes, for a span that is no ``with`` block (hook pairs:
        an autograd node's pre/post hooks, a trainer's events). Frames may close in any order; each gets
        the exact peak of its own span. Close it with :meth:`close_frame`; ``aggregate`` (optional)
        then accumulates this call's stats (as :meth:`phase` does per name)."""
        self._fold()
        now = self.source.current()
        frame = Frame(stats, now, now, aggregate)
        self._open.append(frame)
        return frame

    def close_frame(self, frame: Frame | None = None) -> FrameStats:
        """Close ``frame`` (default: the last opened) and return its filled stats."""
        self._fold()
        frame = frame or self._open[-1]
        self._open.remove(frame)
        now = self.source.current()
        s = frame.stats
        if s.calls == 0:
            s.start_bytes = frame.start
        s.calls += 1
        s.end_bytes = now
        s.peak_bytes = max(s.peak_bytes, frame.peak)
        s.delta_bytes += now - frame.start
        s.peak_above_start = max(s.peak_above_start, frame.peak - frame.start)
        if isinstance(self.source, CudaAllocatorSource):
            s.reserved_peak_bytes = max(s.reserved_peak_bytes or 0, self.source.peak_reserved())
        if frame.aggregate is not None:
            frame.aggregate.merge(s)
        return s

    @property
    def open_frames(self) -> int:
        """How many frames are open (the root frame of the ``with`` block included)."""
        return len(self._open)

    def _enter_module(self, name: str, module: torch.nn.Module) -> Frame:
        aggregate = self.result.modules.get(name)
        if aggregate is None:
            aggregate = self.result.modules[name] = FrameStats(name)
        return self.open_frame(FrameStats(name), aggregate)

    def _exit_module(
        self, name: str, frame: Frame, module: torch.nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        self.close_frame(frame)


class CpuAllocatorSource:
    """The c10 CPU allocator's own allocations and frees, counted in C++ by torch's profiler.

    While started, torch's (legacy) autograd profiler runs on this thread with ``profile_memory`` and with
    ``RecordFunction`` switched off, so it records no op events, only one memory event per allocation and
    free of the CPU allocator. :meth:`current` / :meth:`peak` take the events recorded so far from the running
    profiler and keep a running sum and its maximum. Nothing runs in Python per op; handing an allocation's
    two events to Python costs about 1 us (a measured small-llama step: ~1400 allocations, ~1.5 ms, under
    1 % of its wall), which is why it costs about a percent of a step where :class:`StorageTracker` costs
    tens.

    Like :class:`StorageTracker` it counts bytes allocated since :meth:`start` and still alive (weights made
    before are not counted; freeing a block made before the start is not subtracted and c10 warns once per
    1000 such frees). Unlike it, it sees the allocator, not tensors: buffers a kernel allocates and frees
    inside one op count, storages of memory the allocator did not make (``torch.from_numpy``) do not, and
    sizes are those asked of the allocator (a storage's bytes). Only this thread's allocations are seen (on
    CPU the autograd engine runs backward on the calling thread; worker threads of a parallel kernel may
    allocate unseen), and the profiler is this thread's: ``torch.profiler`` cannot run beside it
    (:meth:`start` raises ``RuntimeError`` when a profiler already runs).

    It can be read only outside the autograd engine: ``with tracker.phase("backward"): loss.backward()``
    gets backward's exact peak, but a frame opened or closed by an autograd hook (a node's pre/post hook,
    ``queue_callback``) raises ``RuntimeError``: the engine runs nodes under the thread-local state it copied
    when backward began (see :meth:`_sync`). ``VramGuardCallback(cpu_source="allocator")`` therefore opens and
    closes backward's phase around torch's backward entry, not in autograd hooks.
    """

    def __init__(self) -> None:
        self.device = "cpu"
        self._current = 0
        self._peak = 0
        self._thread: int | None = None
        self._cfg: Any = None
        self._take: Any = None
        self.allocations = 0

    @staticmethod
    def _config() -> Any:
        p = torch._C._profiler
        # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental
        return p.ProfilerConfig(
            p.ProfilerState.CPU, False, True, False, False, False, p._ExperimentalConfig()
        )

    def current(self) -> int:
        """Bytes the CPU allocator handed out since :meth:`start` and not yet got back (this thread)."""
        self._sync()
        return self._current

    def peak(self) -> int:
        """The highest :meth:`current` since :meth:`start` or the last :meth:`reset_peak`, in bytes."""
        self._sync()
        return self._peak

    def reset_peak(self) -> None:
        """Let the peak start again from the bytes live now."""
        self._sync()
        self._peak = self._current

    def start(self) -> None:
        """Start the profiler's memory events on this thread, with current and peak at 0.

        ``RuntimeError`` when a profiler already runs on this thread (``torch.profiler``) or this torch has
        no legacy profiler."""
        autograd = torch._C._autograd
        legacy = ("_enable_profiler_legacy", "_ProfilerDisableOptions", "ProfilerEvent")
        if not all(hasattr(autograd, n) for n in legacy):
            raise RuntimeError(
                f"torch {torch.__version__} has no legacy profiler to count CPU allocations with"
            )
        if autograd._profiler_enabled():
            raise RuntimeError("a profiler already runs on this thread: the CPU allocator cannot be counted")
        self._current = self._peak = self.allocations = 0
        self._cfg = self._config()
        self._take = autograd._ProfilerDisableOptions(False, True)  # keep it running, take its events
        autograd._enable_profiler_legacy(self._cfg)
        autograd._enable_record_function(False)  # no op events: memory events only
        self._thread = threading.get_ident()

    def stop(self) -> None:
        """Take the last events and stop the profiler; :meth:`current` and :meth:`peak` keep their values."""
        if self._thread is None:
            return
        self._sync()
        self._thread = None
        # torch has no getter for it: record functions are on unless something turned them off, as start() did
        torch._C._autograd._enable_record_function(True)
        torch._C._autograd._disable_profiler_legacy()

    def _sync(self) -> None:
        """Fold the events recorded since the last call into current and peak (on the starting thread only:
        the profiler is that thread's)."""
        if self._thread is None or threading.get_ident() != self._thread:
            return
        if torch._C._current_graph_task_id() != -1:
            # the engine runs each node under the thread-local state it copied when backward began and puts
            # that state back after the node. A profiler restarted here would be dropped (this source used to
            # restart it at each read); taking events from it without a restart may be safe, but that is not
            # established, so the readings stay outside the engine
            raise RuntimeError(
                "CpuAllocatorSource cannot be read inside backward (an autograd hook): measure phases whose "
                "boundaries lie outside the autograd engine, or use StorageTracker"
            )
        # the events so far, taken from the running profiler (it is neither stopped nor restarted, so nothing
        # recorded meanwhile is lost); each call adds one 0-byte mark
        autograd = torch._C._autograd
        threads = autograd._disable_profiler_legacy(self._take)
        if len(threads) == 1:
            events = threads[0]
        else:  # one list per thread the profiler's state reached: merged in time order
            events = sorted((e for evs in threads for e in evs), key=autograd.ProfilerEvent.start_us)
        # with record functions off the events are allocations (bytes > 0), frees (< 0) and marks (0): their
        # running sum, taken in C (a measured small-llama step has ~2800 events; a Python loop over them
        # cost a quarter of what handing them to Python does)
        sizes = list(map(autograd.ProfilerEvent.cpu_memory_usage, events))
        running = list(accumulate(sizes, initial=self._current))
        self._current = running[-1]
        self._peak = max(self._peak, max(running))
        self.allocations += sum(map((0).__lt__, sizes))
