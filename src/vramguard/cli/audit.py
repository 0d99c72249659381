"""``vramguard audit`` on the command line: its options, the run, and where it is drawn.

The audit itself (:func:`vramguard.audit.run.run_audit`) renders nothing; :mod:`vramguard.view.report` draws it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from vramguard.atomic import write_text_atomic
from vramguard.audit import run as _audit_run
from vramguard.audit.run import check_fits, resolve_device, run_audit
from vramguard.cli.options import (
    add_qlora_options,
    add_sharding_options,
    check_json_path,
    positive_int,
    qlora_config,
    sharding_config,
)
from vramguard.errors import UsageError
from vramguard.view.console import progress_bar, stdout_console
from vramguard.view.report import render, verdict_only
from vramguard.workload.models import QLoRAConfig


def register(subparsers: Any) -> None:
    """Add the ``audit`` subcommand: the QLoRA step's options, steps, device, seed and the output switches."""
    p = subparsers.add_parser(
        "audit",
        help="train a small QLoRA model a few steps and account for its memory",
        description=_audit_run.__doc__.splitlines()[0],
    )
    add_qlora_options(
        p, model_help="preset name, a vramguard preset JSON, or a Hugging Face config.json (any model_type)"
    )
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (>= 2 to check for leaks)")
    p.add_argument(
        "--trainer",
        default="loop",
        choices=("loop", "trainer", "sft"),
        help="run the steps in vramguard's loop, transformers' Trainer or TRL's SFTTrainer",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="with --trainer: offload what autograd saves to the host (trainer: torch's save_on_cpu with "
        "pinned buffers around train(); sft: SFTConfig(activation_offloading=True), TRL's OffloadActivations, "
        "which needs an accelerator) and report the host copies per step",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    add_sharding_options(p)
    p.add_argument("--seed", type=int, default=QLoRAConfig().seed)
    p.add_argument("--top", type=positive_int, default=3, help="modules listed per layer")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable report here")
    talk = p.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true", help="print only the verdict line")
    talk.add_argument(
        "--verbose", action="store_true", help="also show the library log lines vramguard hides (stderr)"
    )
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    """Run the audit the options describe, render it with rich (progress on a terminal), write ``--json``;
    exit 1 on a failed verdict."""
    check_json_path(args.json)  # fail before the run, not after it
    if args.offload_activations and args.trainer == "loop":
        raise UsageError("--offload-activations needs --trainer trainer or --trainer sft")
    sharding = sharding_config(args)
    config = qlora_config(
        args,
        device="cpu" if sharding is not None and args.device == "auto" else resolve_device(args.device),
        seed=args.seed,
    )
    config.validate()
    check_fits(config)  # fail on a bad model, or one that cannot fit, before anything is built
    console = stdout_console()
    if sharding is not None:
        if args.trainer != "loop":
            raise UsageError("--world-size runs vramguard's loop on every rank: leave out --trainer")
        from vramguard.audit.distributed import run_distributed_audit

        report = run_distributed_audit(config, sharding, steps=args.steps, top=args.top)
        return _show(report, args, console, "distributed-audit")
    progress = progress_bar(args.quiet)
    with progress:
        task = progress.add_task("audit", total=args.steps + 1)

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        if args.trainer == "loop":
            report = run_audit(config, steps=args.steps, progress=update, top=args.top)
        else:
            from vramguard.integrations.trainer_audit import run_trainer_audit

            with tempfile.TemporaryDirectory(prefix="vramguard-trainer-") as tmp:
                report = run_trainer_audit(
                    config, args.steps, args.trainer, tmp, offload_activations=args.offload_activations
                )
    return _show(report, args, console, "audit")


def _show(report: Any, args: argparse.Namespace, console: Any, layout: str) -> int:
    """Print ``report`` (the verdict line alone with ``--quiet``), write ``--json``; the exit code."""
    if args.quiet:
        verdict_only(report, console)
    else:
        render(report, console, layout)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
        if not args.quiet:
            console.print(f"report written to {args.json}", highlight=False)
    return 0 if report.verdict.ok else 1
