"""``vramguard audit`` on the command line: its options, the progress bar and the rich report view.

The audit itself (:func:`vramguard.audit.run.run_audit`) renders nothing; this module prints it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from vramguard.atomic import write_text_atomic
from vramguard.audit import run as _audit_run
from vramguard.audit.report import AuditReport
from vramguard.audit.run import check_fits, resolve_device, run_audit
from vramguard.cli.options import add_qlora_options, check_json_path, positive_int, qlora_config
from vramguard.console import stdout_console
from vramguard.errors import UsageError
from vramguard.units import format_bytes
from vramguard.workload.models import QLoRAConfig

# -- presentation ---------------------------------------------------------------------------


def render(report: AuditReport, console: Any) -> None:
    """Print the report as rich tables."""
    from rich.table import Table

    fb = format_bytes
    c = report.config
    arch = report.architecture
    kind = (
        f" ({arch.get('model_type')}, {arch.get('model_class')}, {arch.get('attn_implementation')} attention)"
        if arch
        else ""
    )
    console.print(
        f"[bold]vramguard audit[/] {c['model']}{kind} on {report.device}: batch {c['batch']} x seq {c['seq_len']}, "
        f"LoRA r={c['lora_rank']}, {c['quant_type']}{' +double-quant' if c['double_quant'] else ''}, "
        f"compute {c['compute_dtype']}, checkpointing {'on' if c['gradient_checkpointing'] else 'off'}, "
        f"{len(report.steps)} steps"
    )
    env = report.environment.get("packages", {})
    console.print("[dim]" + ", ".join(f"{k} {v}" for k, v in env.items() if v) + "[/]", highlight=False)

    t = Table(title="Saved for backward, per decoder layer (ledger: hooks + ctx walk)", title_justify="left")
    for col in ("layer", "saved", "activations", "weight copies", "analytic", "top modules"):
        t.add_column(col, justify="left" if col in ("layer", "top modules") else "right")
    for row in report.layers:
        tops = ", ".join(f"{m} {fb(b)}" for m, b in row.top_modules)
        short = row.name[row.name.find("layers.") :] if "layers." in row.name else row.name
        wc = f"[red]{fb(row.weight_copy_bytes)}[/]" if row.weight_copy_bytes else fb(0)
        analytic = "-" if row.analytic_bytes is None else fb(row.analytic_bytes)
        t.add_row(short, fb(row.saved_bytes), fb(row.activation_bytes), wc, analytic, tops)
    console.print(t)

    tot = report.totals
    b = report.budget
    s = Table(title="Totals: measured vs the analytic model", title_justify="left")
    s.add_column("what")
    s.add_column("measured", justify="right")
    s.add_column("analytic", justify="right")
    s.add_column("note")
    probes = f"hooks {fb(tot.hook_bytes)}, ctx attributes {fb(tot.ctx_bytes)}"
    if b.activation_ratio is None or b.analytic_activation_bytes is None:
        s.add_row(
            "saved activations (all)",
            fb(b.measured_activation_bytes),
            "-",
            f"{b.no_analytic_model}; {probes}",
        )
        s.add_row("  outside decoder layers", fb(tot.outside_layers_bytes), "-", "")
    else:
        s.add_row(
            "saved activations (all)",
            fb(b.measured_activation_bytes),
            fb(b.analytic_activation_bytes),
            f"{b.activation_ratio:.1%} ({b.analytic_model}); {probes}",
        )
        s.add_row(
            "  outside decoder layers",
            fb(tot.outside_layers_bytes),
            fb(b.analytic_outside_layers_bytes or 0),
            f"fp32 logits 4*b*s*V = {fb(b.analytic_logits_bytes or 0)}, final norm, loss",
        )
    s.add_row("  weight copies", fb(tot.weight_copy_bytes), fb(0), "dequantized weights kept for backward")
    s.add_row(
        "frozen weights (4-bit + absmax, others)",
        fb(b.measured_weights_bytes),
        fb(b.analytic_weights_bytes),
        f"N={b.quantized_params:,} quantized, {b.other_params:,} unquantized",
    )
    s.add_row(
        "LoRA weights + grads + Adam",
        fb(b.measured_lora_training_bytes),
        fb(b.analytic_lora_training_bytes),
        f"M={b.lora_params:,} params x 16 B (+ Adam step counters)",
    )
    console.print(s)

    p = Table(title="Peak live memory per phase (tracker)", title_justify="left")
    p.add_column("phase")
    p.add_column("peak", justify="right")
    p.add_column("above phase start", justify="right")
    has_reserved = any(v.reserved_peak_bytes is not None for v in report.phases.values())
    if has_reserved:
        p.add_column("reserved peak", justify="right")
    for name, v in report.phases.items():
        cells = [name, fb(v.peak_bytes), fb(v.peak_above_start)]
        if has_reserved:
            cells.append(fb(v.reserved_peak_bytes or 0))
        p.add_row(*cells)
    console.print(p)
    for line in report.step_lines():
        console.print(line, highlight=False)
    for n in report.verdict.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False)
    style = "bold green" if report.verdict.ok else "bold red"
    # the verdict is one greppable line whatever the width (COLUMNS=80 is set under pytest-xdist, and
    # by some CI runners)
    console.print(f"[{style}]{report.verdict.line}[/]", highlight=False, soft_wrap=True)


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
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    check_json_path(args.json)  # fail before the run, not after it
    if args.offload_activations and args.trainer == "loop":
        raise UsageError("--offload-activations needs --trainer trainer or --trainer sft")
    config = qlora_config(
        args,
        device=resolve_device(args.device),
        seed=args.seed,
    )
    config.validate()
    check_fits(config)  # fail on a bad model, or one that cannot fit, before anything is built
    console = stdout_console()
    progress_console = Console(stderr=True)
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=progress_console,
        transient=True,
        # no bar in a log: rich would leave a blank line on stderr
        disable=args.quiet or not progress_console.is_terminal,
    )
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
    if args.quiet:
        console.print(report.verdict.line, highlight=False, soft_wrap=True)
    else:
        render(report, console)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
        if not args.quiet:
            console.print(f"report written to {args.json}", highlight=False)
    return 0 if report.verdict.ok else 1
