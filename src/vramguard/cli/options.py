"""Options shared by the commands that run a QLoRA step (``audit``, ``estimate``): one definition, one
default, one way from the parsed arguments to a :class:`QLoRAConfig`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from vramguard.errors import UsageError
from vramguard.workload.models import QLoRAConfig


def positive_int(text: str) -> int:
    """argparse type of a count (sequence length, batch, rank, steps): a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def add_qlora_options(p: argparse.ArgumentParser, model_help: str) -> None:
    """The model and the QLoRA step: shapes, LoRA, quantization, dtype, checkpointing, attention."""
    d = QLoRAConfig()
    p.add_argument("--model", default=d.model, help=model_help)
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--batch", type=positive_int, default=d.batch)
    p.add_argument("--lora-rank", type=positive_int, default=d.lora_rank)
    p.add_argument("--lora-alpha", type=positive_int, default=d.lora_alpha)
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout)
    p.add_argument("--compute-dtype", default=d.compute_dtype, help="compute dtype: bf16, fp16 or fp32")
    p.add_argument("--dtype", dest="compute_dtype", help=argparse.SUPPRESS)  # the flag's earlier name
    p.add_argument("--quant-type", default=d.quant_type, choices=("nf4", "fp4"))
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=d.double_quant)
    p.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=d.gradient_checkpointing
    )
    p.add_argument("--attn-implementation", default=d.attn_implementation, choices=("sdpa", "eager"))
    p.add_argument(  # the flag's earlier name
        "--attn", dest="attn_implementation", choices=("sdpa", "eager"), help=argparse.SUPPRESS
    )


def qlora_config(args: argparse.Namespace, **rest: object) -> QLoRAConfig:
    """The :class:`QLoRAConfig` of the options :func:`add_qlora_options` added (each flag's destination is
    the field's name; ``rest``: the others)."""
    names = ("model", "seq_len", "batch", "lora_rank", "lora_alpha", "lora_dropout", "compute_dtype")
    names += ("quant_type", "double_quant", "gradient_checkpointing", "attn_implementation")
    return QLoRAConfig(**{name: getattr(args, name) for name in names}, **rest)  # type: ignore[arg-type]


def check_json_path(path: Path | None, flag: str = "--json") -> None:
    """Fail on an output path (``--json`` or ``flag``) that cannot be written, before the run rather than
    after it."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {flag} {path}: {parent or path.parent} is not a writable directory")


def add_timeline_options(p: argparse.ArgumentParser) -> None:
    """``--snapshot`` and ``--html``: the step's allocations as a PyTorch memory snapshot, and as one page."""
    p.add_argument(
        "--snapshot",
        type=Path,
        metavar="PATH",
        help="write every allocation and free of the steps as a PyTorch memory snapshot (a pickle: open it in "
        "pytorch.org/memory_viz or with torch.cuda._memory_viz.trace_plot), with vramguard's categories and "
        "module frames",
    )
    p.add_argument(
        "--html",
        type=Path,
        metavar="PATH",
        help="write one self-contained page: the memory through the steps by category, phases and the peak "
        "marked, saved bytes per layer, the verdict",
    )
    p.add_argument(
        "--timeline-image",
        type=Path,
        metavar="PATH",
        help="write the page's timeline figure alone: PNG for a .png path, SVG otherwise (a README, a PR)",
    )


def check_timeline_paths(args: argparse.Namespace) -> None:
    """Fail on a ``--snapshot``, ``--html`` or ``--timeline-image`` path that cannot be written, before the
    run."""
    check_json_path(args.snapshot, "--snapshot")
    check_json_path(args.html, "--html")
    check_json_path(args.timeline_image, "--timeline-image")


def wants_timeline(args: argparse.Namespace) -> bool:
    """Whether the run must record its allocations (``--snapshot``, ``--html`` or ``--timeline-image``)."""
    return args.snapshot is not None or args.html is not None or args.timeline_image is not None


def write_timeline_outputs(args: argparse.Namespace, report: Any, events: Any) -> list[str]:
    """Write ``--snapshot`` (the events as a snapshot pickle), ``--html`` (the report's page) and
    ``--timeline-image`` (its timeline figure), each atomically; the lines saying what was written. An unwritable path is a :class:`UsageError`."""
    from vramguard.atomic import write_bytes_atomic, write_text_atomic
    from vramguard.measure.events import dump_snapshot

    written = []
    try:
        if args.snapshot is not None:
            write_bytes_atomic(args.snapshot, dump_snapshot(events.snapshot()))
            written.append(f"memory snapshot written to {args.snapshot}")
        if args.html is not None:
            from vramguard.view.timeline import render_run_html

            write_text_atomic(args.html, render_run_html(report))
            written.append(f"page written to {args.html}")
        if args.timeline_image is not None:
            from vramguard.view.timeline import timeline_image

            timeline_image(report, args.timeline_image)
            written.append(f"timeline figure written to {args.timeline_image}")
    except OSError as exc:
        raise UsageError(f"cannot write the timeline: {exc.strerror or exc}") from None
    return written
