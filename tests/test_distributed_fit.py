"""``estimate --fit SIZE`` with ``--sharding``: the smallest world size whose ranks fit (no ``--world-size``), and
the largest batch or sequence at a given world size; each answer held against the estimates it ran."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vramguard.cli.app import main
from vramguard.estimate.distributed import run_distributed_estimate
from vramguard.estimate.fit import WorldFit, rank_total, smallest_world
from vramguard.estimate.run import TooLarge
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.sharding import ShardingConfig

ESTIMATE = ["estimate", "--sharding", "fsdp2", "--target", "cpu", "--steps", "1", "--quiet", "--trainer", "loop"]


def _curve(n: int) -> int:
    """A rank's bytes with n ranks: sharded weights shrink, a replicated floor stays."""
    return 1000 + 64_000 // n


@pytest.mark.parametrize("limit", [1, 2, 7, 64, 1024])
def test_smallest_world_is_exact_within_its_bound(limit: int) -> None:
    for size in sorted({_curve(n) for n in range(1, limit + 1)} | {_curve(limit) - 1, 10**9}):
        fit = smallest_world(size, _curve, limit=limit)
        fitting = [n for n in range(1, limit + 1) if _curve(n) <= size]
        assert fit.smallest == (fitting[0] if fitting else 0), size
        assert len(fit.runs) <= 2 * math.ceil(math.log2(max(limit, 2))) + 1
        assert all(total == _curve(n) for n, total in fit.runs)


def test_a_world_size_torch_cannot_describe_does_not_fit() -> None:
    def total(n: int) -> int:
        if n < 4:
            raise TooLarge("beyond 2**63 bytes")
        return 10

    fit = smallest_world(100, total, limit=16)
    assert fit.smallest == 4 and (1, None) in fit.runs
    assert WorldFit(1, 0, 1).to_dict()["smallest_world_size"] == 0


def test_rank_0_holds_the_most() -> None:
    """The searches run rank 0 alone: torch.chunk gives it the first share of every parameter, never smaller
    (FSDP2 pads every local shard to that size). At 3 ranks, where tiny-llama's last rank has shorter shards and
    runs on its own, rank 0's total is the highest."""
    report = run_distributed_estimate(QLoRAConfig(), ShardingConfig(3, "fsdp2"), steps=1, target="cpu")
    rows = report.distributed.per_rank
    assert rows[2].same_as is None  # the last rank's shards differ: it ran, not copied
    assert rank_total(report) == rows[0].total_bytes


def _fit_of(path: Path) -> dict:
    return json.loads(path.read_text())["distributed"]["fit"]


def test_fit_without_world_size_finds_the_smallest(tmp_path: Path) -> None:
    """Between the one-rank and the two-rank totals: the answer is 2, each run is rank 0's estimate at that world
    size, and the report shown is the answer's."""
    one, two = (
        rank_total(run_distributed_estimate(QLoRAConfig(), ShardingConfig(n, "fsdp2"), steps=1, target="cpu"))
        for n in (1, 2)
    )
    assert two < one
    out = tmp_path / "fit.json"
    assert main([*ESTIMATE, "--fit", f"{(one + two) // 2}B", "--json", str(out)]) == 0
    fit = _fit_of(out)
    assert fit["smallest_world_size"] == 2 and fit["runs"] == [[1, one], [2, two]]
    assert json.loads(out.read_text())["distributed"]["world_size"] == 2


def test_fit_at_a_world_size_finds_the_largest_batch(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    assert main([*ESTIMATE, "--world-size", "2", "--fit", "12MiB", "--json", str(out)]) == 0
    fit = _fit_of(out)
    runs = dict(fit["runs"])
    b = fit["largest"]
    assert b >= 2  # the requested batch 2 fits
    assert b in runs or b == 2
    assert runs[b + 1] > 12 * 2**20  # one above does not fit
    assert b not in runs or runs[b] <= 12 * 2**20
