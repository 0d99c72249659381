"""One step request: what to run, validated once at construction and passed on.

A :class:`StepRequest` holds the model (resolved), the data shape, the method and the techniques (all in its
:class:`~vramguard.workload.models.QLoRAConfig`), the target whose kernels the step takes, and how it runs (steps,
the device of the run, a forced routing, the rows' sequences). The estimate's runs, its ranks and ``--fit``'s
probes take it, and so do the audit's loop, the Trainer audit and the audit's real ranks (a request on the
config's own device: :meth:`StepRequest.on_device`); a derived request (``dataclasses.replace``) is validated
again, cheaply: the model stays resolved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vramguard.errors import UsageError
from vramguard.workload.families import experts_of
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.routing import Routing

TARGETS: tuple[str, ...] = ("cuda", "cpu")
"""The devices whose kernel choices a meta run can take (``forced_decisions(target)``)."""

META = "meta"
"""The device an estimate runs on: real shapes and dtypes, no data."""

CONFIG_OVERRIDES: tuple[str, ...] = ("method", "optimizer", "offload_activations")
"""Config fields a request can be given apart from its config (None: the config's own)."""


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """One training step to run: ``config`` (the model resolved, data shape, method, techniques), ``target``
    (:data:`TARGETS`: the device whose kernels the step takes), ``steps``, ``device`` (where it runs: meta,
    cpu for the tests' real-tensor reference, or the config's device for the audit: :meth:`on_device`), ``routing`` (a mixture of experts' routing forced, or None) and
    ``one_sequence_per_row`` (packed rows forced to one sequence each, or None: as the data decides) and ``gpu``
    (the card, :class:`vramguard.estimate.gpus.Gpu`, whose CUDA context allowance the total takes; None: the
    H100's). Validated at construction (one-line :class:`UsageError`: a routing forced on a dense model too), its
    config resolved there."""

    config: QLoRAConfig
    target: str = "cuda"
    steps: int = 2
    device: str = META
    routing: Routing | None = None
    one_sequence_per_row: bool | None = None
    gpu: Any = None
    bounds: bool = True
    """Whether the data's bounds are priced (:func:`vramguard.estimate.run.data_bounds`: for packed rows a second
    meta run, the rows one sequence each); False for a run whose figure alone is read (``--fit``'s probes)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"steps must be at least 1, got {self.steps}")
        self.config.validate()  # first: a request on the config's device (on_device) takes its target from it
        if self.target not in TARGETS:
            raise UsageError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        object.__setattr__(self, "config", self.config.resolved())
        if self.routing is not None and experts_of(self.config.spec.built) is None:
            name = self.config.spec.name
            raise UsageError(f"routing forced to {self.routing}, but {name} has no experts to route")

    @classmethod
    def of(cls, config: QLoRAConfig, **options: Any) -> StepRequest:
        """A request for ``config`` with ``options``: this class's fields, and :data:`CONFIG_OVERRIDES` (when
        not None they replace the config's fields)."""
        changes = {k: options.pop(k) for k in CONFIG_OVERRIDES if k in options}
        config = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
        return cls(config, **options)

    @classmethod
    def on_device(cls, config: QLoRAConfig, **options: Any) -> StepRequest:
        """A request run on ``config``'s own device (the audit's loop, a Trainer's run, a real rank): ``device``
        is the config's and ``target`` its type (``cuda:1`` runs with CUDA's kernels); ``options`` as
        :meth:`of`'s."""
        kind = str(config.device).split(":", 1)[0]  # validated with the config at construction
        return cls.of(config, target=kind, device=config.device, **options)


def audit_request(request: StepRequest | QLoRAConfig, options: dict[str, Any], **defaults: Any) -> StepRequest:
    """``request``, or the request of a config run on its own device (:meth:`StepRequest.on_device`) with
    ``options`` over ``defaults``: what the audit's loop, the Trainer audit and the audit's ranks take. A request
    given with options is a TypeError (it carries its own), one on meta a UsageError (the audit runs on a
    device)."""
    if not isinstance(request, StepRequest):
        return StepRequest.on_device(request, **{**defaults, **options})
    if options:
        raise TypeError(f"a StepRequest carries its options; got {sorted(options)}")
    if request.device == META:
        raise UsageError("the audit runs its step on a device (cpu or cuda), not on meta: vramguard estimate does")
    return request
