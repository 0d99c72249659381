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
from pathlib import Path
from typing import Any

import torch

from vramguard.audit import verdict as checks
from vramguard.audit.report import AuditReport, with_routing_note
from vramguard.errors import UsageError
from vramguard.integrations.transformers import VramGuardCallback
from vramguard.workload import routing as routes
from vramguard.workload.models import QLoRAConfig, QLoRAModel, build_qlora
from vramguard.workload.routing import Routing
from vramguard.workload.run_config import TRL_OPTIMIZER_OF
from vramguard.workload.training import optimizer_on

TRAINERS = ("loop", "trainer", "sft")


def _dataset(q: QLoRAModel, micro_batches: int, labels: bool) -> Any:
    """The rows of ``micro_batches`` batches, the loop's own (:meth:`QLoRAModel.batch`), in order."""
    from datasets import Dataset

    rows = torch.cat([q.batch(k)["input_ids"].cpu() for k in range(micro_batches)]).tolist()
    return Dataset.from_dict({"input_ids": rows, **({"labels": rows} if labels else {})})


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", eos_token="t1", unk_token="t0")


def run_trainer_audit(
    config: QLoRAConfig,
    steps: int,
    trainer: str,
    output_dir: str | Path,
    offload_activations: bool = False,
    routing: Routing | None = None,
) -> AuditReport:
    """``steps`` steps of ``trainer`` ("trainer" or "sft") on the audit's model and batches.

    ``offload_activations``: the trainer's own way where it has one (SFTTrainer: ``activation_offloading``,
    TRL's ``OffloadActivations``, which needs an accelerator), else ``save_on_cpu(pin_memory=True)`` around
    ``train()`` (on a machine without CUDA it copies to plain host memory).

    ``routing``: a mixture of experts' routing forced to one of :data:`vramguard.workload.routing.ROUTINGS`
    (None: the routing the router draws). With eager experts on the CPU and the routing drawn, the same
    trainer runs again with each forced routing (a fresh model, the same seed: the same weights and batches),
    and the ``routing:`` line holds the drawn peak between them, as ``vramguard audit``'s loop does with meta
    runs (the trainer's step is not the loop's, so its own runs bound it)."""
    config = config.resolved()
    report, q = _train(config, steps, trainer, output_dir, offload_activations, routing)
    top_k = routes.eager_top_k(q.model)
    del q  # the forced runs build their own models: not two at once
    # a GPU's phase peaks hold the weights (as in the loop: no bounds there yet); a forced run bounds nothing
    if top_k is None or routing is not None or torch.device(config.device).type != "cpu":
        return report
    figures = {}
    for kind in routes.ROUTINGS:  # three more train() runs: the cost of the bounds, said in docs/audit.md
        forced, _ = _train(config, steps, trainer, Path(output_dir) / kind, offload_activations, kind)
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
    config: QLoRAConfig,
    steps: int,
    trainer: str,
    output_dir: str | Path,
    offload_activations: bool,
    routing: Routing | None,
) -> tuple[AuditReport, QLoRAModel]:
    """One audited ``train()``: its report and the model it trained."""
    if trainer not in ("trainer", "sft"):
        raise UsageError(f"--trainer must be one of {', '.join(TRAINERS)}, got {trainer!r}")
    on_cpu = torch.device(config.device).type == "cpu"
    if offload_activations and trainer == "sft" and on_cpu:
        raise UsageError(
            "--offload-activations with --trainer sft is TRL's OffloadActivations, which needs an accelerator; "
            "on CPU use --trainer trainer (torch's save_on_cpu)"
        )
    q = build_qlora(config)
    micro_batches = steps * config.gradient_accumulation_steps  # the rows of every micro-batch of every step
    common: dict[str, Any] = {
        "max_steps": steps,
        "per_device_train_batch_size": config.batch,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "use_cpu": on_cpu,
        "train_sampling_strategy": "sequential",
        "gradient_checkpointing": config.gradient_checkpointing,
        # the config's optimizer as the loop runs it on this device, not Trainer's default (adamw_torch_fused)
        "optim": TRL_OPTIMIZER_OF[optimizer_on(config.optimizer, config.device)],
    }
    if config.gradient_checkpointing:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    cb = VramGuardCallback(table=False)
    if trainer == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(str(output_dir), **common)
        runner = Trainer(model=q.model, args=args, train_dataset=_dataset(q, micro_batches, True), callbacks=[cb])
    else:
        try:
            from trl import SFTConfig, SFTTrainer
        except ImportError:
            raise UsageError("--trainer sft needs TRL: pip install 'vramguard[trl]'") from None
        if offload_activations:  # (only then: SFTConfig has the field from TRL 0.16 on)
            common["activation_offloading"] = True
        args = SFTConfig(str(output_dir), max_length=config.seq_len, **common)
        runner = SFTTrainer(
            model=q.model,
            args=args,
            train_dataset=_dataset(q, micro_batches, False),
            processing_class=_tokenizer(int(q.spec.fields["vocab_size"])),
            callbacks=[cb],
        )
    from transformers.trainer_callback import PrinterCallback

    runner.remove_callback(PrinterCallback)  # the audit prints its own tables (stdout stays the report's)
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=True)
        if offload_activations and trainer == "trainer"
        else contextlib.nullcontext()
    )
    forced: contextlib.AbstractContextManager[Any] = contextlib.nullcontext({})
    if routing is not None:
        forced = routes.forced_routing(q.model, routing, config.batch * config.seq_len)
    with offload, forced as taken, _no_module_overrides_kept():
        runner.train()
    report = cb.report
    assert report is not None
    trainer_config = dict(report.config)
    report.config = {**config.to_dict(), **trainer_config, "trainer": trainer_config["trainer"]}
    report.architecture = {**report.architecture, "attn_implementation": q.attn_implementation}
    # the build's notes (what it changed from the request, which weights are 4-bit, what routing decides), as
    # vramguard audit's own loop reports them: the callback sees the model, not how it was built
    build = checks.notes(checks.BUILD, q.notes)
    report.verdict = dataclasses.replace(report.verdict, findings=[*build, *report.verdict.findings])
    top_k = routes.eager_top_k(q.model)
    if routing is not None and top_k is not None:
        if not taken["forced"]:
            raise UsageError(f"routing forced to {routing}, but train() called no experts module")
        line = routes.forced_line(routing, top_k, taken["counts"])
        report = with_routing_note(report, checks.ROUTING, line)
    return report, q
