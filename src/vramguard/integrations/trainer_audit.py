"""``vramguard audit --trainer trainer|sft``: the audit through the real ``Trainer`` / TRL ``SFTTrainer``.

The model is the audit's (random weights, 4-bit, LoRA), the batches are the audit loop's (``q.batch(k)``
for step ``k``, served in order from an in-memory dataset), the tokenizer SFTTrainer requires is built
offline (a word-level vocabulary over the model's token ids). The optimizer is the config's (``optim``:
torch's AdamW by default without ``--config``, not Trainer's default fused one; a ``trl sft`` file without
``optim`` gets TRL's default, fused). Everything else is the trainer's own defaults (its scheduler, gradient
clipping, and for SFTTrainer its fused chunked loss), so the numbers are the ones a user sees in that trainer;
:class:`VramGuardCallback` measures them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.integrations.trainer_step import (
    TRAINERS,
    fails_as_the_users_run,
    make_trainer,
    trainer_arguments,
    trainer_prepares,
)
from vramguard.integrations.transformers import VramGuardCallback
from vramguard.step import verdict as checks
from vramguard.step.report import AuditReport, with_routing_note
from vramguard.step.request import StepRequest, audit_request
from vramguard.step.technique import Technique, bounding_requests, contexts_of, enter_stage, revised
from vramguard.workload import routing as routes
from vramguard.workload.models import QLoRAConfig, QLoRAModel, build_qlora
from vramguard.workload.vision_sft import trainer_refusal, with_tower_note


def run_trainer_audit(
    request: StepRequest | QLoRAConfig,
    trainer: str,
    output_dir: str | Path,
    techniques: Sequence[Technique] = (),
    **options: Any,
) -> AuditReport:
    """The request's ``steps`` steps of ``trainer`` ("trainer" or "sft") on the audit's model and batches, on
    its config's device. A config with ``options`` (the request's fields: ``steps``, 3 unless given,
    ``routing``, ``offload_activations``) is made into the request first (:meth:`StepRequest.on_device`).

    The config's ``offload_activations``: the trainer's own way where it has one (SFTTrainer:
    ``activation_offloading``, TRL's ``OffloadActivations``, which needs an accelerator), else
    ``save_on_cpu(pin_memory=True)`` around ``train()`` (on a machine without CUDA it copies to plain host
    memory).

    The request's ``routing``: a mixture of experts' routing forced to one of
    :data:`vramguard.workload.routing.ROUTINGS` (None: the routing the router draws). With eager experts on the
    CPU and the routing drawn, the same trainer runs again with each forced routing (a fresh model, the same
    seed: the same weights and batches), and the ``routing:`` line holds the drawn peak between them, as
    ``vramguard audit``'s loop does with meta runs (the trainer's step is not the loop's, so its own runs bound
    it).

    ``techniques``: the registry's techniques the request uses (``vramguard.estimate.techniques.used_by``, given by
    the caller: the estimate's techniques import this package), of which a trainer's audit enters the routing's
    (its trainer runs the others its own way): its forced routing and, for eager experts, the requests that bound
    the drawn one (``bounded_by``). Without them no routing is forced or bounded."""
    request = audit_request(request, options, steps=3)
    config = request.config
    routed = [t for t in techniques if t.name == ROUTING]
    if request.routing is not None and not routed:
        raise ValueError("a forced routing is the routing technique's: pass techniques=used_by(config)")
    report, q = _train(request, trainer, output_dir, routed)
    if not routed and routes.eager_top_k(q.model) is not None:
        raise ValueError("eager experts are bounded by the routing technique's runs: pass techniques=used_by(config)")
    bounds = bounding_requests(routed, request, q)  # eager experts, the routing drawn: each forced routing's
    top_k = routes.eager_top_k(q.model)
    del q  # the forced runs build their own models: not two at once
    # a GPU's phase peaks hold the weights (as in the loop: no bounds there yet)
    if not bounds or torch.device(config.device).type != "cpu":
        return report
    figures = {}
    for kind, forced_request in bounds.items():  # three more train() runs: the bounds' cost, said in docs/audit.md
        forced, _ = _train(forced_request, trainer, Path(output_dir) / kind, routed)
        figures[kind] = routes.figures(forced)
    measured = routes.figures(report)
    line = routes.bounds_line(
        "eager", top_k, figures, measured, forced_by=f"a run of this {trainer} on the CPU"
    )
    return with_routing_note(report, checks.ROUTING, line, measured[0])


@contextlib.contextmanager
def _no_module_overrides_kept() -> Any:
    """Trainer, building a bitsandbytes 8-bit optimizer, registers every ``nn.Embedding`` with bitsandbytes'
    process-wide ``GlobalOptimManager`` (an fp32 state override), which then keeps those modules alive: the
    run's model would outlive it (two at once in the routing re-runs; on a GPU, bytes in every later reading
    of the process). The registrations this ``train()`` added are dropped when it ends."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:
        yield
        return
    kept = GlobalOptimManager.get_instance().module_weight_config_triple
    before = len(kept)
    try:
        yield
    finally:
        del kept[before:]


def _train(
    request: StepRequest, trainer: str, output_dir: str | Path, routed: list[Technique]
) -> tuple[AuditReport, QLoRAModel]:
    """One audited ``train()`` of ``request``, under ``routed``'s context (the routing technique, or nothing):
    its report and the model it trained."""
    config, steps, routing = request.config, request.steps, request.routing
    offload_activations = bool(config.offload_activations)
    if trainer not in ("trainer", "sft"):
        raise UsageError(f"--trainer must be one of {', '.join(TRAINERS)}, got {trainer!r}")
    on_cpu = torch.device(config.device).type == "cpu"
    if offload_activations and trainer == "sft" and on_cpu:
        raise UsageError(
            "--offload-activations with --trainer sft is TRL's OffloadActivations, which needs an accelerator; "
            "on CPU use --trainer trainer (torch's save_on_cpu)"
        )
    not_yet = trainer_refusal(config, trainer)
    if not_yet is not None:
        raise UsageError(f"--trainer {trainer} does not run {not_yet} yet: measure it with --trainer loop")
    q = build_qlora(config, prepared=not trainer_prepares(trainer))
    micro_batches = steps * config.gradient_accumulation_steps  # the rows of every micro-batch of every step
    args = trainer_arguments(config, steps, trainer, output_dir, on_cpu, offload_activations)
    cb = VramGuardCallback(table=False)
    runner = make_trainer(q, trainer, args, micro_batches, [cb])
    q.model = runner.model  # SFTTrainer's own PEFT model, where it wrapped the loaded one
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=True)
        if offload_activations and trainer == "trainer"
        else contextlib.nullcontext()
    )
    contexts = contexts_of(routed, q, request)  # a forced routing, entered as the loop's audit enters it
    with offload, contextlib.ExitStack() as stack:
        seen = enter_stage(stack, "around", routed, contexts)
        with _no_module_overrides_kept(), fails_as_the_users_run(q, trainer):
            runner.train()
    report = cb.report
    assert report is not None
    q = with_tower_note(q)  # a vision-language model's, read off the trainer's own LoRA
    trainer_config = dict(report.config)
    report.config = {**config.to_dict(), **trainer_config, "model": config.model_ref}  # as given, as the loop
    report.architecture = {**report.architecture, "attn_implementation": q.attn_implementation}
    # the build's notes (what it changed from the request, which weights are 4-bit, what routing decides), as
    # vramguard audit's own loop reports them: the callback sees the model, not how it was built
    build = checks.notes(checks.BUILD, q.notes)
    report.verdict = dataclasses.replace(report.verdict, findings=[*build, *report.verdict.findings])
    taken = seen.get(ROUTING, {})
    if routing is not None and routes.eager_top_k(q.model) is not None and not taken["forced"]:
        raise UsageError(f"routing forced to {routing}, but train() called no experts module")
    return revised(report, routed, q, request, seen), q  # a forced routing's routing: line


ROUTING = "routing"
"""The routing technique's name (:mod:`vramguard.estimate.techniques.routing`)."""
