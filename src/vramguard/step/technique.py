"""A technique a training step can use (activation offloading, Liger's kernels, ...), as one value.

Modelled on :class:`vramguard.grad.patches.Patch`: a name, a description and small functions, no flags spread
over the code. A technique says the stage it acts at (:data:`STAGES`), whether a config uses it, what it
refuses before anything is built, the context it puts on the step (what that context yields is what it saw),
its findings for the report, and the cheaper alternative ``--fit`` may offer. The registry of the estimate's
techniques, in its declared order, is :mod:`vramguard.estimate.techniques`; they are applied together in one
place (:func:`enter_stage`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vramguard.step.report import Finding
from vramguard.step.request import StepRequest
from vramguard.workload.models import QLoRAConfig

STAGES: tuple[str, ...] = ("around", "under")
"""Where a technique's context sits on the step, in the order they are entered: ``around`` the tracker (entered
before it: the libraries it patches are in place when the tracker starts, e.g. Liger's kernels), then
``under`` it (entered after: the tracker sees what it allocates and frees, e.g. activation offloading's
saved-tensor hooks). Within a stage, the registry's order."""


def _no_context(model: Any, request: StepRequest) -> contextlib.AbstractContextManager[None]:
    """Nothing on the step: what the technique changes is built with the model or made by the step's data."""
    return contextlib.nullcontext()


def _refuses_nothing(request: StepRequest) -> None:
    """No refusal: the technique prices every request that uses it."""


def _revises_nothing(report: Any, model: Any, request: StepRequest, seen: Any) -> Any:
    """No revision: the assembled report stands as it is."""
    return report


def _no_findings(model: Any, request: StepRequest, seen: Any) -> list[Finding]:
    """No finding: the technique says nothing in the report."""
    return []


def _no_note(model: Any, ledger: Any) -> Finding | None:
    """No note on the measured step."""
    return None


def _bounded_by_nothing(request: StepRequest, model: Any) -> dict[str, StepRequest]:
    """No bounds: the step is priced as it runs."""
    return {}


AMPERE = (8, 0)
"""The compute capability bf16 autocast and FlashAttention-2 need (Ampere)."""


@dataclass(frozen=True)
class Place:
    """Where the step ``--fit`` prices a change of runs: ``target`` (``cuda`` or ``cpu``), the card's compute
    ``capability`` (``--gpu``'s; without one the H100 whose figures the estimate takes, 9.0) and ``trainer``, whose
    step prices the change (``loop``, ``trainer`` or ``sft``)."""

    target: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    trainer: str = "loop"

    @property
    def ampere(self) -> bool:
        """Whether the card runs bf16 and FlashAttention-2: CUDA at compute capability 8.0 or newer."""
        return self.target == "cuda" and self.capability >= AMPERE


def _no_alternative(config: QLoRAConfig, place: Place) -> tuple[str, QLoRAConfig] | None:
    """No cheaper alternative to offer ``--fit``."""
    return None


@dataclass(frozen=True)
class Technique:
    """One technique: ``name`` (the config field or flag people know it by), ``description``, ``stage``
    (:data:`STAGES`), ``applies(config)`` (whether the step uses it), ``refuse(request)`` (a one-line
    UsageError where it cannot be priced, before the build), ``context(model, request)`` (a context manager on
    the step; what it yields is what the technique saw), ``findings(model, request, seen)`` (its lines in the
    report, in the registry's order) and ``cheaper(config, place)`` (the flag and the changed config ``--fit``
    offers when a step does not fit, or None: where the :class:`Place` has it and its trainer prices it),
    ``measured(model, ledger)`` (its note on the measured step in every producer's report, or None) and
    ``bounded_by(request, model)`` (the requests whose steps bound one that cannot be priced as it runs)."""

    name: str
    description: str
    stage: str
    applies: Callable[[QLoRAConfig], bool]
    context: Callable[[Any, StepRequest], contextlib.AbstractContextManager[Any]] = _no_context
    refuse: Callable[[StepRequest], None] = _refuses_nothing
    # revise(report, model, request, seen): the assembled report with what the technique changes in it (a build
    # note it replaces in place, e.g. the routing: line of a forced routing), applied in the registry's order
    revise: Callable[[Any, Any, StepRequest, Any], Any] = _revises_nothing
    # unmodelled: why the analytic model does not price a step that uses it (the report's reason), or "" when it
    # does (vramguard.step.expectation.expectation_of)
    unmodelled: str = ""
    findings: Callable[[Any, StepRequest, Any], list[Finding]] = _no_findings
    cheaper: Callable[[QLoRAConfig, Place], tuple[str, QLoRAConfig] | None] = _no_alternative
    # measured(model, ledger): its note read from the measured step (the model and the ledger), among the step's
    # own findings in every producer's report (the audit's loop, the estimate's, each rank's: measured_notes),
    # where ``findings`` are the estimate's lines from what its context saw; DoRA's
    measured: Callable[[Any, Any], Finding | None] = _no_note
    # bounded_by(request, model): where the request's step cannot be priced as it runs but lies between other
    # requests' steps, those requests by name, each producer running them its own way (the estimate on meta, the
    # audit's loop from meta runs, a trainer's audit by its trainer, each rank); {} where it is priced as it runs.
    # The routing's: eager experts whose routing is not forced, one request per forced routing
    bounded_by: Callable[[StepRequest, Any], dict[str, StepRequest]] = _bounded_by_nothing

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(
                f"technique {self.name}: stage must be one of {', '.join(STAGES)}, got {self.stage!r}"
            )


def contexts_of(techniques: list[Technique], model: Any, request: StepRequest) -> dict[str, Any]:
    """Each technique's context for the step, made (not entered) before any is entered, by name."""
    return {t.name: t.context(model, request) for t in techniques}


def enter_stage(
    stack: contextlib.ExitStack, stage: str, techniques: list[Technique], contexts: dict[str, Any]
) -> dict[str, Any]:
    """Enter, on ``stack``, the context (:func:`contexts_of`) of each of ``techniques`` at ``stage``, in their
    order; what each yielded (what it saw), by name."""
    return {t.name: stack.enter_context(contexts[t.name]) for t in techniques if t.stage == stage}


def enter_all(stack: contextlib.ExitStack, techniques: list[Technique], contexts: dict[str, Any]) -> dict[str, Any]:
    """Enter every stage of ``techniques`` (:func:`enter_stage`, in :data:`STAGES`' order) on ``stack`` at once:
    for a step whose tracker starts inside its own run (a trainer's step, a rank's), so every context is on the
    step before it. What each yielded, by name."""
    seen: dict[str, Any] = {}
    for stage in STAGES:
        seen |= enter_stage(stack, stage, techniques, contexts)
    return seen


def measured_notes(techniques: Sequence[Technique], model: Any, ledger: Any) -> list[Finding | None]:
    """Each of ``techniques``' note on the measured step (``measured``: read from the model and the ledger), in
    their order; None where one has nothing to say."""
    return [t.measured(model, ledger) for t in techniques]


def revised(report: Any, techniques: list[Technique], model: Any, request: StepRequest, seen: dict[str, Any]) -> Any:
    """``report`` revised by each of ``techniques`` in their order, each given what its context yielded."""
    for t in techniques:
        report = t.revise(report, model, request, seen.get(t.name))
    return report


def bounding_requests(techniques: Sequence[Technique], request: StepRequest, model: Any) -> dict[str, StepRequest]:
    """The requests whose steps bound ``request``'s (the first of ``techniques`` whose ``bounded_by`` names any),
    by name; {} where the step is priced as it runs."""
    for t in techniques:
        bounds = t.bounded_by(request, model)
        if bounds:
            return bounds
    return {}
