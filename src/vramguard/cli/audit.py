"""``vramguard audit`` on the command line: its options, the run, and where it is drawn.

The audit itself (:func:`vramguard.audit.run.run_audit`) renders nothing; :mod:`vramguard.view.report` draws it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

from vramguard.cli.helptext import summary
from vramguard.atomic import write_text_atomic
from vramguard.audit import run as _audit_run
from vramguard.audit.run import check_fits, resolve_device, run_audit
from vramguard.cli.options import (
    add_qlora_options,
    add_sharding_options,
    add_talk_options,
    add_timeline_options,
    add_trainer_option,
    check_json_path,
    check_timeline_paths,
    fsdp_settings,
    lint_lines,
    positive_int,
    print_not_priced,
    qlora_config,
    resolve_trainer,
    sharding_config,
    wants_timeline,
    with_config_notes,
    write_timeline_outputs,
)
from vramguard.errors import UsageError
from vramguard.measure.events import AllocationLog
from vramguard.step.request import StepRequest
from vramguard.view.console import progress_bar, stdout_console
from vramguard.view.report import render, verdict_only
from vramguard.workload.models import QLoRAConfig, may_wrap_parameters


def register(subparsers: Any) -> None:
    """Add the ``audit`` subcommand: the QLoRA step's options, steps, device, seed and the output switches."""
    p = subparsers.add_parser(
        "audit",
        help="train a small QLoRA model a few steps and account for its memory",
        description=summary(_audit_run.__doc__),
    )
    add_qlora_options(
        p,
        model_help="preset name, a vramguard preset JSON, a Hugging Face config.json or model directory, or a Hub "
        "id (org/name[@revision]: its config.json only)",
    )
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (>= 2 to check for leaks)")
    add_trainer_option(p, "run", "loop")
    p.add_argument(
        "--offload-activations",
        action="store_const",
        const=True,
        help="with --trainer: offload what autograd saves to the host (trainer: torch's save_on_cpu with "
        "pinned buffers around train(); sft: SFTConfig(activation_offloading=True), TRL's OffloadActivations, "
        "which needs an accelerator) and report the host copies per step",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_sharding_options(p)
    p.add_argument("--seed", type=int, default=QLoRAConfig().seed)
    p.add_argument("--top", type=positive_int, default=3, help="modules listed per layer")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable report here")
    add_timeline_options(p)
    add_talk_options(p, "print only the verdict line")
    p.set_defaults(func=handle)


def _forced_routing_figures(bounds: dict[str, StepRequest]) -> dict[str, tuple[int, int]]:
    """Eager experts' forced routings (the routing technique's requests), estimated on meta (imported only for
    such a model)."""
    from vramguard.estimate.run import forced_routing_figures

    return forced_routing_figures(bounds)


def handle(args: argparse.Namespace) -> int:
    """Run the audit the options describe, render it with rich (progress on a terminal), write ``--json``;
    exit 1 on a failed verdict."""
    check_json_path(args.json)  # fail before the run, not after it
    check_timeline_paths(args)
    if args.offload_activations and args.trainer in ("loop", None):
        raise UsageError("--offload-activations needs --trainer trainer or --trainer sft")
    sharding = sharding_config(args)
    settings = fsdp_settings(args, sharding)
    device = "cpu" if sharding is not None and args.device == "auto" else resolve_device(args.device)
    config, lines = qlora_config(args, device=device, seed=args.seed)
    args.trainer, recipe = resolve_trainer(args, config)
    if config.method != "qlora":
        raise UsageError(
            f"the audit measures a QLoRA step, but {args.config} gives method {config.method} (QLoRA is "
            "use_peft and load_in_4bit true); vramguard estimate prices the others"
        )
    if config.offload_activations and args.trainer == "loop":
        lines.append(
            f"config {args.config.name}: NOT PRICED: activation_offloading=true: vramguard's loop does not "
            "offload (TRL's offloading runs with --trainer sft on an accelerator); measured without it"
        )
        config = dataclasses.replace(config, offload_activations=False)
    if config.use_liger_kernel and (config.device.split(":")[0] != "cuda" or args.trainer != "loop"):
        lines.append(
            f"config {args.config.name}: NOT PRICED: use_liger_kernel=true: Liger's Triton kernels run in the audit's "
            "loop on CUDA only (--device cuda, no --trainer); measured without them (the fp32 logits stay in); "
            "vramguard estimate prices it on meta"
        )
        config = dataclasses.replace(config, use_liger_kernel=False)
    events = AllocationLog() if wants_timeline(args) else None
    if events is not None and args.trainer != "loop":
        raise UsageError(
            "--snapshot and --html record the storage tracker's allocations in vramguard's loop (--trainer loop), "
            f"not --trainer {args.trainer}"
        )
    check_fits(config)  # fail on a bad model, or one that cannot fit, before anything is built
    console = stdout_console()
    if sharding is not None:
        if args.trainer != "loop":
            raise UsageError("--world-size runs vramguard's loop on every rank: leave out --trainer")
        from vramguard.audit.distributed import run_distributed_audit

        if events is not None:
            raise UsageError("--snapshot and --html record one process's allocations: leave out --world-size")
        build_first = None
        if sharding.sharding != "zero3" and may_wrap_parameters(config):
            # what each rank's build would refuse (LoRA on parameters), said before one loads the model;
            # ZeRO-3's ranks build inside DeepSpeed's engine
            from vramguard.estimate.distributed import sharded_build

            build_first = functools.partial(sharded_build, config, sharding)
        report = run_distributed_audit(config, sharding, top=args.top, before_ranks=build_first, steps=args.steps)
        report.config["recipe"] = recipe
        report = with_config_notes(report, lines)
        report = lint_lines(report, config, sharding, settings)
        return _show(report, args, console, "distributed-audit", lines + _lint_of(report))
    progress = progress_bar(args.quiet)
    with progress:
        task = progress.add_task("audit", total=args.steps + 1)

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        request = StepRequest.on_device(config, steps=args.steps)
        if args.trainer == "loop":
            report = run_audit(
                request,
                progress=update,
                top=args.top,
                events=events,
                routing_figures=_forced_routing_figures,
            )
        else:
            from vramguard.estimate.techniques import used_by
            from vramguard.integrations.trainer_audit import run_trainer_audit

            with tempfile.TemporaryDirectory(prefix="vramguard-trainer-") as tmp:
                report = run_trainer_audit(request, args.trainer, tmp, used_by(request.config))
    report.config["recipe"] = recipe
    report = with_config_notes(report, lines)
    return _show(report, args, console, "audit", lines, events)


def _lint_of(report: Any) -> list[str]:
    """The lint's lines among ``report``'s notes (for ``--quiet``, which prints them on stderr)."""
    return [n for n in report.verdict.notes if n.startswith("lint: ")]


def _show(
    report: Any, args: argparse.Namespace, console: Any, layout: str, lines: list[str], events: Any = None
) -> int:
    """Print ``report`` (the verdict line alone with ``--quiet``, plus what is not priced), write ``--json``
    and the timeline outputs; the exit code."""
    if args.quiet:
        verdict_only(report, console)
        print_not_priced(lines)
    else:
        render(report, console, layout)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
        if not args.quiet:
            console.print(f"report written to {args.json}", highlight=False, soft_wrap=True)
    if events is not None:
        for line in write_timeline_outputs(args, report, events):
            if not args.quiet:
                console.print(line, highlight=False, soft_wrap=True)
    return 0 if report.verdict.ok else 1
