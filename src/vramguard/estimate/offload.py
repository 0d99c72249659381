"""Activation offloading on the meta device: :func:`torch.autograd.graph.save_on_cpu`, emulated.

``save_on_cpu`` is a pair of saved-tensor hooks: pack copies each tensor autograd saves to a host
buffer (``torch.empty(size, dtype, pin_memory=...)`` + ``copy_``) and returns it, so the device tensor
is freed once nothing else holds it; unpack, in backward, copies the buffer back (``packed.to(device)``),
a new device tensor per use. On meta there is no host to copy to, so :class:`OffloadActivations` keeps
the same pair of hooks and moves only the accounting:

* pack creates the "host" buffer (of the tensor's size and dtype, on the tensor's own device, meta)
  with every dispatch mode switched off (``_disable_current_modes``): the storage tracker does not
  count it, as it does not count host memory on a GPU run; its bytes are added to ``host_bytes``;
* unpack allocates the device copy with the modes on: the tracker counts it in backward, where the
  real copy back is allocated.

What this does not model: the copies' time and the pinned host memory's limits; tensors a custom
``autograd.Function`` keeps as ``ctx`` attributes (bitsandbytes) are not offloaded, as
``save_on_cpu`` does not see them either. The hooks are innermost for the model's forward (a
forward pre-hook on the root module pushes them), so the saved-tensor ledger's hook probe sees
nothing under them: with offloading the ledger lists what stays on the device (ctx-kept tensors).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


class OffloadActivations:
    """``save_on_cpu`` around every forward of ``model`` (while installed), with the host copies
    outside the trackers. ``host_bytes``: bytes packed so far (every saved tensor, per save, as
    ``save_on_cpu`` copies it); ``host_peak_bytes``: the most held at once (freed as autograd drops
    them); ``unpacks``: copies made back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.packs = 0
        self.unpacks = 0
        self.host_bytes = 0
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self._handles: list[Any] = []
        self._contexts: list[Any] = []

    def counts(self) -> dict[str, int]:
        """The sums so far (packs, unpacks, bytes packed): what a step that prices repeated micro-batches
        from one adds to (:meth:`add`; :class:`vramguard.workload.training.Repeats`)."""
        return {"packs": self.packs, "unpacks": self.unpacks, "host_bytes": self.host_bytes}

    def add(self, more: dict[str, int]) -> None:
        """Add ``more`` (by :meth:`counts`' names) to the sums."""
        self.packs += more.get("packs", 0)
        self.unpacks += more.get("unpacks", 0)
        self.host_bytes += more.get("host_bytes", 0)

    def __enter__(self) -> OffloadActivations:
        self._handles.append(self.model.register_forward_pre_hook(self._push))
        self._handles.append(self.model.register_forward_hook(self._pop, always_call=True))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    def _push(self, module: torch.nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._contexts.append(hooks)

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device, _HostCopy]:
        with _disable_current_modes():  # host memory: no part of the device's accounting
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device=tensor.device)
            host.copy_(tensor)
        self.packs += 1
        nbytes = host.numel() * host.element_size()
        self.host_bytes += nbytes
        return tensor.device, _HostCopy(host, nbytes, self)

    def _unpack(self, packed: tuple[torch.device, _HostCopy]) -> torch.Tensor:
        device, copy = packed
        self.unpacks += 1
        # the copy back: a new device tensor, counted (save_on_cpu: ``packed.to(device)``)
        out = torch.empty(copy.tensor.size(), dtype=copy.tensor.dtype, device=device)
        return out.copy_(copy.tensor)


class _HostCopy:
    """A packed tensor; its bytes count as held on the host until autograd drops it."""

    def __init__(self, tensor: torch.Tensor, nbytes: int, owner: OffloadActivations) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.owner = owner
        owner.host_live_bytes += nbytes
        owner.host_peak_bytes = max(owner.host_peak_bytes, owner.host_live_bytes)

    def __del__(self) -> None:
        self.owner.host_live_bytes -= self.nbytes
