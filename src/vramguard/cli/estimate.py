"""The ``vramguard estimate`` subcommand: arguments, the run, ``--fit``, ``--json`` (drawn by :mod:`vramguard.view.report`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramguard.atomic import write_text_atomic
from vramguard.cli.collector import imports_uncollected
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
    loop_why,
    positive_int,
    print_not_priced,
    qlora_config,
    recipe_text,
    resolve_trainer,
    sharding_config,
    wants_timeline,
    with_config_notes,
    write_timeline_outputs,
)
from vramguard.errors import UsageError
from vramguard.estimate.fit import FIT_AT
from vramguard.estimate.gpus import GPUS, Gpu, gpu_named
from vramguard.step.report import AuditReport
from vramguard.units import SIZE_HELP, parse_size
from vramguard.workload.models import METHODS, OPTIMIZERS, QLoRAConfig

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
        model_help="preset name (e.g. llama-3.1-8b), a vramguard preset JSON, a Hugging Face config.json or model "
        "directory, or a Hub id (org/name[@revision]: its config.json only)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        help="qlora: 4-bit base + LoRA; lora: LoRA on a base in --dtype; full: all parameters in "
        "--full-dtype + AdamW (default: qlora)",
    )
    p.add_argument(
        "--full-dtype",
        choices=("fp32", "bf16", "fp16"),
        help="--method full: the dtype the parameters are loaded and trained in; AdamW keeps its moments in it "
        "(fp32: 16 B per parameter, bf16/fp16: 8 B) (default: fp32)",
    )
    p.add_argument(
        "--optimizer",
        "--optim",
        type=_optimizer,
        metavar="{" + ",".join(OPTIMIZERS) + "} or TRL's optim name",
        help="adamw: torch AdamW (fp32 moments) in torch's default implementation (foreach on CUDA: a "
        "temporary as large as the trainable parameters in the step; single-tensor on the CPU); adamw-fused: "
        "AdamW(fused=True), TrainingArguments' default (adamw_torch_fused); adamw-8bit: bitsandbytes AdamW8bit; "
        "paged-adamw-8bit: "
        "bitsandbytes PagedAdamW8bit, estimated as AdamW8bit with its paged (evictable) state named "
        "(default: adamw); TRL's names (adamw_torch, adamw_torch_fused, adamw_bnb_8bit, adamw_8bit, "
        "paged_adamw_8bit) are the same optimizers",
    )
    p.add_argument(
        "--offload-activations",
        action="store_const",
        const=True,
        help="keep what autograd saves for backward on the host (torch.autograd.graph.save_on_cpu), "
        "emulated on meta: the device holds only the copies backward takes back",
    )
    p.add_argument(
        "--use-liger-kernel",
        action="store_const",
        const=True,
        help="Trainer's use_liger_kernel: Liger's kernels applied as Trainer applies them, its fused linear "
        "cross-entropy among them, priced on meta from liger-kernel's own code (its Triton kernels are not run; "
        '--device cuda; needs the liger extra: pip install "vramguard[liger]")',
    )
    p.add_argument(
        "--padding-free",
        action="store_const",
        const=True,
        help="TRL's padding_free: each micro-batch's rows flattened into one row, position ids restarting per "
        "sequence (TRL's collator), no pad tokens",
    )
    p.add_argument(
        "--packing",
        action="store_const",
        const=True,
        help="TRL's packing (bfd, with --padding-free: SFTTrainer refuses padding-free without packing at a "
        "max_length): several sequences a row",
    )
    p.add_argument(
        "--fit",
        metavar="SIZE",
        nargs="?",
        const="",
        help="the memory of the device (a GPU's for --device cuda, the host's for cpu): find the largest "
        "batch (or --fit-dim seq) that fits, and for a shape that does not fit, the changes that would make it; "
        f"{SIZE_HELP}; without SIZE, --gpu's usable memory",
    )
    p.add_argument(
        "--fit-dim",
        default="batch",
        choices=("batch", "seq", "image"),
        help="what --fit searches; image: the largest image of a vision-language model at --batch and --seq-len "
        "(the whole row, image tokens included: the answer never has more), among the sizes its processor makes "
        "(patch steps, up to its max_pixels), square or at --image-size's aspect ratio",
    )
    p.add_argument(
        "--fit-at",
        default="expected",
        choices=tuple(FIT_AT),
        help="judge what fits at the expected total (fragmentation at the median share measured) or at the high "
        "end (its largest share: for a run with no headroom)",
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="the card the step will run on: its CUDA context allowance in the total, its usable memory the "
        "first line's budget (and --fit's without a SIZE); measured on the H100 and H200, said as assumed "
        f"elsewhere; known: {', '.join(GPUS)}",
    )
    add_sharding_options(p)
    p.add_argument(
        "--device",
        dest="target",
        default="cuda",
        choices=("cuda", "cpu"),
        help="the device the step will run on (the meta run takes its kernels: attention, dropout; the total "
        "adds its overheads): cuda or cpu, as audit's --device (default: cuda)",
    )
    p.add_argument(  # the flag's earlier name, kept hidden as --dtype and --attn are: audit's is --device
        "--target", dest="target", choices=("cuda", "cpu"), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=2,
        help="meta steps (the second has the optimizer state of the first: the steady state)",
    )
    add_trainer_option(p, "price", "sft")
    p.add_argument("--top", type=positive_int, default=3, help="modules listed per layer")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report (the audit's schema) here")
    add_timeline_options(p)
    add_talk_options(
        p,
        "print only the estimate line",
        "every table (each layer, the components, the peak per phase; by default identical layers share a "
        "row) and ",
    )
    p.set_defaults(func=main)


def _optimizer(name: str) -> str:
    """A vramguard optimizer name, or TRL's ``optim`` name of the same optimizer (``adamw_torch_fused``)."""
    from vramguard.workload.run_config import OPTIMIZERS_OF_TRL

    if name in OPTIMIZERS:
        return name
    if name in OPTIMIZERS_OF_TRL:
        return OPTIMIZERS_OF_TRL[name]
    raise argparse.ArgumentTypeError(
        f"invalid choice: {name!r} (choose from {', '.join([*OPTIMIZERS, *OPTIMIZERS_OF_TRL])})"
    )


def main(args: argparse.Namespace) -> int:
    """Run the estimate the options describe on meta, print it (only the verdict line with ``--quiet``),
    search ``--fit`` and write ``--json``; exit 1 when the verdict fails or the total exceeds ``--fit``. The
    libraries' imports run without the garbage collector (:mod:`vramguard.cli.collector`)."""
    with imports_uncollected() as imported:
        return _estimate(args, imported)


def _estimate(args: argparse.Namespace, imported: Callable[[], None]) -> int:
    """:func:`main`'s estimate; ``imported``: called once the libraries are imported (the collector back on)."""
    from vramguard.estimate.run import run_estimate
    from vramguard.measure.events import AllocationLog
    from vramguard.view.console import progress_bar, stdout_console
    from vramguard.view.report import answer_section, estimate_layout, render, render_fit, verdict_only

    check_json_path(args.json)  # fail before the run, not after it
    check_timeline_paths(args)
    gpu = card(args)
    size = fit_size(args, gpu)
    if size is not None:  # VRAMGUARD_WORKERS read now: a bad one is refused before any run
        from vramguard.estimate.workers import worker_count

        worker_count(1)
    config, lines = qlora_config(args, device="cpu")  # validated as a real device; the run is on meta
    imported()  # torch, transformers, TRL (the config's defaults), PEFT and bitsandbytes are imported by now
    events = AllocationLog() if wants_timeline(args) else None
    sharding = sharding_config(args)
    settings = fsdp_settings(args, sharding)
    space = None
    if size is not None and args.fit_dim == "image":  # refused before any meta run where it cannot be searched
        from vramguard.estimate.fit_image import image_space

        if args.world_size is not None or args.sharding is not None:
            raise UsageError("--fit-dim image searches one device's step: leave out --world-size and --sharding")
        space = image_space(config)
    # --fit-dim image searches the sizes whose tokens fit the loop's rows (the chat template's tokens are
    # SFTTrainer's)
    loop_only = (("--snapshot / --html", events is not None), ("--fit-dim image", space is not None))
    trainer, recipe = resolve_trainer(args, config, loop_only)
    if trainer != "loop":
        refuse_with_trainer(args, trainer, events, sharding, space)
    if sharding is not None:
        if events is not None:
            raise UsageError("--snapshot and --html record one process's allocations: leave out --world-size")
        if gpu is not None or args.fit_at != "expected":
            raise UsageError("--gpu and --fit-at price one device: leave them out with --world-size")
        return _distributed(config, sharding, settings, size, args, lines, recipe)
    console = stdout_console()
    progress = progress_bar(args.quiet)  # on stderr, where it is a terminal: the answer waits for --fit's runs
    with progress:
        task = progress.add_task(f"estimate: {config.model} on meta", total=None)
        report = None
        if trainer != "loop":
            from vramguard.estimate.trainer import NeedsLoop, run_trainer_estimate

            try:
                report = run_trainer_estimate(config, trainer, steps=args.steps, target=args.target, gpu=gpu)
            except NeedsLoop as exc:
                if args.trainer is not None:  # asked for by name: refused, with the workaround
                    raise
                recipe = recipe_text("loop", loop_why(trainer, exc.what), args, config.method)
                trainer = "loop"
        if report is None:
            report = run_estimate(config, steps=args.steps, top=args.top, target=args.target, events=events, gpu=gpu)
        report.config["recipe"] = recipe
        report = with_config_notes(report, lines)
        if args.quiet:
            verdict_only(report, console)
            print_not_priced(lines)
        fits = True
        judged = FIT_AT[args.fit_at]
        fit = None
        if size is not None:
            def told(what: str) -> None:
                progress.update(task, description=what)

            runner = _runner(args, trainer, gpu, told)
            fit = _fit(config, size, args, report, runner, _place(args, trainer, gpu), space, told)
            assert report.estimate is not None
            report.estimate.fit = fit
            fits = judged(report) <= size
    shown = for_reading(fit) if fit is not None else None
    if not args.quiet:
        budget = size if size is not None else (gpu.usable_bytes if gpu is not None else None)
        answer = answer_section(budget, args.fit_at, shown, gpu.label if gpu is not None else None)
        render(report, console, (answer, *estimate_layout(args.verbose)))
    if shown is not None:
        render_fit(shown, args.fit_dim, config.batch, config.seq_len, console)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
    if events is not None:
        for line in write_timeline_outputs(args, report, events):
            if not args.quiet:
                console.print(line, highlight=False, soft_wrap=True)
    return 0 if report.verdict.ok and fits else 1


def refuse_with_trainer(
    args: argparse.Namespace, trainer: str, events: Any, sharding: Any, space: Any = None
) -> None:
    """What ``--trainer sft|trainer`` on meta does not run yet, refused in one line with the workaround."""
    asked = {
        "--snapshot / --html": events is not None,
        "--world-size": sharding is not None,
        "--fit-dim image": space is not None,
    }
    for flag, given in asked.items():
        if given:
            raise UsageError(f"--trainer {trainer} on meta does not run {flag} yet: use --trainer loop for it")


def for_reading(fit: dict[str, Any]) -> dict[str, Any]:
    """``--fit``'s answer as a person reads it: the changes what fits first, cheapest in step time first, each with
    its cost (:func:`vramguard.estimate.fit.by_cost`); the ``--json`` document keeps them as the search ran."""
    from vramguard.estimate.fit import by_cost, cost_of

    rows = [
        {**row, "cost": cost_of(row["change"]).word, "cost_detail": cost_of(row["change"]).detail}
        for row in by_cost(fit["changes"])
    ]
    return {**fit, "changes": rows}


def card(args: argparse.Namespace) -> Gpu | None:
    """``--gpu NAME``'s card (one line, exit 2, for a name not registered or with ``--device cpu``)."""
    if args.gpu is None:
        return None
    gpu = gpu_named(args.gpu)
    if args.target != "cuda":
        raise UsageError(f"--gpu {args.gpu} is a CUDA card: leave out --device cpu")
    return gpu


def fit_size(args: argparse.Namespace, gpu: Gpu | None) -> int | None:
    """``--fit``'s memory: its SIZE, or without one ``--gpu``'s usable memory; None without ``--fit``."""
    if args.fit is None:
        if args.fit_at != "expected":
            raise UsageError("--fit-at judges --fit's search: give --fit")
        if getattr(args, "fit_dim", "batch") != "batch":
            raise UsageError(f"--fit-dim {args.fit_dim} says what --fit searches: give --fit")
        return None
    if args.fit == "":
        if gpu is None:
            raise UsageError("--fit needs a size (e.g. --fit 24GiB) or --gpu NAME (the card's usable memory)")
        return gpu.usable_bytes
    size = parse_size(args.fit)
    if size <= 0:
        raise UsageError(f"--fit must be a positive size, got {args.fit!r}")
    return size


TRAINER_FIT_TOKENS = 1 << 21
"""The most tokens (every micro-batch's rows of every step) a ``--fit`` probe of a trainer's step may ask for: the
trainer's rows are real host lists through its own dataset preparation and collator (vramguard's loop makes its
rows on meta, shapes only, and searches up to :data:`~vramguard.estimate.fit.FIT_LIMIT`)."""


def _runner(args: argparse.Namespace, trainer: str, gpu: Gpu | None, told: Any) -> Any:
    """The estimate of a changed config as ``--fit`` runs it: ``trainer``'s own step (``sft``, ``trainer``) or
    vramguard's loop, each run first told (``told``: the progress line) with its count and shape."""
    from vramguard.estimate.run import run_estimate
    from vramguard.estimate.workers import in_worker

    runs = 0

    def estimate(c: QLoRAConfig) -> AuditReport:
        nonlocal runs
        runs += 1
        image = f", image {c.image_size}" if c.image_size else ""
        if not in_worker():  # a worker process prints nothing (the parent's progress line says what runs)
            told(f"fit: meta run {runs} (batch {c.batch} x seq {c.seq_len}{image}, {trainer})")
        if trainer == "loop":  # only the figure is read: no data bounds (packed rows' second run)
            return run_estimate(c, steps=args.steps, top=1, target=args.target, gpu=gpu, bounds=False)
        from vramguard.estimate.trainer import run_trainer_estimate

        return run_trainer_estimate(c, trainer, steps=args.steps, target=args.target, gpu=gpu)

    return estimate


def _place(args: argparse.Namespace, trainer: str, gpu: Gpu | None) -> Any:
    """Where ``--fit``'s changes would run: the target, ``--gpu``'s compute capability (without one the H100's,
    whose figures the estimate takes) and the trainer whose step prices them."""
    from vramguard.step.technique import Place

    if gpu is None:
        return Place(args.target, trainer=trainer)
    return Place(args.target, gpu.compute_capability, trainer)


def _limit(config: QLoRAConfig, args: argparse.Namespace, trainer: str) -> int:
    """The largest value ``--fit`` searches: :data:`~vramguard.estimate.fit.FIT_LIMIT`, the model's positions for
    ``--fit-dim seq``, and for a trainer's step what :data:`TRAINER_FIT_TOKENS` allows (never below the requested)."""
    from vramguard.estimate.fit import FIT_LIMIT
    from vramguard.estimate.run import max_positions

    limit = FIT_LIMIT
    requested = config.batch if args.fit_dim == "batch" else config.seq_len
    if args.fit_dim == "seq":
        positions = max_positions(config.spec)
        limit = min(limit, positions) if positions is not None else limit
    if trainer != "loop":
        other = config.seq_len if args.fit_dim == "batch" else config.batch
        tokens_a_value = other * config.gradient_accumulation_steps * args.steps
        limit = min(limit, max(requested, TRAINER_FIT_TOKENS // tokens_a_value))
    if (config.image_size or config.video_frames) and args.fit_dim == "batch":  # rows made on the host
        from vramguard.workload.vision import parse_image_size

        pixels = 0
        if config.image_size:
            height, width = parse_image_size(config.image_size)
            pixels += height * width * config.images_per_row
        if config.video_frames:
            height, width = parse_image_size(config.video_size)
            pixels += height * width * config.video_frames
        if trainer != "loop":  # the trainer's collator processes every micro-batch's rows of every step
            pixels *= config.gradient_accumulation_steps * args.steps
        limit = min(limit, max(requested, IMAGE_FIT_PIXELS // pixels))
    return limit


IMAGE_FIT_PIXELS = 1 << 24
"""The most image pixels (every row's images and video frames) a ``--fit`` probe of a vision-language model's
batch may ask for: its rows are real images through the family's processor on the host (2^20 rows of images
would take the host's memory and hours); 16.8 M pixels is 83 rows of one 448x448 image."""


def _fit(
    config: QLoRAConfig,
    size: int,
    args: argparse.Namespace,
    report: AuditReport,
    runner: Any,
    place: Any,
    space: Any = None,
    told: Any = None,
) -> dict[str, Any]:
    """``--fit``'s search and, for a shape that does not fit, the changes, each a meta run of ``runner`` (the
    trainer's step where it runs, :func:`_runner`; the changes' in worker processes, ``told``: the progress line
    hears of them) at ``place`` (:func:`_place`); a config run once is not run
    again (:func:`~vramguard.estimate.fit.remembered`). ``space``: ``--fit-dim image``'s sizes
    (:func:`vramguard.estimate.fit_image.image_space`), its answer under ``image``."""
    from vramguard.estimate.fit import cheaper_changes, remembered, search
    from vramguard.estimate.workers import MAX_WORKERS, worker_count

    judged = FIT_AT[args.fit_at]
    assert report.estimate is not None
    requested = config.batch if args.fit_dim == "batch" else config.seq_len
    figure = remembered(lambda c: judged(runner(c)))
    limit = _limit(config, args, place.trainer)
    known = {requested: judged(report)}
    dim: Any = args.fit_dim
    if space is not None:
        dim, limit, known = space.dim, space.limit, space.known(config.image_size, judged(report))
    result = search(config, size, figure, dim=dim, limit=limit, known=known)
    if judged(report) > size:
        largest = result.largest if args.fit_dim == "batch" else 0
        phase = report.estimate.peak_phase
        if told is not None:  # the changes' runs print nothing from their worker processes
            told(f"fit: the changes that could fit, each a meta run, up to {worker_count(MAX_WORKERS)} at a time")
        result.changes = cheaper_changes(config, size, figure, largest_batch=largest, place=place, peak_phase=phase)
    fit = result.to_dict()
    if space is not None:
        fit["image"] = space.answer(result.largest, [value for value, _ in result.runs])
    if args.fit_at != "expected":  # (the default's document is as it was)
        fit["judged_at"] = args.fit_at
    if place.trainer != "loop" or (config.image_size and space is None):  # (the text loop's document is as it was)
        fit["trainer"] = place.trainer
        fit["limit"] = limit
        fit["not_priced"] = _not_priced(config, place)
    return fit


def _not_priced(config: QLoRAConfig, place: Any) -> list[str]:
    """The technique changes vramguard's loop would offer ``config`` that the trainer's step on meta does not price
    yet (offloading, Liger), as the loop would name them."""
    from vramguard.estimate.techniques import registered

    loop = dataclasses.replace(place, trainer="loop")
    offered = [(t.cheaper(config, loop), t.cheaper(config, place)) for t in registered()]
    return [there[0] for there, here in offered if there is not None and here is None]


def _distributed(
    config: QLoRAConfig,
    sharding: Any,
    settings: Any,
    size: int | None,
    args: argparse.Namespace,
    lines: list[str],
    recipe: str,
) -> int:
    """``--world-size N --sharding fsdp2|fsdp1``: every rank on meta under the fake process group."""
    from vramguard.estimate.distributed import run_distributed_estimate
    from vramguard.view.console import stdout_console
    from vramguard.view.report import render, verdict_only

    from vramguard.audit.distributed import SHARDED_OPTIMIZERS

    if config.method != "qlora" or config.optimizer not in SHARDED_OPTIMIZERS or config.offload_activations:
        raise UsageError(
            "--world-size estimates the FSDP + QLoRA recipe: --method qlora, --optimizer adamw or adamw-fused, "
            "no offloading"
        )
    if config.use_liger_kernel:
        raise UsageError("use_liger_kernel is priced on one device: leave out --world-size")
    world_fit = None
    if size is not None and args.world_size is None:  # --fit SIZE --sharding fsdp2: the smallest world size
        world_fit = _smallest_world(config, sharding, size, args)
        sharding = dataclasses.replace(sharding, world_size=world_fit.smallest or world_fit.runs[-1][0])
    report = run_distributed_estimate(config, sharding, steps=args.steps, top=args.top, target=args.target)
    report.config["recipe"] = recipe
    report = with_config_notes(report, lines)
    report = lint_lines(report, config, sharding, settings)
    console = stdout_console()
    if args.quiet:
        verdict_only(report, console)
        print_not_priced(lines + [n for n in report.verdict.notes if n.startswith("lint: ")])
    else:
        render(report, console, "distributed-estimate")
    fits = True
    if size is not None:
        from vramguard.estimate.fit import rank_total
        from vramguard.view.report import render_fit, render_world_fit

        assert report.distributed is not None
        if world_fit is not None:
            report.distributed.fit = world_fit.to_dict()
            fits = world_fit.smallest > 0
            render_world_fit(report.distributed.fit, config.batch, config.seq_len, console)
        else:
            report.distributed.fit = _largest_at_world(config, sharding, size, args, rank_total(report))
            fits = rank_total(report) <= size
            render_fit(report.distributed.fit, args.fit_dim, config.batch, config.seq_len, console)
    if args.json is not None:
        try:
            write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --json {args.json}: {exc}") from None
    return 0 if report.verdict.ok and fits else 1


def _rank0(config: QLoRAConfig, sharding: Any, args: argparse.Namespace) -> AuditReport:
    """Rank 0 alone of ``config``'s sharded step on meta: the rank that holds the most (``torch.chunk`` gives
    it the first, never smaller, share of every parameter; the rest is the same on every rank)."""
    from vramguard.estimate.distributed import run_distributed_estimate

    return run_distributed_estimate(config, sharding, steps=args.steps, top=1, target=args.target, ranks=[0])


def _smallest_world(config: QLoRAConfig, sharding: Any, size: int, args: argparse.Namespace) -> Any:
    """``--fit SIZE --sharding fsdp2`` without ``--world-size``: the smallest world size whose ranks fit."""
    from vramguard.estimate.fit import rank_total, smallest_world

    def total_at(n: int) -> int:
        return rank_total(_rank0(config, dataclasses.replace(sharding, world_size=n), args))

    return smallest_world(size, total_at)


def _largest_at_world(
    config: QLoRAConfig, sharding: Any, size: int, args: argparse.Namespace, requested_total: int
) -> dict[str, Any]:
    """``--fit SIZE --world-size N``: the largest batch (or ``--fit-dim seq``) whose every rank fits at N."""
    from vramguard.estimate.fit import FIT_LIMIT, rank_total, search
    from vramguard.estimate.run import max_positions

    limit = FIT_LIMIT
    if args.fit_dim == "seq":
        positions = max_positions(config.spec)
        limit = min(limit, positions) if positions is not None else limit
    requested = config.batch if args.fit_dim == "batch" else config.seq_len
    result = search(
        config,
        size,
        lambda c: rank_total(_rank0(c, sharding, args)),
        dim=args.fit_dim,
        limit=limit,
        known={requested: requested_total},
    )
    return result.to_dict()
