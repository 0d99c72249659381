"""The techniques table of docs/techniques.md: what each QLoRA technique changes in one training step of a
model (Llama-3.1-8B by default) at two sequence lengths, every cell a ``vramguard estimate --config ...
--trainer loop`` run: vramguard's own reproducer loop, which runs every row (Liger, activation offloading and
full fine-tuning are priced only there), not TRL's SFTTrainer step that a TRL YAML gets by default.

    PYTHONPATH=src python docs/scripts/techniques.py                  # run all rows, write the JSON and the page
    PYTHONPATH=src python docs/scripts/techniques.py --rows 0,5       # only these rows (the others kept from the JSON)
    PYTHONPATH=src python docs/scripts/techniques.py --render-only    # the page again from the JSON

Each row is the baseline's TRL keys (``trl sft --config``) with the row's keys on top; a row whose keys the
estimate names NOT PRICED is shown as pending with what it said, never with a number that ignores them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimates import GIB, estimate, replace_between, write_yaml

ROOT = Path(__file__).resolve().parents[2]

BASELINE: dict[str, Any] = {
    "per_device_train_batch_size": 1,
    "gradient_checkpointing": False,
    "optim": "adamw_torch",
    "bf16": False,
    "use_peft": True,
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": False,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "attn_implementation": "sdpa",
    "dtype": "bfloat16",
}
"""QLoRA: NF4 without nested quantization, bf16 compute, LoRA r=16 on all linear layers, torch AdamW, batch 1,
sdpa, no checkpointing, no autocast (``bf16: false``: Trainer's autocast is its own row)."""

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("baseline QLoRA", {}),
    ("+ gradient checkpointing", {"gradient_checkpointing": True}),
    ("+ nested quant", {"use_bnb_nested_quant": True}),
    ("+ 8-bit AdamW", {"optim": "adamw_8bit"}),
    ("+ paged 8-bit AdamW", {"optim": "paged_adamw_8bit"}),
    ("+ LoRA dropout 0.05", {"lora_dropout": 0.05}),
    ("+ DoRA", {"use_dora": True}),
    ("+ DoRA + dropout 0.05", {"use_dora": True, "lora_dropout": 0.05}),
    ("+ rsLoRA", {"use_rslora": True}),
    ("+ padding-free", {"padding_free": True}),
    ("+ packing (bfd)", {"packing": True}),
    ("+ gradient accumulation 4", {"gradient_accumulation_steps": 4}),
    ("+ eager attention", {"attn_implementation": "eager"}),
    ("+ activation offloading", {"activation_offloading": True}),
    ("+ bf16 autocast", {"bf16": True}),
    ("+ flash_attention_2", {"attn_implementation": "flash_attention_2"}),
    ("+ Liger kernels", {"use_liger_kernel": True}),
    (
        "+ checkpointing + nested quant + paged 8-bit AdamW",
        {"gradient_checkpointing": True, "use_bnb_nested_quant": True, "optim": "paged_adamw_8bit"},
    ),
    ("LoRA on the bf16 base (method lora)", {"load_in_4bit": False}),
    ("full fine-tuning (method full)", {"use_peft": False, "load_in_4bit": False}),
]


def model_path(model: str) -> Path:
    """A preset name's JSON (``src/vramguard/workload/presets/NAME.json``) or a path as given."""
    preset = ROOT / "src" / "vramguard" / "workload" / "presets" / f"{model}.json"
    return preset if preset.is_file() else Path(model).resolve()


def run(model: str, seqs: list[int], rows: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, keys) in enumerate(rows):
            cells = {}
            for seq in seqs:
                config = {"model_name_or_path": str(model_path(model)), **BASELINE, "max_length": seq, **keys}
                tic = time.perf_counter()
                cells[str(seq)] = estimate(
                    write_yaml(Path(tmp) / f"row{i}-s{seq}.yaml", config), "--trainer", "loop"
                )
                cells[str(seq)]["config"] = {k: v for k, v in config.items() if k != "model_name_or_path"}
                print(
                    f"{label} @ {seq}: {cells[str(seq)]['allocator_peak_bytes'] / GIB:.2f} GiB "
                    f"({time.perf_counter() - tic:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            results.append({"technique": label, "keys": keys, "runs": cells})
    return {"model": model, "seqs": seqs, "baseline": BASELINE, "target": "cuda", "rows": results}


def _g(n: int) -> str:
    from vramguard.units import format_bytes

    return format_bytes(n)


def _change(n: int, base: int) -> str:
    d = n - base
    if d == 0:
        return "0 B (same bytes)"
    sign = "+" if d > 0 else "−"
    return f"{sign}{_g(abs(d))} ({sign}{abs(d) / base * 100:.1f} %)"


def _what(r: dict[str, Any]) -> str:
    parts = [
        (
            f"{r['peak_phase']} peak; saved for backward {_g(r['saved_bytes'])}, "
            f"frozen weights {_g(r['weights_bytes'])}, trainable parameters {_g(r['trainable_bytes'])}"
        )
    ]
    if r["weight_copy_bytes"]:
        parts.append(f"of the saved, weight copies {_g(r['weight_copy_bytes'])}")
    return ", ".join(parts)


def render(data: dict[str, Any]) -> str:
    seqs = [str(s) for s in data["seqs"]]
    base = data["rows"][0]["runs"]
    head = ["technique", "TRL keys on top of the baseline"]
    for s in seqs:
        head += [f"peak at {s} (allocator / total)", f"change at {s}"]
    head.append(f"what sets the peak (at {seqs[-1]})")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in data["rows"]:
        keys = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in row["keys"].items()) or "(the baseline)"
        cells = [row["technique"], keys]
        pending = sorted({p for s in seqs for p in row["runs"][s]["not_priced"]})
        for s in seqs:
            r = row["runs"][s]
            if pending:
                cells += ["pending", "pending"]
            else:
                cells += [
                    f"{_g(r['allocator_peak_bytes'])} / {_g(r['total_bytes'])}",
                    "—"
                    if row is data["rows"][0]
                    else _change(r["allocator_peak_bytes"], base[s]["allocator_peak_bytes"]),
                ]
        cells.append(
            "pending: NOT PRICED: " + "; ".join(pending) if pending else _what(row["runs"][seqs[-1]])
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--rows", help="comma-separated row numbers (0 = baseline), default all")
    p.add_argument(
        "--results", type=Path, default=ROOT / "docs" / "measurements" / "techniques" / "llama-3.1-8b.json"
    )
    p.add_argument("--page", type=Path, default=ROOT / "docs" / "techniques.md", help="'-' prints the table")
    p.add_argument("--render-only", action="store_true", help="render --results again, run nothing")
    args = p.parse_args(argv)
    if args.render_only:
        data = json.loads(args.results.read_text())
    else:
        rows = ROWS if not args.rows else [ROWS[int(i)] for i in args.rows.split(",")]
        data = run(args.model, args.seq, rows)
        if args.rows and args.results.is_file():  # the rows not run are kept from the JSON, in ROWS' order
            ran = {r["technique"]: r for r in data["rows"]}
            kept = {r["technique"]: r for r in json.loads(args.results.read_text())["rows"]}
            data["rows"] = [ran.get(label) or kept[label] for label, _ in ROWS if label in ran or label in kept]
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(data, indent=1) + "\n")
    table = render(data)
    if str(args.page) == "-":
        print(table)
    else:
        replace_between(args.page, "techniques table", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
