"""A mixture of experts' routing forced to a chosen assignment (a request's ``routing``: one of
:data:`vramguard.workload.routing.ROUTINGS` or tokens per expert): the router's choice replaced in every experts
module, through one hook on a device (:func:`vramguard.workload.routing.forced_routing`: the audit's loop, a
Trainer's run, a rank) and on meta with the assignment's values carried beside the meta tensors
(:func:`vramguard.estimate.meta.routed_on_meta`). Eager experts whose routing is not forced are priced between
their steps with each forced routing (``bounded_by``: the requests, each producer running them its own way)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from vramguard.step import verdict as checks
from vramguard.step.report import with_routing_note
from vramguard.step.request import META, StepRequest
from vramguard.step.technique import Technique
from vramguard.workload.families import experts_of
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.routing import ROUTINGS, eager_top_k, experts_top_k, forced_line, forced_routing


def applies(config: QLoRAConfig) -> bool:
    """Whether the step's model is a mixture of experts (whose routing a request can force): its language model's
    config says so (a vision-language model keeps it under ``text_config``)."""
    built = config.spec.built
    text = built.get_text_config() if hasattr(built, "get_text_config") else built
    return experts_of(text) is not None


def context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The request's routing forced on the model's experts for the step (on meta, or on a real device's
    tensors), outside the tracker (whose mode then sees the meta results, not the carried values); nothing
    without one. Yields the hook's counts (``forced``, ``counts``, and on meta ``answered``)."""
    if request.routing is None:
        return contextlib.nullcontext({})
    tokens = request.config.batch * request.config.seq_len
    if request.device == META:
        from vramguard.estimate.meta import routed_on_meta

        return routed_on_meta(model.model, request.routing, tokens)
    return forced_routing(model.model, request.routing, tokens)


def revise(report: Any, model: Any, request: StepRequest, seen: dict[str, Any] | None) -> Any:
    """A forced routing's ``routing:`` line in place of the build's (what routing decides): the assignment, by
    experts count."""
    if request.routing is None or seen is None:
        return report
    line = forced_line(request.routing, experts_top_k(model.model), seen["counts"])
    return with_routing_note(report, checks.ROUTING, line)


def bounded_by(request: StepRequest, model: Any) -> dict[str, StepRequest]:
    """Eager experts whose routing is not forced: a loop over the experts hit, whose peak the routing decides and
    meta cannot draw; the step lies between its runs with each forced routing (:data:`ROUTINGS`), one request
    each, by routing. {} for a forced routing or experts run batched."""
    if request.routing is not None or eager_top_k(model.model) is None:
        return {}
    return {kind: dataclasses.replace(request, routing=kind) for kind in ROUTINGS}


TECHNIQUE = Technique(
    name="routing",
    description="a mixture of experts' routing forced to a chosen assignment, the router's choice replaced",
    stage="around",
    applies=applies,
    context=context,
    revise=revise,
    bounded_by=bounded_by,
)
