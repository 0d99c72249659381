"""Live memory: current and peak bytes by phase (forward, backward, optimizer step) and per module.

Two sources answer "how many bytes are live now, and how high did it go since I last asked":

* :class:`StorageTracker` (CPU, meta, any device): a ``TorchDispatchMode`` that sees every tensor
  an op returns, counts each new storage once and subtracts it when the storage is freed. It
  needs no allocator, works on the meta device, with frozen parameters and with custom ops
  (bitsandbytes' ops are ordinary dispatcher ops). It sees tensors, not allocator internals:
  scratch buffers a kernel allocates and frees inside one op are invisible, as are storages
  created before tracking started (the model's own weights), which is what a delta should omit.
* :class:`CudaAllocatorSource`: the caching allocator's own statistics (allocated, reserved and
  their peaks), which also see kernel scratch space and fragmentation.

:class:`MemoryTracker` folds either source's peak into every open frame (phase or module call)
at each boundary, so nested frames get exact peaks although the source keeps only one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vramguard.measure.storage import StorageKey, storage_key


class MemorySource(Protocol):
    """Anything that knows the bytes live now and the highest value since the last reset."""

    device: str

    def current(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class StorageTracker(TorchDispatchMode):
    """Counts storages created by ops, from creation to destruction.

    ``device_type`` limits counting to one kind of device (``"cpu"``, ``"meta"``, ``"cuda"``);
    None counts all of them.
    """

    def __init__(self, device_type: str | None = "cpu") -> None:
        super().__init__()
        self.device = device_type or "any"
        self._device_type = device_type
        self._live: dict[StorageKey, int] = {}
        self._current = 0
        self._peak = 0
        self._lock = threading.Lock()
        self._generation = 0
        self.allocations = 0

    # MemorySource -------------------------------------------------------------------------
    def current(self) -> int:
        return self._current

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._current

    def start(self) -> None:
        self._generation += 1
        with self._lock:  # storages of an earlier run are no longer followed: do not count them
            self._live.clear()
            self._current = self._peak = 0
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)
        self._generation += 1  # finalizers of storages counted so far become no-ops
        self._live.clear()

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
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / wrapper subclasses without a storage
            return
        key = int(storage._cdata)
        nbytes = int(storage.nbytes())
        with self._lock:
            known = self._live.get(key)
            if known is not None:
                if known != nbytes:  # resized in place
                    self._current += nbytes - known
                    self._live[key] = nbytes
                    self._peak = max(self._peak, self._current)
                return
            if key in inputs:
                return
            self._live[key] = nbytes
            self._current += nbytes
            self._peak = max(self._peak, self._current)
            self.allocations += 1
        weakref.finalize(storage, self._free, key, self._generation)

    def _free(self, key: StorageKey, generation: int) -> None:
        if generation != self._generation:
            return
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is not None:
                self._current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: frozenset[StorageKey] | None = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if inputs is None:
                    # ``torch.tensor(data)`` builds its storage outside the dispatcher and only then
                    # lifts it: the lifted tensor is an allocation although it shares its input's storage
                    fresh = func in _LIFTS
                    inputs = frozenset() if fresh else _storage_keys(tree_flatten((args, kwargs))[0])
                self.track(t, inputs)
        return out


_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default})


def _storage_keys(values: Iterable[Any]) -> frozenset[StorageKey]:
    keys = set()
    for v in values:
        if isinstance(v, torch.Tensor):
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
        return int(torch.cuda.memory_allocated(self._device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self._device))

    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self._device))

    def start(self) -> None:
        torch.cuda.synchronize(self._device)
        self.reset_peak()

    def stop(self) -> None:
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


@dataclass
class _Open:
    stats: FrameStats
    start: int
    peak: int
    aggregate: FrameStats | None = None


@dataclass
class TrackerResult:
    device: str
    peak_bytes: int
    phases: dict[str, FrameStats] = field(default_factory=dict)
    modules: dict[str, FrameStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
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
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        model: torch.nn.Module | None = None,
        source: MemorySource | None = None,
    ) -> None:
        self.source: MemorySource = source or source_for(device)
        self.model = model
        self.result = TrackerResult(device=self.source.device, peak_bytes=0)
        self._open: list[_Open] = []
        self._handles: list[Any] = []
        self._module_calls: list[tuple[str, _Open]] = []

    def __enter__(self) -> MemoryTracker:
        self.source.start()
        self._root = self._push(FrameStats("total"))
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._exit_module(name)))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while len(self._open) > 1:
            self._pop()
        root = self._pop()
        self.result.peak_bytes = root.peak_bytes
        self.source.stop()

    def current(self) -> int:
        return self.source.current()

    def peak(self) -> int:
        """Highest live bytes since tracking began."""
        self._fold()
        return self._open[0].peak if self._open else self.result.peak_bytes

    @contextmanager
    def phase(self, name: str) -> Iterator[FrameStats]:
        """Measure a block; yields this call's stats (filled on exit), aggregated under ``name``."""
        call = FrameStats(name)
        self._push(call, self.result.phases.setdefault(name, FrameStats(name)))
        try:
            yield call
        finally:
            self._pop()

    # frames -------------------------------------------------------------------------------
    def _fold(self) -> None:
        peak = self.source.peak()
        for frame in self._open:
            frame.peak = max(frame.peak, peak)
        self.source.reset_peak()

    def _push(self, stats: FrameStats, aggregate: FrameStats | None = None) -> _Open:
        self._fold()
        now = self.source.current()
        frame = _Open(stats, now, now, aggregate)
        self._open.append(frame)
        return frame

    def _pop(self, frame: _Open | None = None) -> FrameStats:
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

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            aggregate = self.result.modules.setdefault(name, FrameStats(name))
            self._module_calls.append((name, self._push(FrameStats(name), aggregate)))

        return hook

    def _exit_module(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for i in range(len(self._module_calls) - 1, -1, -1):
                if self._module_calls[i][0] == name:
                    _, frame = self._module_calls.pop(i)
                    self._pop(frame)
                    return

        return hook
