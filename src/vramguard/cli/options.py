"""Options shared by the commands that run a QLoRA step (``audit``, ``estimate``): one definition, one
default, one way from the parsed arguments to a :class:`QLoRAConfig`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vramguard.errors import UsageError
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.sharding import SHARDINGS, ShardingConfig


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


def check_json_path(path: Path | None) -> None:
    """Fail on a ``--json`` path that cannot be written, before the run rather than after it."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"--json {path} is a directory")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --json {path}: {parent or path.parent} is not a writable directory")


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
        "zero3 (DeepSpeed: not installed, refused)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP's CPU offload of the sharded parameters (not implemented yet: refused)",
    )


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
        raise UsageError(
            "--cpu-offload is not implemented yet: FSDP's offload moves the shards to the host, which a host-only "
            "run cannot tell apart and a meta run cannot copy"
        )
    config = ShardingConfig(
        world_size=args.world_size if args.world_size is not None else 1, sharding=args.sharding
    )
    config.validate()
    return config
