"""The published-vs-estimated table of docs/distributed.md: published per-GPU figures for FSDP + QLoRA against
``vramguard estimate --world-size N`` (rank 0), every estimated cell read from the run's committed ``--json``
document (``docs/measurements/2026-11-24-fsdp-published/``), never typed. ``tests/test_docs_tables.py`` holds
the page's table (between its ``fsdp published table`` markers) to :func:`render`. Re-render with::

    python docs/scripts/fsdp_published.py docs/measurements/2026-11-24-fsdp-published
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

from vramguard.units import format_bytes

GIB = 1024**3
HEAD = "| source | model, GPUs | settings | published per GPU | estimate per rank | difference |"

PEFT = '[PEFT docs, "Use PEFT QLoRA and FSDP"](https://github.com/huggingface/peft/blob/v0.21.2/docs/source/accelerate/fsdp.md#memory-usage)'
ROWS: list[dict[str, Any]] = [
    {
        "source": PEFT,
        "model": "Llama-2-70B, 2 GPUs, FSDP1 (`use_orig_params: false`, PEFT's wrap policy)",
        "settings": "seq 2048 (packed rows), batch 2, gradient checkpointing, `flash_attention_2`, `bf16`, LoRA r 8 / "
        "alpha 16 / dropout 0.1 all-linear, nested quant, quant storage bf16",
        "published": '"35.6 GB/GPU" without CPU offloading',
        "published_gb": 35.6,
        "run": "peft-llama-2-70b-fsdp1-n2.json.gz",
    },
    {
        "source": "same",
        "model": "same, with `fsdp_offload_params: true`",
        "settings": "same",
        "published": '"19.6 GB"',
        "not_estimated": "not estimated: `--cpu-offload` is refused until CUDA ranks measure it (see below)",
    },
    {
        "source": '[PEFT docs, "Use PEFT QLoRA and DeepSpeed with ZeRO3"](https://github.com/huggingface/peft/blob/'
        "09802c1b43fff9b087be42e149d70e5350ff407a/docs/source/accelerate/deepspeed.md#memory-usage)",
        "model": "Llama-2-70B, 2 GPUs, DeepSpeed ZeRO-3 (`zero3_init_flag: true`, no offload)",
        "settings": "as the FSDP1 row: seq 2048 (packed rows), batch 2, gradient checkpointing (`use_reentrant`), "
        "`flash_attention_2`, `bf16`, LoRA r 8 / alpha 16 / dropout 0.1 all-linear, nested quant, quant storage bf16",
        "published": '"36.6 GB" per GPU',
        "not_estimated": "not estimated: ZeRO-3 is not run on the meta device (refused), and a real 70B ZeRO-3 run "
        "needs about 35 GiB of host memory per rank (this machine has 24 GiB for both)",
    },
    {
        "source": "[philschmid, fsdp-qlora-distributed-llama3](https://gist.github.com/bigsnarfdude/47684d7afc4941c118ad8c0a2d764ca5) "
        "(a copy of the notebook's notes)",
        "model": "Llama-3-70B, 4 x 24 GB, FSDP + CPU offload",
        "settings": "seq 3072, batch 1",
        "published": '"22 GB/GPU"',
        "not_estimated": "not estimated: CPU offload (refused)",
    },
]


def _percent(ratio: float) -> str:
    d = (ratio - 1) * 100
    return f"{'+' if d >= 0 else '−'}{abs(d):.1f} %"


def row_line(row: dict[str, Any], out: Path) -> str:
    """One table row: a published figure with the estimate read from its run, or why none was made."""
    cells = [row["source"], row["model"], row["settings"], row["published"]]
    if "run" not in row:
        return "| " + " | ".join([*cells, row["not_estimated"], "-"]) + " |"
    doc = json.loads(gzip.decompress((out / row["run"]).read_bytes()))
    rank = doc["distributed"]["per_rank"][0]
    total = rank["total_bytes"]
    estimate = (
        f"{format_bytes(total)} total (allocator peak {format_bytes(rank['allocator_peak_bytes'])}: weights "
        f"{format_bytes(rank['weights_bytes'])}, {rank['peak_phase']} peak {format_bytes(rank['step_peak_bytes'])})"
    )
    gb = row["published_gb"]
    difference = (
        f"{_percent(total / (gb * GIB))} if the docs' GB is GiB (as `nvidia-smi`'s MiB read), "
        f"{_percent(total / (gb * 1e9))} if decimal"
    )
    return "| " + " | ".join([*cells, estimate, difference]) + " |"


def render(out: Path) -> str:
    """The Markdown table, its estimated cells from the runs under ``out``."""
    return "\n".join([HEAD, "|" + "---|" * 6, *(row_line(row, out) for row in ROWS)])


if __name__ == "__main__":
    print(render(Path(sys.argv[1])))
