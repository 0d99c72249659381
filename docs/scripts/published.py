"""The table of docs/published.md: published GPU memory figures of QLoRA/LoRA fine-tuning on the Hugging Face
stack (fixtures/published/figures.json, each with its source and quote) against ``vramguard estimate --config``
of the setting (fixtures/published/configs/*.yaml), every estimate a run, never typed.

    PYTHONPATH=src python docs/scripts/published.py                  # run every row, write the JSON and the page
    PYTHONPATH=src python docs/scripts/published.py --rows ID,ID     # only these rows (the others kept from the JSON)
    PYTHONPATH=src python docs/scripts/published.py --render-only    # the page again from the JSON

A row whose setting the estimate names NOT PRICED (a key of the file, Trainer's autocast) is shown as pending with
what the command said, unless the figures file accepts that key for the row (``accept_not_priced``, with why in the
row's explanation): the comparison is made once the estimate prices it (re-run this script then).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimates import GIB, estimate, replace_between

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "published"
TOLERANCE = 0.10


def run_row(row: dict[str, Any], fixtures: Path, fit_context: bool = False) -> dict[str, Any]:
    """The row's estimate, and one more per flag set of its ``also`` (a sensitivity to what the source leaves
    unknown, e.g. the longest batch: shown in the explanation, never as the comparison)."""
    config = (fixtures / row["config"]).resolve()
    config = config.relative_to(Path.cwd()) if config.is_relative_to(Path.cwd()) else config
    result = estimate(config, *row["flags"])
    if row.get("also"):
        result["also"] = [
            {"flags": flags, **estimate(config, *row["flags"], *flags)} for flags in row["also"]
        ]
    if fit_context and row["kind"] == "max_context":
        fit = estimate(config, *row["flags"], "--fit", f"{row['gpu_gib']}GiB", "--fit-dim", "seq")["fit"]
        result["fit_context"] = {"largest": fit["largest"], "run_count": fit["run_count"]}
    return result


def pending_of(row: dict[str, Any], result: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(what blocks the comparison, what the row accepts as not priced)."""
    accepted = [p for p in result["not_priced"] if any(p.startswith(k) for k in row.get("accept_not_priced", []))]
    return [p for p in result["not_priced"] if p not in accepted], accepted


def compare(row: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The estimate's figure that the published one is compared with, the difference and the verdict."""
    gpu = row["gpu_gib"] * GIB
    total = result["total_bytes"]
    if row["kind"] == "reserved":
        ours = total - result["overheads"].get("CUDA context + kernels", 0)
        diff = ours / row["value"] - 1
        return {
            "estimate_bytes": ours,
            "difference": diff,
            "agrees": abs(diff) <= TOLERANCE,
            "measure": "allocator peak + cuBLAS + fragmentation (total without the CUDA context)",
        }
    diff = total / gpu - 1
    if row["kind"] == "max_context":
        agrees = abs(diff) <= TOLERANCE
    elif row["kind"] == "fits":
        agrees = diff <= 0
    else:  # oom
        agrees = diff > 0
    return {"estimate_bytes": total, "difference": diff, "agrees": agrees, "measure": "total on the device"}


def published_text(row: dict[str, Any]) -> str:
    if row["kind"] == "max_context":
        return f"max context {row['value']:,} tokens in {row['gpu_gib']:g} GB"
    if row["kind"] == "fits":
        return f"fits (No OOM) in {row['gpu_gib']:g} GiB"
    if row["kind"] == "oom":
        return f"OOM in {row['gpu_gib']:g} GiB"
    return f"{row['value'] / GIB:.2f} GiB reserved ({row['value']:,} B)"


def render(figures: dict[str, Any], results: dict[str, Any]) -> str:
    head = [
        "source",
        "model",
        "GPU",
        "settings (assumed)",
        "published figure",
        "vramguard estimate",
        "difference",
        "explanation",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    commands = []
    tally = {"agree": 0, "disagree": 0, "pending": 0, "not run": 0}
    for row in figures["rows"]:
        result = results.get(row["id"])
        links = " ".join(f"[{i + 1}]({u})" for i, u in enumerate(row["urls"]))
        cells = [
            f"{row.get('short') or row['source']} {links}",
            row["model"],
            row["gpu"],
            f"{row['settings']} ({row['assumed']})",
            published_text(row),
        ]
        if result is None:
            tally["not run"] += 1
            cells += ["not run", "—", row.get("explain", "")]
        else:
            blocking, accepted = pending_of(row, result)
            c = compare(row, result)
            why = row.get("explain", "")
            if "fit_context" in result:
                largest = result["fit_context"]["largest"]
                why += (
                    f" vramguard's longest context in {row['gpu_gib']:g} GiB (--fit --fit-dim seq): {largest:,} "
                    f"({(largest / row['value'] - 1) * 100:+.1f} % against the published)."
                )
            for other in result.get("also", []):
                o = compare(row, other)
                why += (
                    f" With {' '.join(other['flags'])}: {o['estimate_bytes'] / GIB:.2f} GiB "
                    f"({o['difference'] * 100:+.1f} %)."
                )
            if accepted:
                why = f"{why} Not priced, accepted: {'; '.join(accepted)}".strip()
            tally["pending" if blocking else "agree" if c["agrees"] else "disagree"] += 1
            why = why.strip()
            if blocking:
                cells += [
                    "pending",
                    "pending",
                    (
                        f"pending autocast/FA2: the estimate says NOT PRICED: {'; '.join(blocking)}. "
                        f"(Today's estimate without them: {c['estimate_bytes'] / GIB:.2f} GiB, not a comparison.) {why}"
                    ),
                ]
            else:
                mark = "agrees" if c["agrees"] else "DISAGREES"
                cells += [
                    f"{c['estimate_bytes'] / GIB:.2f} GiB ({c['measure']})",
                    f"{c['difference'] * 100:+.1f} % ({mark})",
                    why,
                ]
            commands.append(f"* `{row['id']}`: `{result['command']}`")
        lines.append("| " + " | ".join(str(x).replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
    summary = (
        f"{len(figures['rows'])} published figures: {tally['agree']} agree, {tally['disagree']} disagree, "
        f"{tally['pending']} pending (a setting not priced yet)"
        + (f", {tally['not run']} not run" if tally["not run"] else "")
        + f"; agreement is within ±{TOLERANCE * 100:g} % for a figure in bytes or a context, the right side of the GPU's "
        "memory for OOM / No OOM.\n\n"
    )
    return (
        summary
        + "\n".join(lines)
        + "\n\nThe command of each row (run from the repository root):\n\n"
        + "\n".join(commands)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--figures", type=Path, default=FIXTURES / "figures.json")
    p.add_argument(
        "--results", type=Path, default=ROOT / "docs" / "measurements" / "published" / "estimates.json"
    )
    p.add_argument("--page", type=Path, default=ROOT / "docs" / "published.md", help="'-' prints the table")
    p.add_argument("--rows", help="comma-separated row ids to run (default: all)")
    p.add_argument("--render-only", action="store_true")
    p.add_argument(
        "--fit-context",
        action="store_true",
        help="for a max-context row, also search the longest context that fits (--fit --fit-dim seq: up "
        "to about 20 meta runs a row)",
    )
    args = p.parse_args(argv)
    figures = json.loads(args.figures.read_text())
    results: dict[str, Any] = json.loads(args.results.read_text()) if args.results.exists() else {}
    if not args.render_only:
        wanted = set(args.rows.split(",")) if args.rows else {r["id"] for r in figures["rows"]}
        for row in figures["rows"]:
            if row["id"] not in wanted:
                continue
            tic = time.perf_counter()
            results[row["id"]] = run_row(row, args.figures.parent, args.fit_context)
            print(
                f"{row['id']}: total {results[row['id']]['total_bytes'] / GIB:.2f} GiB "
                f"({time.perf_counter() - tic:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(results, indent=1) + "\n")
    table = render(figures, results)
    if str(args.page) == "-":
        print(table)
    else:
        replace_between(args.page, "published table", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
