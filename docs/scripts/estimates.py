"""Run ``vramguard estimate --config FILE --json`` in this process and keep what the docs tables need.

Shared by ``docs/scripts/techniques.py`` and ``docs/scripts/published.py``: every number those pages print
comes from here, never typed. A run is the real command (``vramguard.cli.main``), so what a user types
(``vramguard estimate --config X --device cuda --json out.json``) gives the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

GIB = 2**30


def not_priced(output: str) -> list[str]:
    """What the command said it does not price: its ``NOT PRICED`` lines (a config's keys, Trainer's autocast
    while the estimate does not run it), each without the ``config NAME:`` prefix."""
    return [
        line.split("NOT PRICED: ", 1)[1].strip() for line in output.splitlines() if "NOT PRICED: " in line
    ]


def estimate(config: Path, *extra: str, target: str = "cuda") -> dict[str, Any]:
    """``vramguard estimate --config config --device target --json ... --quiet`` (plus ``extra`` flags): the
    figures of its ``--json`` document, in bytes, and the keys it does not price."""
    from vramguard.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "estimate.json"
        argv = [
            "estimate",
            "--config",
            str(config),
            "--device",
            target,
            "--json",
            str(out),
            "--quiet",
            *extra,
        ]
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            code = main(argv)
        # 1: a failed verdict (e.g. DoRA's weight copies), still priced
        if code not in (0, 1) or not out.exists():
            raise RuntimeError(f"vramguard {' '.join(argv)} exited {code}:\n{sink.getvalue()}")
        report = json.loads(out.read_text())
    said = sink.getvalue()
    est = report["estimate"]
    return {
        "command": "vramguard " + " ".join(a for a in argv if a not in ("--json", str(out))),
        "total_bytes": est["total_bytes"],
        "allocator_peak_bytes": est["allocator_peak_bytes"],
        "step_peak_bytes": est["step_peak_bytes"],
        "peak_phase": est["peak_phase"],
        "weights_bytes": est["weights_bytes"],
        "trainable_bytes": est["trainable_bytes"],
        "saved_bytes": report["totals"]["saved_bytes"],
        "weight_copy_bytes": report["totals"]["weight_copy_bytes"],
        "overheads": {o["name"]: o["bytes"] for o in est["overheads"]},
        "fit": est.get("fit"),  # with --fit: the largest batch or sequence that fits, and its runs
        "verdict": report["verdict"]["line"],
        "problems": report["verdict"]["problems"],
        "not_priced": not_priced(said),
    }


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def write_yaml(path: Path, keys: dict[str, Any]) -> Path:
    """A ``trl sft --config`` YAML of ``keys`` (JSON is YAML; one key a line)."""
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def replace_between(page: Path, marker: str, body: str) -> None:
    """Put ``body`` between ``<!-- BEGIN marker -->`` and ``<!-- END marker -->`` in ``page``."""
    begin, end = f"<!-- BEGIN {marker} -->", f"<!-- END {marker} -->"
    text = page.read_text()
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    if not rest or end not in rest:
        raise SystemExit(f"{page} has no {begin} ... {end} block")
    page.write_text(f"{head}{begin}\n{body.rstrip()}\n{end}{tail}")
