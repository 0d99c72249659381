"""The analytic expectation a step's report holds its measurement against, shared by the audit and the estimate."""

from __future__ import annotations

from collections.abc import Sequence

from vramguard.model.analytic import Expectation, qlora_expectation, weights_expectation
from vramguard.step.technique import Technique
from vramguard.workload.families import NoAnalyticModel
from vramguard.workload.models import QLoRAConfig, QLoRAModel, parse_dtype


def expectation_of(
    q: QLoRAModel,
    config: QLoRAConfig,
    target: str,
    analytic: bool = True,
    techniques: Sequence[Technique] = (),
) -> Expectation:
    """The analytic expectation of ``q``'s step for ``config`` with ``target``'s kernels; the weights
    alone (with the reason) where the analytic model has no answer, or with ``analytic`` False.
    ``techniques``: those the step uses (the registry's, :func:`vramguard.estimate.techniques.used_by`); the
    first whose ``unmodelled`` says why the analytic model does not price it gives the reason."""
    try:
        if not analytic:
            raise NoAnalyticModel(f"no analytic model for --method {config.method}")
        if config.mixed_precision != "no":
            raise NoAnalyticModel(
                f"no analytic model for Trainer's {config.mixed_precision} autocast: measured only"
            )
        if q.attn_implementation == "flash_attention_2":
            raise NoAnalyticModel("no analytic model for flash_attention_2: measured only")
        for technique in techniques:
            if technique.unmodelled:
                raise NoAnalyticModel(technique.unmodelled)
        if config.use_liger_kernel:
            raise NoAnalyticModel("no analytic model for Liger's kernels (use_liger_kernel): measured only")
        if config.target_modules != "all-linear" or config.target_parameters:
            raise NoAnalyticModel(
                "no analytic model for LoRA on target modules other than all-linear "
                f"({config.target_modules}{'; parameters ' + config.target_parameters if config.target_parameters else ''})"
            )
        return qlora_expectation(
            q.model,
            q.spec,
            batch=config.batch,
            seq_len=config.seq_len,
            lora_rank=config.lora_rank,
            compute_dtype=parse_dtype(config.compute_dtype),
            double_quant=config.double_quant,
            checkpointing=config.gradient_checkpointing,
            attn_implementation=q.attn_implementation,
            lora_dropout=config.lora_dropout > 0,
            target=target,
        )
    except NoAnalyticModel as exc:  # measured all the same; compared with nothing
        return weights_expectation(q.model, double_quant=config.double_quant, reason=str(exc))
