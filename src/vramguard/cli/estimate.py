"""The ``vramguard estimate`` subcommand: arguments, rendering, ``--json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vramguard.atomic import write_text_atomic
from vramguard.audit.report import AuditReport
from vramguard.cli.options import add_qlora_options, check_json_path, positive_int, qlora_config
from vramguard.errors import UsageError
from vramguard.units import format_bytes, parse_size
from vramguard.workload.models import QLoRAConfig

DESCRIPTION = (
    "Will it fit? The memory of one QLoRA training step (4-bit base, LoRA, AdamW) at full size, "
    "from a run of transformers, bitsandbytes and PEFT on the meta device: no GPU, no weights."
)


def register(subparsers: Any) -> None:
    """Add the ``estimate`` subcommand: the QLoRA step's options, method, optimizer, offloading, ``--fit``,
    the target device and the output switches."""
    p = subparsers.add_parser(
        "estimate", help="estimate a QLoRA step's memory at full size (meta device)", description=DESCRIPTION
    )
    add_qlora_options(
        p,
        model_help="preset name (e.g. llama-3.1-8b), a vramguard preset JSON, or a Hugging Face config.json",
    )
    p.add_argument(
        "--method",
        default="qlora",
        choices=("qlora", "lora", "full"),
        help="qlora: 4-bit base + LoRA; lora: LoRA on a base in --dtype; full: all parameters, fp32 + "
        "AdamW (default: qlora)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "adamw-8bit", "paged-adamw-8bit"),
        help="adamw: torch AdamW (fp32 moments); adamw-8bit: bitsandbytes AdamW8bit; paged-adamw-8bit: "
        "bitsandbytes PagedAdamW8bit, estimated as AdamW8bit with its paged (evictable) state named "
        "(default: adamw)",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep what autograd saves for backward on the host (torch.autograd.graph.save_on_cpu), "
        "emulated on meta: the device holds only the copies backward takes back",
    )
    p.add_argument(
        "--fit",
        metavar="SIZE",
        help="device memory, e.g. 24GiB: find the largest batch (or --fit-dim "
        "seq) that fits, and for a shape that does not fit, the changes that would make it",
    )
    p.add_argument("--fit-dim", default="batch", choices=("batch", "seq"))
    p.add_argument(
        "--target",
        default="cuda",
        choices=("cuda", "cpu"),
        help="the device whose kernels the step will run (attention, dropout): cuda (default) or cpu",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=2,
        help="meta steps (the second has the optimizer state of the first: the steady state)",
    )
    p.add_argument("--top", type=positive_int, default=3, help="modules listed per layer")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report (the audit's schema) here")
    p.add_argument("--quiet", action="store_true", help="print only the estimate line")
    p.set_defaults(func=main)


def render(report: AuditReport, console: Any) -> None:
    """Print the estimate as rich tables: saved bytes per decoder layer, the components, the peak per phase
    and the device total with the overheads the meta run leaves out; then the notes and the verdict line."""
    from rich.table import Table

    fb = format_bytes
    c = report.config
    arch = report.architecture
    e = report.estimate
    assert e is not None
    console.print(
        f"[bold]vramguard estimate[/] {c['model']} ({arch.get('model_type')}, {arch.get('model_class')}, "
        f"{arch.get('attn_implementation')} attention) on {report.device}: batch {c['batch']} x seq {c['seq_len']}, "
        + _method(c)
        + ", "
        f"compute {c['compute_dtype']}, checkpointing {'on' if c['gradient_checkpointing'] else 'off'}, "
        f"optimizer {c.get('extra', {}).get('optimizer', 'adamw')}, "
        + ("activations offloaded to the host, " if c.get("extra", {}).get("offload_activations") else "")
        + f"{len(report.steps)} steps in {report.elapsed_s:.1f} s",
        highlight=False,
    )
    t = Table(title="Saved for backward, per decoder layer (ledger on meta)", title_justify="left")
    for col in ("layer", "saved", "weight copies", "analytic", "top modules"):
        t.add_column(col, justify="left" if col in ("layer", "top modules") else "right")
    for row in report.layers:
        short = row.name[row.name.find("layers.") :] if "layers." in row.name else row.name
        analytic = "-" if row.analytic_bytes is None else fb(row.analytic_bytes)
        tops = ", ".join(f"{m} {fb(b)}" for m, b in row.top_modules)
        t.add_row(short, fb(row.saved_bytes), fb(row.weight_copy_bytes), analytic, tops)
    console.print(t)
    b, tot = report.budget, report.totals
    s = Table(title="Components", title_justify="left")
    s.add_column("what")
    s.add_column("bytes", justify="right")
    s.add_column("note")
    s.add_row(
        "saved activations (all)",
        fb(tot.saved_bytes),
        f"{fb(tot.outside_layers_bytes)} outside decoder layers (logits, final norm, loss)",
    )
    s.add_row(
        "frozen weights (4-bit + absmax, others)",
        fb(e.weights_bytes),
        f"N={b.quantized_params:,} quantized, {b.other_params:,} unquantized",
    )
    s.add_row(
        "trainable weights + grads + AdamW",
        fb(b.measured_lora_training_bytes),
        f"M={b.lora_params:,} trainable; textbook 16 B x M = {fb(16 * b.lora_params)}",
    )
    console.print(s)
    p = Table(
        title="Peak per phase (tracker on meta; above the weights and LoRA parameters)", title_justify="left"
    )
    p.add_column("phase")
    p.add_column("peak", justify="right")
    p.add_column("above phase start", justify="right")
    for name, v in report.phases.items():
        p.add_row(name, fb(v.peak_bytes), fb(v.peak_above_start))
    console.print(p)
    o = Table(
        title="On the device: the allocator peak, then what the meta run leaves out (figures measured on an H100)",
        title_justify="left",
    )
    o.add_column("what")
    o.add_column("bytes", justify="right")
    o.add_column("basis")
    o.add_row(
        "allocator peak (max_memory_allocated)",
        fb(e.allocator_peak_bytes),
        f"weights {fb(e.weights_bytes)} + trainable params {fb(e.trainable_bytes)} + {e.peak_phase} peak "
        f"{fb(e.step_peak_bytes)}",
    )
    for x in e.overheads:
        o.add_row(f"  + {x.name}", fb(x.bytes), x.basis)
    o.add_row("total", fb(e.total_bytes), "")
    console.print(o)
    for n in report.verdict.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False)
    style = "bold green" if report.verdict.ok else "bold red"
    console.print(f"[{style}]{report.verdict.line}[/]", highlight=False, soft_wrap=True)


def _method(c: dict[str, Any]) -> str:
    method = c.get("extra", {}).get("method", "qlora")
    if method == "full":
        return "full fine-tuning (fp32 weights + AdamW)"
    lora = f"LoRA r={c['lora_rank']}"
    if method == "lora":
        return f"{lora} on a {c['compute_dtype']} base"
    return f"{lora}, {c['quant_type']}{' +double-quant' if c['double_quant'] else ''}"


def main(args: argparse.Namespace) -> int:
    """Run the estimate the options describe on meta, print it (only the verdict line with ``--quiet``),
    search ``--fit`` and write ``--json``; exit 1 when the verdict fails or the total exceeds ``--fit``."""
    from vramguard.console import stdout_console
    from vramguard.estimate.run import run_estimate

    check_json_path(args.json)  # fail before the run, not after it
    config = qlora_config(
        args,
        device="cpu",  # validated as a real device; the run is on meta
    )
    size = parse_size(args.fit) if args.fit is not None else None
    if size is not None and size <= 0:
        raise UsageError(f"--fit must be a positive size, got {args.fit!r}")
    report = run_estimate(
        config,
        steps=args.steps,
        top=args.top,
        method=args.method,
        optimizer=args.optimizer,
        target=args.target,
        offload_activations=args.offload_activations,
    )
    console = stdout_console()
    if args.quiet:
        console.print(report.verdict.line, highlight=False, soft_wrap=True)
    else:
        render(report, console)
    fits = True
    if size is not None:
        fit = _fit(config, size, args, report)
        assert report.estimate is not None
        report.estimate.fit = fit
        fits = report.estimate.total_bytes <= size
        _render_fit(fit, config, args.fit_dim, console)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
    return 0 if report.verdict.ok and fits else 1


def _fit(config: QLoRAConfig, size: int, args: argparse.Namespace, report: AuditReport) -> dict[str, Any]:
    from vramguard.estimate.fit import FIT_LIMIT, cheaper_changes, search
    from vramguard.estimate.run import max_positions, run_estimate
    from vramguard.workload.models import ModelSpec

    def estimate(c: QLoRAConfig) -> AuditReport:  # cheaper_changes puts optimizer / offloading in extra
        return run_estimate(
            c,
            steps=args.steps,
            top=1,
            method=args.method,
            optimizer=c.extra.get("optimizer", args.optimizer),
            target=args.target,
            offload_activations=c.extra.get("offload_activations", args.offload_activations),
        )

    limit = FIT_LIMIT
    if args.fit_dim == "seq":
        positions = max_positions(ModelSpec.load(config.model))
        limit = min(limit, positions) if positions is not None else limit
    assert report.estimate is not None
    requested = config.batch if args.fit_dim == "batch" else config.seq_len
    result = search(
        config, size, estimate, dim=args.fit_dim, limit=limit, known={requested: report.estimate.total_bytes}
    )
    if report.estimate.total_bytes > size:
        result.changes = cheaper_changes(
            config, size, estimate, optimizer=args.optimizer, offload_activations=args.offload_activations
        )
    return result.to_dict()


def _render_fit(fit: dict[str, Any], config: QLoRAConfig, dim: str, console: Any) -> None:
    fb = format_bytes
    what = "batch" if dim == "batch" else "sequence length"
    fixed = f"at seq {config.seq_len}" if dim == "batch" else f"at batch {config.batch}"
    if fit["largest"]:
        line = f"fit: the largest {what} that fits in {fb(fit['size_bytes'])} {fixed} is {fit['largest']}"
    else:
        line = f"fit: not even {what} 1 fits in {fb(fit['size_bytes'])} {fixed}"
    console.print(
        f"{line} ({fit['run_count']} meta runs besides the requested shape's; at most {fit['bound']})",
        highlight=False,
        soft_wrap=True,
    )
    for row in fit["changes"]:
        verdict = "fits" if row["fits"] else "does not fit"
        console.print(
            f"  {row['change']}: {fb(row['total_bytes'])} ({verdict})", highlight=False, soft_wrap=True
        )
