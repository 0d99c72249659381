"""Options shared by the commands that run a QLoRA step (``audit``, ``estimate``): one definition, one
default, one way from the parsed arguments to a :class:`QLoRAConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from vramguard.errors import UsageError
from vramguard.step import verdict as checks
from vramguard.step.report import AuditReport
from vramguard.units import MAX_COUNT
from vramguard.workload.models import ATTN_IMPLEMENTATIONS, ModelSpec, QLoRAConfig
from vramguard.workload.sharding import SHARDINGS, ShardingConfig
from vramguard.workload.vision import TOWER_FIELDS


def positive_int(text: str) -> int:
    """argparse type of a count (sequence length, batch, rank, steps): a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT:,}: {text[:40]!r}")
    return value


STEP_FLAGS: tuple[str, ...] = (
    "model",
    "seq_len",
    "batch",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "compute_dtype",
    "quant_type",
    "double_quant",
    "gradient_checkpointing",
    "attn_implementation",
    "target_modules",
    "target_parameters",
    "use_dora",
    "mixed_precision",
    "method",
    "optimizer",
    "offload_activations",
    "full_dtype",
    "use_liger_kernel",
    "gradient_accumulation_steps",
    "image_size",
    "images_per_row",
    *TOWER_FIELDS,
    "padding_free",
    "packing",
)
"""The :class:`QLoRAConfig` fields a flag may set (each flag's destination is the field's name). A flag
not given is ``None`` in the parsed arguments, so a ``--config`` file decides it; without a file, the
field's default does."""


def add_qlora_options(p: argparse.ArgumentParser, model_help: str) -> None:
    """The model and the QLoRA step: the user's training config, shapes, LoRA, quantization, dtype,
    checkpointing, attention, autocast. Every flag overrides the ``--config`` file. The defaults shown are
    vramguard's loop's; under ``--trainer sft`` (``estimate``'s default) a flag not given takes ``trl sft``'s
    (:func:`trl_defaults`)."""
    d = QLoRAConfig()
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the run's own training config: a `trl sft --config` YAML (TRL's SFTConfig + ModelConfig keys, "
        "TRL's defaults) or a TrainingArguments JSON; flags override it, and every key it sets that is not "
        "priced is named",
    )
    p.add_argument("--model", help=f"{model_help} (default: {d.model})")
    p.add_argument(
        "--seq-len", "--max-length", type=positive_int, help=f"(TRL's spelling: --max-length) loop's default: {d.seq_len}"
    )
    p.add_argument(
        "--image-size",
        metavar="HxW",
        help="a vision-language model's images, height x width in pixels, each resized and tokenized by its "
        "family's own processor (--seq-len counts the image tokens too); default: text-only rows",
    )
    p.add_argument(
        "--images-per-row", type=positive_int, metavar="N", help="with --image-size: images in each row (default: 1)"
    )
    add_tower_options(p)
    p.add_argument(
        "--batch",
        "--per-device-train-batch-size",
        type=positive_int,
        help=f"(TRL's spelling: --per-device-train-batch-size) loop's default: {d.batch}",
    )
    p.add_argument(
        "--gradient-accumulation-steps",
        type=positive_int,
        metavar="N",
        help="Trainer's gradient accumulation: N forward/backward micro-batches of --batch rows a step, the "
        f"gradients held between them, then one optimizer step (loop's default: {d.gradient_accumulation_steps})",
    )
    p.add_argument(
        "--lora-rank", "--lora-r", type=positive_int, help=f"(TRL's spelling: --lora-r) loop's default: {d.lora_rank}"
    )
    p.add_argument("--lora-alpha", type=positive_int, help=f"loop's default: {d.lora_alpha}")
    p.add_argument("--lora-dropout", type=float, help=f"loop's default: {d.lora_dropout}")
    p.add_argument("--compute-dtype", help=f"compute dtype: bf16, fp16 or fp32 (loop's default: {d.compute_dtype})")
    p.add_argument("--dtype", dest="compute_dtype", help=argparse.SUPPRESS)  # the flag's earlier name
    p.add_argument("--quant-type", choices=("nf4", "fp4"), help=f"loop's default: {d.quant_type}")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, help="loop's default: on")
    p.add_argument(
        "--gradient-checkpointing",
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="(transformers 5.24's name: --activation-checkpointing) loop's default: off",
    )
    p.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        help=f"loop's default: {d.attn_implementation}; flash_attention_2: estimate --device cuda only, priced from "
        "flash-attn 2's rules (the package is CUDA-only)",
    )
    p.add_argument(  # the flag's earlier name
        "--attn", dest="attn_implementation", choices=ATTN_IMPLEMENTATIONS, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--target-modules",
        metavar="NAMES",
        help="PEFT's target_modules: all-linear (default), peft-default (PEFT's choice for the architecture, "
        "TRL's default), comma-separated module names, e.g. q_proj,v_proj, or a regular expression PEFT "
        "full-matches against qualified names, e.g. '.*language_model.*\\.(q_proj|v_proj)'",
    )
    p.add_argument(
        "--target-parameters",
        metavar="NAMES",
        help="PEFT's target_parameters: comma-separated parameter names, e.g. the fused experts of a "
        "mixture of experts (mlp.experts.gate_up_proj,mlp.experts.down_proj); default: none",
    )
    p.add_argument(
        "--use-dora",
        action=argparse.BooleanOptionalAction,
        help="PEFT's DoRA (LoraConfig(use_dora=True)): a magnitude vector per adapted layer, the 4-bit weight "
        "dequantized each forward for the weight norm (kept for backward with --lora-dropout); loop's default: off",
    )
    autocast = p.add_mutually_exclusive_group()
    for name in ("bf16", "fp16"):
        autocast.add_argument(
            f"--{name}",
            dest="mixed_precision",
            action="store_const",
            const=name,
            help=f"Trainer's {name} autocast (TrainingArguments.{name}): the forward and loss under "
            f"torch.autocast({name}), as accelerate runs them",
        )
    autocast.add_argument(
        "--no-bf16",
        dest="mixed_precision",
        action="store_const",
        const="no",
        help="no autocast (TRL's bf16: false): what trl sft's defaults (bf16) would otherwise take",
    )


def add_tower_options(p: argparse.ArgumentParser) -> None:
    """A vision-language model's tower choices and Qwen's processor bounds (:class:`vramguard.workload.vision.
    TowerChoices`); each priced, and named in the notes."""
    from vramguard.workload.vision import LORA_SCOPES, TOWER_DTYPES

    p.add_argument(
        "--vision-tower",
        choices=TOWER_DTYPES,
        help="a vision-language model's tower: 4bit (default: load_in_4bit quantizes its linear layers too) or "
        "unquantized (its qualified name, e.g. model.visual, added to BitsAndBytesConfig's llm_int8_skip_modules; "
        "PEFT's k-bit preparation then holds it in fp32)",
    )
    p.add_argument(
        "--llm-int8-skip-modules",
        metavar="NAMES",
        help="BitsAndBytesConfig's llm_int8_skip_modules as you write it, comma-separated (a list replaces "
        "transformers' default, which keeps lm_head); the notes name a name that matched no layer",
    )
    p.add_argument(
        "--lora-scope",
        choices=LORA_SCOPES,
        help="where --target-modules get LoRA in a vision-language model: all (default: the tower too), "
        "language-model (tower and projector frozen), language-model+projector (PEFT's exclude_modules)",
    )
    p.add_argument(
        "--tower-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="with --gradient-checkpointing: the vision tower's layers checkpointed too (default: on, what "
        "gradient_checkpointing_enable does where the tower has checkpointing layers)",
    )
    p.add_argument(
        "--train-projector",
        action=argparse.BooleanOptionalAction,
        help="train a vision-language model's projector whole (PEFT's modules_to_save; it is then left out of 4-bit "
        "and of LoRA), as LLaVA-style recipes do; default: off",
    )
    for bound in ("min", "max"):
        p.add_argument(
            f"--{bound}-pixels",
            type=positive_int,
            metavar="N",
            help=f"Qwen's image processor {bound}_pixels (AutoProcessor.from_pretrained(..., {bound}_pixels=N)): "
            "images are resized into [min, max] pixels at patch x merge multiples; default: the processor's",
        )
    p.add_argument(
        "--video-frames",
        type=positive_int,
        metavar="N",
        help="with --video-size: a video of N frames in each row (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, "
        "Qwen3.5, Qwen3.5-MoE, GLM-4V, InternVL, SmolVLM), made by the family's video processor (needs "
        "torchvision): Qwen's and GLM-4V's take 2 frames a temporal patch, an odd N padded with its last "
        "frame (N=1 refused by Qwen3-VL's and GLM-4V's); "
        "InternVL's and SmolVLM's make each frame an image",
    )
    p.add_argument(
        "--video-size",
        metavar="HxW",
        help="with --video-frames: each frame's height x width in pixels, resized by the video processor "
        "(its own min/max pixels, not the image processor's)",
    )
    p.add_argument(
        "--pan-and-scan",
        action=argparse.BooleanOptionalAction,
        help="Gemma 3's processor(..., do_pan_and_scan=True): an image of aspect ratio >= 1.2 is also cut "
        "into crops (2 to 4, each at least 256 px), each taking mm_tokens_per_image tokens; default: off",
    )


def qlora_config(args: argparse.Namespace, **fixed: object) -> tuple[QLoRAConfig, list[str]]:
    """The :class:`QLoRAConfig` of the parsed options, and the lines that say how it was read.

    ``--config``'s file first (:func:`vramguard.workload.run_config.load_run_config`), then every flag of
    :data:`STEP_FLAGS` the user gave, then ``fixed`` (what the command decides: device, seed). The lines
    name what the file priced, what changes no byte, what flags overrode and what is not priced; and, from
    file or flag, how Trainer's autocast is priced."""
    flags = {name: getattr(args, name) for name in STEP_FLAGS if getattr(args, name, None) is not None}
    lines: list[str] = []
    path = getattr(args, "config", None)
    if path is not None:
        from vramguard.workload.run_config import load_run_config

        run = load_run_config(path)
        config = run.config(**flags, **fixed)
        lines = run.lines(overridden=frozenset(n for n in flags if n in run.values))
    elif trl_defaults(args):
        from vramguard.workload.run_config import trl_sft_defaults

        # a bad --model refused before TRL is imported for its defaults (~5 s)
        if isinstance(flags.get("model"), str):
            flags["model"] = ModelSpec.load(flags["model"])
        defaults = trl_sft_defaults(flags.get("method", "qlora"))
        config = QLoRAConfig(**{**defaults, **flags, **fixed})
        config.validate()
        loop = QLoRAConfig()
        filled = [
            f"{name}={value}"
            for name, value in defaults.items()
            if name not in flags and getattr(loop, name) != value
        ]
        if filled:
            lines.append(
                f"defaults: {trl_sft_name()}'s (SFTConfig, ModelConfig) for the flags not given, where they differ "
                f"from vramguard's loop: {', '.join(filled)}"
            )
    else:
        config = QLoRAConfig(**flags, **fixed)  # type: ignore[arg-type]
        config.validate()
    config = config.resolved()  # the model read, validated and built once: the config passed on holds it
    if config.mixed_precision != "no":
        lines.append(
            f"mixed precision {config.mixed_precision} (Trainer's autocast): priced: the forward and the loss run "
            f"under torch.autocast({config.mixed_precision}) and the outputs are cast back to fp32, as accelerate "
            "wraps the model for Trainer; on meta with the target device's own autocast policy"
            + ("; fp16's GradScaler (a few scalars) is not run" if config.mixed_precision == "fp16" else "")
        )
    return config, lines


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


def add_talk_options(p: argparse.ArgumentParser, quiet_help: str, verbose_help: str = "") -> None:
    """``--quiet`` (``quiet_help``) or ``--verbose`` (what ``verbose_help`` says it adds, and the library log lines
    that ``vramguard``'s :func:`~vramguard.cli.app.main` hides (:data:`~vramguard.cli.app.LIBRARY_NOISE`) noted on
    stderr)."""
    talk = p.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true", help=quiet_help)
    talk.add_argument(
        "--verbose",
        action="store_true",
        help=f"also show {verbose_help}the library log lines vramguard hides (stderr)",
    )


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
    flag, path = "", None
    try:
        if args.snapshot is not None:
            flag, path = "--snapshot", args.snapshot
            write_bytes_atomic(args.snapshot, dump_snapshot(events.snapshot()))
            written.append(f"memory snapshot written to {args.snapshot}")
        if args.html is not None:
            from vramguard.view.timeline import render_run_html

            flag, path = "--html", args.html
            write_text_atomic(args.html, render_run_html(report))
            written.append(f"page written to {args.html}")
        if args.timeline_image is not None:
            from vramguard.view.timeline import timeline_image

            flag, path = "--timeline-image", args.timeline_image
            timeline_image(report, args.timeline_image)
            written.append(f"timeline figure written to {args.timeline_image}")
    except OSError as exc:
        done = f" ({'; '.join(written)})" if written else ""
        raise UsageError(f"cannot write {flag} {path}: {exc.strerror or exc}{done}") from None
    return written


def with_config_notes(report: AuditReport, lines: list[str]) -> AuditReport:
    """``report`` with the lines of :func:`qlora_config` among its verdict's notes (kind ``config``): drawn
    with the other notes, kept in the JSON document."""
    if not lines:
        return report
    findings = [*report.verdict.findings, *checks.notes(checks.CONFIG, lines)]
    return dataclasses.replace(report, verdict=dataclasses.replace(report.verdict, findings=findings))


def print_not_priced(lines: list[str]) -> None:
    """``--quiet``: the lines that name what is not priced, and the lint's, still reach the user, on stderr."""
    for line in lines:
        if "NOT PRICED" in line or line.startswith("lint: "):
            print(f"vramguard: {line}", file=sys.stderr)


def add_sharding_options(p: argparse.ArgumentParser) -> None:
    """``--world-size``, ``--sharding`` and ``--cpu-offload``: the step spread over ranks."""
    p.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks to shard the step over (needs --sharding); each rank gets --batch",
    )
    p.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default=None,
        help="fsdp2 (fully_shard per decoder layer), fsdp1 (FSDP with PEFT's wrap policy, use_orig_params=False), "
        "zero3 (DeepSpeed's own ZeRO-3 engine, audit only; needs the distributed extra)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP's CPU offload of the sharded parameters (refused: needs CUDA ranks, see docs/distributed.md)",
    )
    lint = p.add_argument_group(
        "your FSDP settings (the run measures the FSDP + QLoRA recipe; each setting that differs is linted: "
        "the error FSDP will raise or the bytes per rank it costs)"
    )
    lint.add_argument(
        "--quant-storage",
        choices=("bf16", "fp16", "fp32", "uint8"),
        help="bnb_4bit_quant_storage of your run (default: the compute dtype, the recipe's; bitsandbytes' own "
        "default is uint8)",
    )
    lint.add_argument(
        "--use-orig-params", action="store_true", help="FSDP1's use_orig_params=True (the recipe: False)"
    )
    lint.add_argument(
        "--fsdp-wrap",
        choices=("peft", "layer"),
        help="FSDP1's wrap policy: peft (PEFT's fsdp_auto_wrap_policy, what Trainer installs: the recipe) or "
        "layer (TRANSFORMER_BASED_WRAP alone: LoRA inside each decoder layer's unit)",
    )
    lint.add_argument(
        "--prepare-kbit-training",
        action="store_true",
        help="your run calls PEFT's prepare_model_for_kbit_training before sharding (the recipe does not)",
    )


CPU_OFFLOAD_REFUSAL = (
    "--cpu-offload needs CUDA ranks, which are not wired yet: FSDP's offload keeps the shards on the host and "
    "copies them to the device per unit, but on the host the device is the host (real FSDP2 with "
    "CPUOffloadPolicy gives byte-identical ranks) and on meta no copy is made"
)
"""Why ``--cpu-offload`` is refused (docs/distributed.md, "CPU offload")."""


def sharding_config(args: argparse.Namespace) -> ShardingConfig | None:
    """The :class:`ShardingConfig` of the options :func:`add_sharding_options` added; None for one device.
    One line (UsageError) for a combination that cannot run."""
    if args.world_size is None and args.sharding is None:
        if args.cpu_offload:
            raise UsageError("--cpu-offload needs --world-size and --sharding")
        return None
    if args.sharding is None:
        raise UsageError("--world-size needs --sharding (fsdp2 or fsdp1)")
    if args.cpu_offload:
        raise UsageError(CPU_OFFLOAD_REFUSAL)
    config = ShardingConfig(
        world_size=args.world_size if args.world_size is not None else 1, sharding=args.sharding
    )
    config.validate()
    return config


def fsdp_settings(args: argparse.Namespace, sharding: ShardingConfig | None) -> Any:
    """The user's FSDP settings the lint compares with the recipe
    (:class:`vramguard.estimate.fsdp_lint.FsdpSettings`); one line (UsageError) when they are given without
    ``--world-size`` or name FSDP1 settings for another engine."""
    from vramguard.estimate.fsdp_lint import FsdpSettings

    settings = FsdpSettings(
        quant_storage=args.quant_storage or "",
        use_orig_params=args.use_orig_params,
        wrap=args.fsdp_wrap or "peft",
        prepare_kbit=args.prepare_kbit_training,
    )
    if settings != FsdpSettings() and sharding is None:
        raise UsageError(
            "--quant-storage, --use-orig-params, --fsdp-wrap and --prepare-kbit-training lint a sharded run: "
            "give --world-size and --sharding"
        )
    fsdp1_only = settings.use_orig_params or args.fsdp_wrap is not None
    if sharding is not None and fsdp1_only and sharding.sharding != "fsdp1":
        raise UsageError(
            "--use-orig-params and --fsdp-wrap are FSDP1 settings: use them with --sharding fsdp1"
        )
    settings.validate()
    return settings


def lint_lines(
    report: AuditReport, config: QLoRAConfig, sharding: ShardingConfig, settings: Any
) -> AuditReport:
    """``report`` with the lint of the user's settings among its notes (:func:`vramguard.estimate.fsdp_lint.
    lint`); with ``--quiet`` the caller prints them on stderr (:func:`print_not_priced`)."""
    from vramguard.estimate.fsdp_lint import lint, with_lint

    return with_lint(report, lint(config, sharding, settings))


def add_trainer_option(p: argparse.ArgumentParser, command: str, default: str) -> None:
    """``--trainer loop|trainer|sft``; unset, it follows ``--config``, else it is the command's ``default``
    (:func:`resolve_trainer`)."""
    p.add_argument(
        "--trainer",
        choices=("loop", "trainer", "sft"),
        default=None,
        help=f"whose step to {command}: vramguard's loop, transformers' Trainer or TRL's SFTTrainer (their own "
        "model preparation, collator, loss and optimizer); default: sft for a trl sft YAML --config, trainer for a "
        f"TrainingArguments JSON, {default} otherwise"
        + (
            " (flags not given take trl sft's defaults; --trainer loop takes vramguard's loop's)"
            if default == "sft"
            else ""
        ),
    )
    p.set_defaults(trainer_default=default)


def trl_sft_name() -> str:
    """``trl sft 1.16``: TRL's command, at the version installed."""
    from importlib.metadata import version

    return f"trl sft {'.'.join(version('trl').split('.')[:2])}"


def trl_defaults(args: argparse.Namespace) -> bool:
    """Whether the flags not given (no ``--config``) take ``trl sft``'s defaults: the step is SFTTrainer's, given
    (``--trainer sft``) or the command's default (``estimate``'s). Where SFTTrainer's step cannot run on meta
    and vramguard's loop prices the run instead (:func:`resolve_trainer`), the defaults stay TRL's: the run
    described is the same."""
    if getattr(args, "config", None) is not None:
        return False
    return (getattr(args, "trainer", None) or getattr(args, "trainer_default", "loop")) == "sft"


def resolve_trainer(
    args: argparse.Namespace, config: QLoRAConfig, loop_only: tuple[tuple[str, bool], ...] = ()
) -> tuple[str, str]:
    """(the trainer whose step runs, the recipe line that names it and whose defaults filled the rest).

    Given, ``--trainer`` is taken as it is (what it cannot run is refused in one line where it runs). Unset, a
    ``--config`` YAML is ``trl sft``'s and a JSON is TrainingArguments': their trainer runs; without a file, the
    command's default does (``estimate``: sft, ``audit``: loop). A trainer not given falls back to vramguard's
    loop where the run asks for what only the loop prices (sharded ranks, Liger, offloading, a method other than
    QLoRA, and the command's ``loop_only`` options, such as ``--fit``), and the line says so."""
    from vramguard.workload.vision_sft import trainer_refusal

    path = getattr(args, "config", None)
    trainer = args.trainer
    why = ""
    if trainer is None:
        trainer = ("trainer" if path.suffix == ".json" else "sft") if path is not None else args.trainer_default
        if trainer != "loop":
            not_yet = trainer_refusal(config, trainer)  # a vision-language model's step the trainer cannot run yet
            sharded = any(getattr(args, name, None) is not None for name in ("world_size", "sharding"))
            unpriced = [
                what
                for what, asked in (
                    ("--world-size / --sharding", sharded),
                    ("use_liger_kernel", config.use_liger_kernel),
                    ("activation offloading", config.offload_activations),
                    (f"method {config.method}", config.method != "qlora"),
                    (str(not_yet), not_yet is not None),
                    *loop_only,
                )
                if asked
            ]
            if unpriced:
                why = loop_why(trainer, ", ".join(unpriced))
                trainer = "loop"
    return trainer, recipe_text(trainer, why, args, config.method)


def loop_why(trainer: str, what: str) -> str:
    """Why vramguard's loop ran where ``trainer`` would have: it does not run ``what`` on meta yet."""
    return f" (ran instead of {trainer}'s own step, which does not run {what} yet)"


LOOP_PREPARATION = {
    "qlora": "prepare_model_for_kbit_training, LoRA",
    "lora": "LoRA on the base in its compute dtype",
    "full": "every parameter trained",
}
"""What vramguard's loop does to the model before its steps, by method (the recipe line names it)."""


def recipe_text(trainer: str, why: str, args: argparse.Namespace, method: str = "qlora") -> str:
    """The recipe line: whose step ran (``why``: why the loop ran instead of the trainer asked for), what the loop
    did to the model for ``method``, and whose defaults filled what the user did not set."""
    from importlib.metadata import version

    path = getattr(args, "config", None)
    if path is not None:
        defaults = f"{trl_sft_name()}'s for the keys {path.name} does not set"
    elif trl_defaults(args):
        defaults = f"{trl_sft_name()}'s for the flags not given"
    else:
        defaults = "vramguard loop's for the flags not given"
    if trainer == "sft":
        name = f"{trl_sft_name()} (SFTTrainer's own step)"
    elif trainer == "trainer":
        name = f"transformers {'.'.join(version('transformers').split('.')[:2])} Trainer's own step"
    else:
        name = f"vramguard's loop ({LOOP_PREPARATION.get(method, method)}, full fp32 logits)"
    return f"recipe: {name}{why}; defaults: {defaults}"
