"""``VramGuardCallback`` inside the user's own distributed run: every rank writes its report (``.rankR`` in the
file name) and rank 0 writes the merged one (rank 0's report with a ``distributed`` section of every rank)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vramguard.integrations.transformers import rank_path
from vramguard.step.report import AuditReport

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "probes" / "trainer_rank.py"
LOAD_PROBE = ROOT / "tests" / "probes" / "load_rank.py"


def test_rank_path_names_the_rank() -> None:
    assert rank_path(Path("out/trainer.json"), 1) == Path("out/trainer.rank1.json")
    assert rank_path(Path("m"), 0) == Path("m.rank0")


def _run_ranks(ranks: list[tuple[list[str], dict[str, str]]], timeout: float = 400) -> list[str]:
    """Start one process per (argv, environment), each in its own session, wait for all, kill any left on the
    way out; their outputs. A rank that fails fails the test with every rank's output."""
    procs = [
        subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for argv, env in ranks
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return outputs


def _child_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "GLOO_SOCKET_IFNAME": "lo",
    }


@pytest.mark.slow
def test_cpu_ram_efficient_loading_changes_nothing_for_a_4bit_model(tmp_path: Path) -> None:
    """Two real ranks load the recipe's 4-bit model with accelerate's FSDP environment, with and without
    FSDP_CPU_RAM_EFFICIENT_LOADING: every rank loads all of it and the host bytes are the same (transformers'
    only rank-dependent loading branch, in ``_move_missing_keys_from_meta_to_device``, excludes quantized models).
    Fails when a release starts loading a 4-bit model on rank 0 alone."""
    seen = {}
    for efficient in ("0", "1"):
        folder = tmp_path / efficient
        folder.mkdir()
        argvs = [[sys.executable, str(LOAD_PROBE), str(r), str(folder), efficient] for r in range(2)]
        lines = [
            json.loads(out.strip().splitlines()[-1])
            for out in _run_ranks([(argv, _child_env()) for argv in argvs])
        ]
        seen[efficient] = [(d["rank"], d["peak"], d["after"], d["meta"]) for d in lines]
    assert seen["0"] == seen["1"]
    (r0, peak0, after0, meta0), (r1, peak1, after1, meta1) = seen["1"]
    assert (r0, r1, meta0, meta1) == (0, 1, 0, 0)
    assert peak0 == peak1 > after0 == after1 > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_two_rank_trainer_run_writes_each_rank_and_the_merged_report(tmp_path: Path) -> None:
    """Two real processes, transformers' Trainer under accelerate's multi-CPU (gloo) state, started from torchrun's
    environment variables: each rank's report is its own file, and the merged report's rows are those files'
    figures. (About 30 s on an idle 2-core host; FSDP under accelerate needs GPUs, so the ranks here are
    DDP's, replicated.)"""
    report = tmp_path / "trainer.json"
    env = {**_child_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    argv = [sys.executable, str(PROBE), str(report), str(tmp_path / "out")]
    _run_ranks([(argv, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)])
    ranks = [AuditReport.from_dict(json.loads(rank_path(report, r).read_text())) for r in range(2)]
    merged = AuditReport.from_dict(json.loads(report.read_text()))
    d = merged.distributed
    assert d is not None and (d.world_size, d.sharding) == (2, "ddp") and "gloo" in d.engine
    for r, (row, own) in enumerate(zip(d.per_rank, ranks, strict=True)):
        assert row.rank == r
        assert row.weights_bytes == own.totals.model_resident_bytes > 0
        assert row.saved_bytes == own.totals.saved_bytes > 0
        assert row.phases == {name: p.peak_bytes for name, p in own.phases.items()}
        assert row.allocator_peak_bytes == row.weights_bytes + row.trainable_bytes + row.step_peak_bytes
    assert d.per_rank[0].weights_bytes == d.per_rank[1].weights_bytes  # replicated: DDP shards nothing
    assert merged.verdict.ok, merged.verdict.line
