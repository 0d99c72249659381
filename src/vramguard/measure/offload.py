"""Host bytes of activation offloading: what the saved-tensor hooks in force keep on the CPU.

Activation offloading (:func:`torch.autograd.graph.save_on_cpu`, TRL's ``OffloadActivations``) is a pair of
saved-tensor hooks: pack copies each tensor autograd saves to host memory and returns a handle, unpack
copies it back in backward. The device's own meter (the CUDA allocator, or the storage tracker) sees the
device side; :class:`HostMeter` sees the other side. While installed it wraps the hooks in force (only the
innermost pair of ``saved_tensors_hooks`` runs, so it calls them) and counts, with a
:class:`~vramguard.measure.tracker.StorageTracker` for ``cpu`` that sees ops only inside their pack hook,
every CPU storage the pack creates, until that storage is freed (unpack in backward, or the graph freed).
On a CPU run the host is the device: those bytes are counted by the device's tracker as well.

>>> hooks = hooks_in_force()                    # None: no offloading in force
>>> meter = HostMeter()
>>> with meter.wrapping(hooks):                 # around one forward
...     loss = model(**batch).loss
>>> meter.peak(), meter.current()               # host bytes held at most, and still
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vramguard.measure.tracker import StorageTracker

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def hooks_in_force() -> Hooks | None:
    """The (pack, unpack) pair of saved-tensor hooks autograd would run now (activation offloading), or None
    when there is none (or torch cannot tell). Only the innermost pair runs: a measurer that pushes its own
    pair calls these from it, or offloading stops inside its block."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class HostMeter:
    """Live and peak bytes of the CPU storages created by the pack hooks it wraps (see the module's text).

    :meth:`start` begins counting (nothing counted yet), :meth:`stop` ends it; between them any number of
    :meth:`wrapping` blocks may run. ``packs`` counts the tensors that went through the wrapped pack hook."""

    def __init__(self) -> None:
        self._tracker = StorageTracker("cpu")
        self._running = False
        self.packs = 0

    def start(self) -> None:
        """Count from zero; storages the hooks create are followed until they are freed, even after a
        :meth:`wrapping` block ends."""
        if self._running:
            return
        self._tracker.start()
        self._tracker.pause()  # the tracker sees ops only inside the wrapped pack hook
        self._running = True

    def stop(self) -> None:
        """Stop following storages; :meth:`current` and :meth:`peak` keep their last values."""
        if not self._running:
            return
        self._tracker.resume()
        self._tracker.stop()
        self._running = False

    def current(self) -> int:
        """Bytes of the host storages the hooks created that are still alive."""
        return self._tracker.current()

    def peak(self) -> int:
        """The most bytes alive at once since :meth:`start` or :meth:`reset_peak`."""
        return self._tracker.peak()

    def reset_peak(self) -> None:
        """Let the peak start again from the bytes alive now."""
        self._tracker.reset_peak()

    @contextmanager
    def wrapping(self, hooks: Hooks) -> Iterator[HostMeter]:
        """Push a pair of saved-tensor hooks that calls ``hooks`` and counts what their pack allocates on
        the CPU (:meth:`start` first, if not started)."""
        self.start()
        pack, unpack = hooks
        tracker = self._tracker

        def counted_pack(tensor: torch.Tensor) -> Any:
            self.packs += 1
            tracker.resume()
            try:
                return pack(tensor)
            finally:
                tracker.pause()

        with torch.autograd.graph.saved_tensors_hooks(counted_pack, unpack):
            yield self
