"""DeepSpeed ZeRO-3 + QLoRA through DeepSpeed's own engine (``audit --world-size 2 --sharding zero3``): two real
gloo ranks, each measured with the ledger and tracker, against the unsharded recipe model built here and against
the engine's own buffers; the refusal where DeepSpeed is not installed.

The real run needs the ``distributed`` extra (``pip install -c constraints.txt -e ".[distributed]"``); without it
those tests skip and say so. One launch (a module fixture) serves all of them: about 70 s on 2 cores."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import tomllib

from vramguard.cli.app import main
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.sharding import ShardingConfig, rank_terms

ROOT = Path(__file__).resolve().parents[1]
CONFIG = QLoRAConfig()  # tiny-llama, batch 2 x seq 128, bf16 compute
STEPS = 2
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# .ci/run installs the distributed extra and sets VRAMGUARD_REQUIRE_DEEPSPEED=1: there a missing DeepSpeed fails,
# never skips (a CI that skipped every ZeRO-3 run would still pass)
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED and os.environ.get("VRAMGUARD_REQUIRE_DEEPSPEED") != "1",
    reason='DeepSpeed is not installed: the distributed extra (pip install -c constraints.txt -e ".[distributed]")',
)


@pytest.fixture(scope="module")
def zero3_audit():
    from vramguard.audit.distributed import run_distributed_audit

    return run_distributed_audit(CONFIG, ShardingConfig(2, "zero3"), steps=STEPS)


@pytest.fixture(scope="module")
def whole():
    """The recipe's model unsharded, built here: the bytes every rank's partitions are a share of."""
    return rank_terms(build_qlora(CONFIG, sharded=True).model)


@needs_deepspeed
def test_zero3_partitions_the_weights_and_replicates_the_quant_state(zero3_audit, whole) -> None:
    """Each rank holds half of every partitioned parameter (the packed 4-bit weights, the unquantized ones; the
    LoRA adapters in bf16, as ``bf16.enabled`` casts them) and all of bitsandbytes' quant_state, which is a
    plain attribute of the weight and no parameter: ZeRO-3 does not partition it."""
    d = zero3_audit.distributed
    assert (d.world_size, d.sharding) == (2, "zero3")
    assert whole.packed_4bit_bytes > 0 and whole.quant_state_bytes > 0
    for row in d.per_rank:
        t = row.terms
        assert t["partitioned_params"] > 0
        assert t["packed_4bit_bytes"] == whole.packed_4bit_bytes // 2
        assert t["unquantized_bytes"] == whole.unquantized_bytes // 2
        assert t["trainable_bytes"] == whole.trainable_bytes // 2 // 2  # fp32 -> bf16, half of it
        assert row.trainable_bytes == t["trainable_bytes"]
        assert t["quant_state_bytes"] == whole.quant_state_bytes  # replicated
        assert t["buffer_bytes"] == whole.buffer_bytes


@needs_deepspeed
def test_zero3_keeps_an_fp32_master_grads_and_adamw_state_of_its_partition(zero3_audit) -> None:
    """Per rank: the fp32 master of its LoRA partition (twice the bf16 partition), one gradient buffer of the
    partition's size, AdamW's two moments on the fp32 master (plus its step counter), and the report's LoRA
    training bytes are their sum with the partitions and the persistent LoRA tensors."""
    for row in zero3_audit.distributed.per_rank:
        t = row.terms
        part = t["trainable_bytes"]
        assert t["fp32_master_bytes"] == 2 * part
        assert t["grad_partition_bytes"] == part
        assert t["optimizer_state_bytes"] == 2 * t["fp32_master_bytes"] + 4  # exp_avg, exp_avg_sq, step
        own = part + t["persistent_trainable_bytes"]
        assert (
            row.lora_training_bytes
            == own + t["grad_partition_bytes"] + t["fp32_master_bytes"] + (t["optimizer_state_bytes"])
        )
        # resident from initialize on (the persistent LoRA tensors come with the first forward: not yet)
        start = part + t["fp32_master_bytes"] + t["grad_partition_bytes"] + t["reduce_bucket_bytes"]
        assert t["training_resident_bytes"] == start
        assert t["persistent_trainable_bytes"] > 0


@needs_deepspeed
def test_the_resident_walk_agrees_with_the_engine_and_with_what_initialize_allocated(zero3_audit) -> None:
    """Two independent counts: the audit's walk of the frozen resident storages (parameters, the tensors hanging
    off them, buffers) equals the engine's partitions, persistent whole tensors, quant_state and buffers; and the
    tracker, running through ``deepspeed.initialize``, saw the partitions, the fp32 master, the gradient buffer
    and the reduce bucket allocated there, and nothing else of size."""
    for row in zero3_audit.distributed.per_rank:
        t = row.terms
        persistent_frozen = t["persistent_bytes"] - t["persistent_trainable_bytes"]
        frozen = t["packed_4bit_bytes"] + t["unquantized_bytes"] + t["quant_state_bytes"] + t["buffer_bytes"]
        assert row.weights_bytes == frozen + persistent_frozen
        allocated = t["packed_4bit_bytes"] + t["unquantized_bytes"] + t["trainable_bytes"]
        allocated += t["fp32_master_bytes"] + t["grad_partition_bytes"] + t["reduce_bucket_bytes"]
        assert t["reduce_bucket_bytes"] > 0
        # all of it, to a few bytes (a flag or two DeepSpeed keeps as a tensor)
        assert allocated <= t["engine_init_bytes"] <= allocated + 16
        # the persistent frozen tensors (norms) are gathered in the first forward and kept: after the steps only
        assert row.weights_bytes - t["weights_at_start_bytes"] == persistent_frozen > 0
        start = t["weights_at_start_bytes"] + t["training_resident_bytes"]
        assert row.allocator_peak_bytes == start + row.step_peak_bytes


@needs_deepspeed
def test_saved_zero3_weights_are_gathered_weights_not_copies(zero3_audit) -> None:
    """DeepSpeed's ``LinearFunctionForZeroStage3`` saves the weight it computed with (lm_head's, gathered
    whole: 512 x 128 bf16). That is an all-gather the engine releases after forward and repeats for backward,
    not a dequantized copy: the ledger names it ``gathered-weight``, outside the saved bytes, and the verdict
    holds."""
    report = zero3_audit
    assert report.totals.weight_copy_bytes == 0
    assert all(r["kind"] != "weight-copy" for r in report.records)
    for row in report.distributed.per_rank:
        assert row.gathered_weight_bytes >= 512 * 128 * 2
        assert row.saved_bytes == report.totals.saved_bytes > 0
    assert report.verdict.ok, report.verdict.line


@needs_deepspeed
def test_the_ranks_agree_and_the_json_section_names_the_engine(zero3_audit) -> None:
    from importlib.metadata import version

    from vramguard.step.report import AuditReport

    rows = zero3_audit.distributed.per_rank
    assert [r.rank for r in rows] == [0, 1]
    same = ("weights_bytes", "terms", "saved_bytes", "lora_training_bytes", "transient")
    assert {k: getattr(rows[0], k) for k in same} == {k: getattr(rows[1], k) for k in same}
    doc = zero3_audit.to_dict()
    assert doc["distributed"]["sharding"] == "zero3"
    assert f"DeepSpeed {version('deepspeed')} ZeRO-3 engine" in doc["distributed"]["engine"]
    assert AuditReport.from_dict(json.loads(json.dumps(doc))) == zero3_audit


_FAKE_RANK0 = """
import dataclasses, json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from vramguard.step.rank import rank_expectation
from vramguard.audit.zero3 import build_zero3_rank, measure_zero3_rank
from vramguard.step.request import StepRequest
from vramguard.workload.models import QLoRAConfig
request = StepRequest.on_device(QLoRAConfig(), steps=int(sys.argv[2]))
q, ds = build_zero3_rank(request, 0, 2)
expected = rank_expectation(q, request.config)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
try:
    _, row = measure_zero3_rank(q, request, ds, 0, 3, expected)
finally:
    dist.destroy_process_group()
with open(sys.argv[1], "w") as fh:
    json.dump(dataclasses.asdict(row), fh)
"""


@needs_deepspeed
@pytest.mark.slow
def test_rank_0_under_the_fake_process_group_equals_the_real_rank_0(zero3_audit, tmp_path: Path) -> None:
    """DeepSpeed accepts torch's fake process group (collectives answered at once, nothing moved): rank 0 of the
    same step in one process, on the host's real tensors, equals the real gloo rank 0 in every field. (Rank 1
    cannot be played so: DeepSpeed checks a list gathered from the ranks, and the fake group's all-gather leaves
    it unfilled: "Detected a disagreement on list length between rank0 and rank1". It runs in a process of its
    own: DeepSpeed keeps its groups in module globals.)"""
    import dataclasses
    import os
    import subprocess
    import sys

    out = tmp_path / "row.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", _FAKE_RANK0, str(out), str(STEPS)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    fake = json.loads(out.read_text())
    assert fake == dataclasses.asdict(zero3_audit.distributed.per_rank[0])


@needs_deepspeed
def test_what_initialize_leaves_does_not_depend_on_when_python_collects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 sometimes still held one more 2,048 B tensor when the count after ``deepspeed.initialize`` was read
    (408,193 B instead of 406,145 B, and the ranks disagreed; cause not identified). The audit reads the count
    after gloo's barrier and a collection of the cycles ``initialize`` leaves. Here the ranks run with Python's
    collector switched off (a ``sitecustomize`` on their path): each rank's count is still what its terms say
    ``initialize`` allocated (a few bytes of flags over), and the ranks agree. The race is not reproducible on
    demand, so this test can catch it only when it happens."""
    from vramguard.audit.distributed import run_distributed_audit

    (tmp_path / "sitecustomize.py").write_text("import gc\ngc.disable()\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
    no_gc = run_distributed_audit(CONFIG, ShardingConfig(2, "zero3"), steps=1)
    counts = []
    for row in no_gc.distributed.per_rank:
        t = row.terms
        allocated = t["packed_4bit_bytes"] + t["unquantized_bytes"] + t["trainable_bytes"]
        allocated += t["fp32_master_bytes"] + t["grad_partition_bytes"] + t["reduce_bucket_bytes"]
        assert allocated <= t["engine_init_bytes"] <= allocated + 16, (t["engine_init_bytes"], allocated)
        counts.append(t["engine_init_bytes"])
    assert counts[0] == counts[1], counts


def test_without_deepspeed_zero3_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where DeepSpeed is not installed (made so here whether or not it is), the audit refuses before
    anything runs: one line, exit 2, naming the extra; the configuration refuses likewise."""
    from vramguard.errors import UsageError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    assert main(["audit", "--world-size", "2", "--sharding", "zero3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DeepSpeed is not installed" in err[0] and ".[distributed]" in err[0], err
    with pytest.raises(UsageError, match="distributed"):
        ShardingConfig(2, "zero3").validate()


def test_deepspeed_is_declared_in_the_distributed_extra_and_pinned() -> None:
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [Requirement(r).name for r in extras["distributed"]] == ["deepspeed"]
    assert "deepspeed" not in {Requirement(r).name for r in extras["test"]}
    pins = [
        line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("deepspeed==")
    ]
    assert len(pins) == 1


def test_the_estimate_refuses_zero3_in_one_line() -> None:
    """DeepSpeed's engine is not run on the meta device: refused, whether or not DeepSpeed is installed."""
    from vramguard.errors import UsageError
    from vramguard.estimate.distributed import run_distributed_estimate

    with pytest.raises(UsageError, match="not run on the meta device") as info:
        run_distributed_estimate(CONFIG, ShardingConfig(2, "zero3"))
    assert "\n" not in str(info.value)


@needs_deepspeed
def test_fp16_is_refused_in_one_line_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 at initialize ("Type fp16 is not supported on your device."):
    said before anything is launched, one line, exit 2."""
    assert main(["audit", "--world-size", "2", "--sharding", "zero3", "--compute-dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fp16" in err[0] and "bf16 or fp32" in err[0], err


@needs_deepspeed
def test_the_docs_table_of_what_deepspeed_keeps_is_this_run(zero3_audit) -> None:
    """docs/distributed.md's ZeRO-3 table ("What DeepSpeed keeps per rank") is typed in the page: each byte figure
    it gives for a term is rank 0's of this run, so the page cannot drift from the code unnoticed."""
    row = zero3_audit.distributed.per_rank[0]
    t = row.terms
    measured = {
        "packed 4-bit weights": t["packed_4bit_bytes"],
        "unquantized weights": t["unquantized_bytes"],
        "quant_state": t["quant_state_bytes"],
        "buffers": t["buffer_bytes"],
        "whole parameters kept beside their partition": t["persistent_bytes"],
        "LoRA partitions": t["trainable_bytes"],
        "fp32 master of the LoRA partitions": t["fp32_master_bytes"],
        "gradient partitions": t["grad_partition_bytes"],
        "AdamW state": t["optimizer_state_bytes"],
        "reduce bucket": t["reduce_bucket_bytes"],
        "allocated by `deepspeed.initialize`": t["engine_init_bytes"],
        "saved activations": row.saved_bytes,
        "all-gathered weights backward uses": row.gathered_weight_bytes,
        "allocator peak": row.allocator_peak_bytes,
    }
    from doctables import DISTRIBUTED, assert_figures, typed_figures

    typed = typed_figures(DISTRIBUTED, "**What DeepSpeed keeps per rank**")
    assert_figures(typed, {term: f"{value:,}" for term, value in measured.items()})


#: the scalar (8 B) a collective of ``engine.step()`` may leave with gloo's thread at the optimizer's peak
GLOO_SCALAR = 8


@needs_deepspeed
def test_zero3_accumulates_in_the_gradient_partitions_it_made_at_initialize(zero3_audit) -> None:
    """Two micro-batches a step through DeepSpeed's engine, as accelerate runs Trainer's accumulation (every
    backward told whether it is the boundary, ``engine.step()`` once): unlike FSDP's ranks, which hold the
    whole unsharded gradient between micro-batches, a ZeRO-3 rank accumulates into the gradient partition it
    allocated at ``initialize``, so the forward and backward peaks of every rank rise by the second
    micro-batch's rows alone (batch x seq int64 ids, fetched before the step as Trainer fetches them) and the
    gradient partitions are the same size. The optimizer phase is held only below a partition's gradient:
    ``engine.step()``'s collectives can leave a scalar with gloo's worker thread for a moment (8 B more in 1
    of 4 runs), which no byte count of that phase can pin: in either run, so the rise may also be that scalar
    short (2,040 B for 2,048 B of rows, once in five runs of this file)."""
    from vramguard.audit.distributed import run_distributed_audit

    config = QLoRAConfig(gradient_accumulation_steps=2)
    accumulated = run_distributed_audit(config, ShardingConfig(2, "zero3"), steps=STEPS)
    rows = CONFIG.batch * CONFIG.seq_len * 8
    for one, two in zip(zero3_audit.distributed.per_rank, accumulated.distributed.per_rank, strict=True):
        rise = {phase: two.phases[phase] - one.phases[phase] for phase in two.phases}
        assert (rise["forward"], rise["backward"]) == (rows, rows)
        assert two.terms["grad_partition_bytes"] == one.terms["grad_partition_bytes"] > 0
        assert rows - GLOO_SCALAR <= rise["optimizer"] < rows + one.terms["grad_partition_bytes"]
    assert accumulated.verdict.ok, accumulated.verdict.line
