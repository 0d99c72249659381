"""The vision-language tables of docs/vlm.md and the seed's case study in docs/case-studies.md, rendered from
``vramguard estimate --json`` runs committed under docs/measurements/2026-11-29-vlm/ (one JSON per run, as the
command wrote it).

    PYTHONPATH=src python docs/scripts/vlm.py --run all            # run every missing run (one at a time), render
    PYTHONPATH=src python docs/scripts/vlm.py --run q3-448-512     # run these again (comma-separated), render
    PYTHONPATH=src python docs/scripts/vlm.py                      # render the pages from the committed JSON

Each run is the real command (``vramguard.cli.main``) in this process: what a user types gives the same bytes.
A full-size run takes 1.5-3.5 minutes of a shared 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = ROOT / "docs" / "measurements" / "2026-11-29-vlm"

COMMON = ("--batch", "1", "--target-modules", "all-linear")
"""Every run: one row a step, LoRA on every linear layer (the vision tower's and the projector's too, as
bitsandbytes quantizes them), TRL sft's defaults for the rest (the recipe line each run records)."""

MODELS = {"qwen2.5-vl-7b": "Qwen2.5-VL-7B", "qwen3-vl-8b": "Qwen3-VL-8B", "gemma-3-12b": "Gemma-3-12B"}

TABLE: list[tuple[str, str, str, int]] = [
    # (run name, preset, image size, seq-len): Qwen's processors keep the size (patch-rounded); Gemma 3's
    # resizes every image to 896x896
    ("q25-224-512", "qwen2.5-vl-7b", "224x224", 512),
    ("q25-448-512", "qwen2.5-vl-7b", "448x448", 512),
    ("q25-448-2048", "qwen2.5-vl-7b", "448x448", 2048),
    ("q25-896-2048", "qwen2.5-vl-7b", "896x896", 2048),
    ("q3-224-512", "qwen3-vl-8b", "224x224", 512),
    ("q3-448-512", "qwen3-vl-8b", "448x448", 512),
    ("q3-448-2048", "qwen3-vl-8b", "448x448", 2048),
    ("q3-896-2048", "qwen3-vl-8b", "896x896", 2048),
    ("g3-896-512", "gemma-3-12b", "896x896", 512),
    ("g3-896-2048", "gemma-3-12b", "896x896", 2048),
]

SEED: list[tuple[str, str, tuple[str, ...]]] = [
    # (run name, mode, flags): the seed's two modes on a 24 GB card, TRL's activation offloading off and on
    ("seed-vl-512", "VL, seq 512, one 448x448 image", ("--image-size", "448x448", "--seq-len", "512")),
    (
        "seed-vl-512-offload",
        "VL, seq 512, one 448x448 image, activation offloading",
        ("--image-size", "448x448", "--seq-len", "512", "--offload-activations"),
    ),
    ("seed-text-4096", "TEXT, seq 4096, no image", ("--seq-len", "4096")),
    (
        "seed-text-4096-offload",
        "TEXT, seq 4096, no image, activation offloading",
        ("--seq-len", "4096", "--offload-activations"),
    ),
    # the same with the base's unquantized parts and the 4-bit matmuls in bf16 (torch_dtype and
    # bnb_4bit_compute_dtype bfloat16, what QLoRA recipes for Qwen-VL write; TRL's ModelConfig default is fp32)
    (
        "seed-vl-512-bf16",
        "VL, seq 512, one 448x448 image, bf16 compute",
        ("--image-size", "448x448", "--seq-len", "512", "--compute-dtype", "bf16"),
    ),
    (
        "seed-vl-512-bf16-offload",
        "VL, seq 512, one 448x448 image, bf16 compute, activation offloading",
        ("--image-size", "448x448", "--seq-len", "512", "--compute-dtype", "bf16", "--offload-activations"),
    ),
    ("seed-text-4096-bf16", "TEXT, seq 4096, no image, bf16 compute", ("--seq-len", "4096", "--compute-dtype", "bf16")),
    (
        "seed-text-4096-bf16-offload",
        "TEXT, seq 4096, no image, bf16 compute, activation offloading",
        ("--seq-len", "4096", "--compute-dtype", "bf16", "--offload-activations"),
    ),
]


TRL_DEFAULTS_IN_LOOP = (
    *("--trainer", "loop", "--gradient-checkpointing", "--bf16", "--optimizer", "adamw-fused", "--no-double-quant"),
    *("--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05"),
)
"""vramguard's loop with trl sft 1.16's defaults (the ones its recipe line names; the compute dtype is each row's own
flag or fp32): the step the offloading rows run in, since SFTTrainer's step on meta does not run TRL's offloading."""

SEED += [
    # the modes without offloading again in vramguard's loop with trl sft's defaults, the step that prices
    # offloading: offloading off and on compared within one step
    (
        f"{name}-loop",
        f"{mode}, vramguard's loop",
        (*flags, *TRL_DEFAULTS_IN_LOOP, *(() if "--compute-dtype" in flags else ("--compute-dtype", "fp32"))),
    )
    for name, mode, flags in list(SEED)
    if "--offload-activations" not in flags
]


FIT: list[tuple[str, tuple[str, ...]]] = [
    # (run name, flags): --fit over the image size on a full-size shape: the largest square image whose step
    # fits a 24 GB card at seq 4096 (the requested 448x448 is one of the sizes searched)
    (
        "fit-q3-image-4096",
        ("--image-size", "448x448", "--seq-len", "4096", "--fit", "--fit-dim", "image", "--gpu", "rtx3090"),
    ),
]


SWIFT = (
    *("--model", "qwen2-vl-7b", "--method", "lora", "--compute-dtype", "bf16", "--bf16"),
    *("--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05"),
    *("--target-modules", "all-linear", "--lora-scope", "language-model", "--gradient-checkpointing"),
    *("--batch", "1", "--max-pixels", "1003520", "--optimizer", "adamw", "--trainer", "loop"),
)
"""ms-swift's examples/train/multimodal/grounding.sh at 7208336 ("# 20GiB"): Qwen2-VL-7B-Instruct, --train_type lora
--torch_dtype bfloat16 (the base in bf16, Trainer's bf16 autocast), --lora_rank 8 --lora_alpha 32, swift's
lora_dropout 0.05, --target_modules all-linear with --freeze_vit true (and swift's freeze_aligner default: LoRA on
the language model only), swift's gradient_checkpointing default (True, the tower's too), batch 1, MAX_PIXELS."""

PUBLISHED: list[tuple[str, str, tuple[str, ...]]] = [
    # (run name, what the row is, flags): a COCO image (640 wide, 480 high: 391 image tokens) and the largest
    # image MAX_PIXELS lets through (896x1120 = 1,003,520 pixels: 1280 image tokens), each in a row of
    # max_length 2048 tokens (every row priced at max_length), and the COCO image in a row of 512
    (
        "swift-coco-2048",
        "a COCO image (480x640), rows at max_length 2048",
        ("--image-size", "480x640", "--seq-len", "2048"),
    ),
    (
        "swift-maxpix-2048",
        "the MAX_PIXELS bound (896x1120), rows at max_length 2048",
        ("--image-size", "896x1120", "--seq-len", "2048"),
    ),
    (
        "swift-coco-512",
        "a COCO image (480x640), rows of 512 tokens",
        ("--image-size", "480x640", "--seq-len", "512"),
    ),
]


def commands() -> dict[str, list[str]]:
    """Every run's ``vramguard`` arguments (without ``--json``), by run name."""
    out = {
        name: ["estimate", "--model", model, "--image-size", size, "--seq-len", str(seq), *COMMON]
        for name, model, size, seq in TABLE
    }
    for name, _mode, flags in SEED:
        out[name] = ["estimate", "--model", "qwen3-vl-8b", *flags, *COMMON, "--gpu", "rtx3090"]
    for name, flags in FIT:
        out[name] = ["estimate", "--model", "qwen3-vl-8b", *flags, *COMMON]
    for name, _what, flags in PUBLISHED:
        out[name] = ["estimate", *SWIFT, *flags]
    return out


def run(name: str, argv: list[str], runs_dir: Path = RUNS_DIR) -> None:
    """``vramguard ARGV --json RUNS_DIR/NAME.json --quiet`` in this process."""
    from vramguard.cli import main

    out = runs_dir / f"{name}.json"
    sink = io.StringIO()
    tic = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = main([*argv, "--json", str(out), "--quiet"])
    if code not in (0, 1) or not out.exists():
        raise SystemExit(f"vramguard {' '.join(argv)} exited {code}:\n{sink.getvalue()}")
    print(f"{name}: {time.perf_counter() - tic:.0f} s: {sink.getvalue().strip()}", file=sys.stderr, flush=True)


CARDS = ("t4", "rtx3090", "a6000", "a10080gb")
"""The cards of the "fits on" columns: 16, 24, 48 and 80 GB (their usable memory: vramguard.estimate.gpus)."""


def load(runs_dir: Path = RUNS_DIR) -> dict[str, dict[str, Any]]:
    """Every committed run's ``--json`` document, by run name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))}


def _g(n: int) -> str:
    from vramguard.units import format_bytes

    return format_bytes(n)


def high(run: dict[str, Any]) -> int:
    """The run's total at the high end (each overhead at its largest measured share), as ``--fit-at high``."""
    est = run["estimate"]
    return est["total_bytes"] + sum(
        o["high_bytes"] - o["bytes"] for o in est["overheads"] if o["high_bytes"] is not None
    )


def tokens(run: dict[str, Any]) -> tuple[int, int]:
    """(image tokens, text tokens) of a row, as the run's note says its processor made them (0 image tokens:
    text-only rows)."""
    import re

    for note in run["verdict"]["notes"]:
        m = re.search(r"(\d+) image tokens as its processor makes them .* \+ (\d+) text tokens", note)
        if m:
            return int(m.group(1)), int(m.group(2))
        m = re.search(r"text-only rows of (\d+) tokens", note)
        if m:
            return 0, int(m.group(1))
    raise ValueError("the run has no vision-language note")


def stacks(run: dict[str, Any]) -> dict[str, int]:
    """Saved-for-backward bytes per stack (vision tower, projector, language model): the run's records, each under
    the stack of the module that saved it (the family's own :meth:`VisionFamily.stack_of`)."""
    from vramguard.workload.vision import STACKS, VISION_FAMILIES

    family = VISION_FAMILIES[run["architecture"]["model_type"]]
    out = dict.fromkeys(STACKS, 0)
    for r in run["records"]:
        out[family.stack_of(r["module"])] += r["bytes"]
    return out


def _fits(run: dict[str, Any], card: str) -> str:
    from vramguard.estimate.gpus import gpu_named

    usable = gpu_named(card).usable_bytes
    if high(run) <= usable:
        return "yes"
    return "tight" if run["estimate"]["total_bytes"] <= usable else "no"


def render_table(runs: dict[str, dict[str, Any]]) -> str:
    """docs/vlm.md's table: each TABLE run's total (expected / high end) and whether it fits each of CARDS."""
    from vramguard.estimate.gpus import gpu_named

    cards = [gpu_named(c) for c in CARDS]
    head = ["model", "image", "image tokens", "seq-len", "allocator peak", "total (expected / high end)"]
    head += [f"{c.label} ({_g(c.usable_bytes)})" for c in cards]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, model, size, seq in TABLE:
        run = runs[name]
        est = run["estimate"]
        cells = [MODELS[model], size, str(tokens(run)[0]), str(seq), _g(est["allocator_peak_bytes"])]
        cells.append(f"{_g(est['total_bytes'])} / {_g(high(run))}")
        cells += [_fits(run, c) for c in CARDS]
        lines.append("| " + " | ".join(cells) + " |")
    recipes = sorted({runs[name]["config"]["recipe"] for name, *_ in TABLE})
    lines += ["", "The runs' recipe line" + (" (every run's)" if len(recipes) == 1 else "s") + ":", ""]
    lines += [f"> {r}" for r in recipes]
    return "\n".join(lines)


def render_stacks(runs: dict[str, dict[str, Any]]) -> str:
    """docs/vlm.md's per-stack table: each TABLE run's saved-for-backward bytes by stack, with its share."""
    from vramguard.workload.vision import STACKS

    head = ["model", "image", "seq-len", "saved for backward", *STACKS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, model, size, seq in TABLE:
        by = stacks(runs[name])
        total = sum(by.values())
        cells = [MODELS[model], size, str(seq), _g(total)]
        cells += [f"{_g(by[s])} ({by[s] / total * 100:.1f} %)" for s in STACKS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_fit(runs: dict[str, dict[str, Any]]) -> str:
    """docs/vlm.md's ``--fit-dim image`` answer on the full-size shape, with every size it ran."""
    lines = []
    for name, flags in FIT:
        fit = runs[name]["estimate"]["fit"]
        image = fit["image"]
        lines.append(f"`vramguard {' '.join(commands()[name])}`:\n")
        lines.append(
            f"- answer: **{image['largest']}** ({image['image_tokens']} image tokens, {image['row_tokens']} tokens "
            f"of the row with their markers) fits {_g(fit['size_bytes'])}; searched the sizes its processor makes "
            f"({image['step']}-pixel sides) up to {image['limit']} (the bound: {image['limited_by']}), "
            f"{fit['run_count']} meta runs besides the requested 448x448 (at most {fit['bound']})"
        )
        ran = ", ".join(
            f"{size}: {_g(t) if t is not None else 'beyond torch'}"
            for size, (_, t) in zip(image["ran"], fit["runs"], strict=True)
        )
        lines.append(f"- the sizes it ran, in order (total, expected): {ran}")
    return "\n".join(lines)


def render_published(runs: dict[str, dict[str, Any]]) -> str:
    """docs/vlm.md's ms-swift block: each PUBLISHED run's figures beside the script's "20GiB"."""
    head = ["row", "image tokens", "seq-len", "weights", "trainable", "allocator peak"]
    head += ["total (expected / high end)", 'against "20GiB"']
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    published = 20 * 2**30
    for name, what, flags in PUBLISHED:
        run = runs[name]
        est = run["estimate"]
        seq = flags[flags.index("--seq-len") + 1]
        cells = [what, str(tokens(run)[0]), seq, _g(est["weights_bytes"]), _g(est["trainable_bytes"])]
        cells += [_g(est["allocator_peak_bytes"]), f"{_g(est['total_bytes'])} / {_g(high(run))}"]
        cells.append(f"{(est['total_bytes'] - published) / published * 100:+.1f} %")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"`vramguard {' '.join(commands()[PUBLISHED[0][0]])}`; each run's recipe line:", ""]
    lines += [f"> {r}" for r in sorted({runs[name]["config"]["recipe"] for name, *_ in PUBLISHED})]
    return "\n".join(lines)


SEED_FIGURES = {
    "seed-vl-512": "—",
    "seed-vl-512-offload": "20.3 GB with TRL's offloading; 13.3 GB after its fix (TRL #5700)",
    "seed-text-4096": "8.5 GB (offloading not said)",
    "seed-text-4096-offload": "8.5 GB (offloading not said)",
}
"""The seed's figures (transformers PR 45769's closing comment), by the run of the same mode (the bf16 runs share
their fp32 run's)."""


def render_seed(runs: dict[str, dict[str, Any]]) -> str:
    """docs/case-studies.md's table: the seed's two modes on an RTX 3090, offloading off and on, beside its figures."""
    head = ["mode", "step priced", "the seed's figure", "weights", "allocator peak", "total (expected / high end)"]
    head += ["peak phase", "fits 24 GB?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    def order(row: tuple[str, str, tuple[str, ...]]) -> tuple[int, int]:  # each mode's SFTTrainer, loop, offloading
        base = row[0].removesuffix("-loop").removesuffix("-offload")
        return [n for n, *_ in SEED].index(base), ("-loop" in row[0]) + 2 * ("-offload" in row[0])

    for name, mode, _flags in sorted(SEED, key=order):
        run = runs[name]
        est = run["estimate"]
        step = "SFTTrainer's" if run["config"]["recipe"].startswith("recipe: trl sft") else "vramguard's loop"
        figure = SEED_FIGURES[name.replace("-bf16", "").removesuffix("-loop")]
        cells = [mode.removesuffix(", vramguard's loop"), step, figure, _g(est["weights_bytes"])]
        cells.append(_g(est["allocator_peak_bytes"]))
        cells += [f"{_g(est['total_bytes'])} / {_g(high(run))}", est["peak_phase"], _fits(run, "rtx3090")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PAGES = {
    "vlm table": ("vlm.md", render_table),
    "vlm stacks": ("vlm.md", render_stacks),
    "vlm fit": ("vlm.md", render_fit),
    "vlm published": ("vlm.md", render_published),
    "seed vlm table": ("case-studies.md", render_seed),
}
"""Each generated block: its marker, its page under docs/, and the function that renders it from the runs."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="'all' (every run without a JSON) or comma-separated run names")
    args = p.parse_args(argv)
    cmds = commands()
    if args.run:
        RUNS_DIR.mkdir(parents=True, exist_ok=True)
        names = (
            [n for n in cmds if not (RUNS_DIR / f"{n}.json").exists()] if args.run == "all" else args.run.split(",")
        )
        for name in names:
            run(name, cmds[name])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from estimates import replace_between

    runs = load()
    for marker, (page, render) in PAGES.items():
        replace_between(ROOT / "docs" / page, marker, render(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
