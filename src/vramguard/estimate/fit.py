"""``vramguard estimate --fit SIZE``: the largest batch (or sequence) whose estimate fits in SIZE.

A search over meta runs (:func:`vramguard.estimate.run.run_estimate`), each an exact step of the
libraries' code. Memory grows with the batch (and the sequence) almost linearly, so the search
first probes 1 and 2, extrapolates the line to SIZE and checks the predicted answer and the one
above it: four runs when the line holds. Where it does not (the loss keeps a batch-1 special case,
eager attention grows with seq²), it falls back to bisection between the values it has already
measured, so the count stays within ``ceil(log2(range)) + 2`` runs beyond the first two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vramguard.audit.report import AuditReport
from vramguard.workload.models import QLoRAConfig

DIMS = ("batch", "seq")
FIT_LIMIT = 1 << 20
"""The largest batch or sequence length searched."""


@dataclass
class Fit:
    """The answer of a search: ``largest`` (0: not even 1 fits) and every run it took."""

    size_bytes: int
    dim: str
    largest: int
    runs: list[tuple[int, int]] = field(default_factory=list)  # (value, total bytes), in run order
    changes: list[dict[str, Any]] = field(default_factory=list)  # what would make the requested shape fit

    @property
    def run_count(self) -> int:
        return len(self.runs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["runs"] = [list(r) for r in self.runs]
        d["run_count"] = self.run_count
        return d


Estimator = Callable[[QLoRAConfig], AuditReport]


def _total(report: AuditReport) -> int:
    assert report.estimate is not None
    return report.estimate.total_bytes


def search(
    config: QLoRAConfig, size: int, estimate: Estimator, dim: str = "batch", limit: int = FIT_LIMIT
) -> Fit:
    """The largest value of ``dim`` (batch or seq) in [1, ``limit``] whose estimated total fits ``size``."""
    if dim not in DIMS:
        raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
    key = "batch" if dim == "batch" else "seq_len"
    fit = Fit(size_bytes=size, dim=dim, largest=0)
    measured: dict[int, int] = {}

    def total(value: int) -> int:
        if value not in measured:
            measured[value] = _total(estimate(dataclasses.replace(config, **{key: value})))
            fit.runs.append((value, measured[value]))
        return measured[value]

    if total(1) > size:
        return fit
    if limit == 1:
        fit.largest = 1
        return fit
    t1, t2 = measured[1], total(2)
    if t2 > size:
        fit.largest = 1
        return fit
    lo, hi = 2, limit + 1  # lo fits, hi does not (limit + 1: never measured, assumed not to fit)
    slope = t2 - t1
    if slope > 0:
        guess = min(limit, 1 + (size - t1) // slope)
        if guess > lo:
            if total(guess) <= size:
                lo = guess
            else:
                hi = guess
        if lo + 1 < hi and lo + 1 <= limit:
            if total(lo + 1) <= size:
                lo += 1
            else:
                hi = lo + 1
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if total(mid) <= size:
            lo = mid
        else:
            hi = mid
    fit.largest = lo
    return fit


def cheaper_changes(config: QLoRAConfig, size: int, estimate: Estimator) -> list[dict[str, Any]]:
    """For a shape that does not fit: the estimate of each change vramguard can run, cheapest first
    (what fits, then the fewest flags changed, then the smallest total)."""
    options: list[tuple[str, QLoRAConfig]] = []
    if not config.gradient_checkpointing:
        options.append(("--gradient-checkpointing", dataclasses.replace(config, gradient_checkpointing=True)))
    if config.lora_rank > 1:
        half = max(1, config.lora_rank // 2)
        options.append((f"--lora-rank {half}", dataclasses.replace(config, lora_rank=half)))
    if not config.gradient_checkpointing and config.lora_rank > 1:
        options.append(
            (
                f"--gradient-checkpointing --lora-rank {max(1, config.lora_rank // 2)}",
                dataclasses.replace(
                    config, gradient_checkpointing=True, lora_rank=max(1, config.lora_rank // 2)
                ),
            )
        )
    rows = []
    for flag, changed in options:
        total = _total(estimate(changed))
        rows.append({"change": flag, "total_bytes": total, "fits": total <= size})
    # cheapest: what fits, then the fewest flags changed (a single change before a combination)
    rows.sort(key=lambda r: (not r["fits"], r["change"].count("--"), r["total_bytes"]))
    return rows
