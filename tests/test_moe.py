"""Mixtures of experts as they really load: attention 4-bit, the fused 3-D expert stacks unquantized.

transformers 5.x keeps the experts as 3-D parameters that bitsandbytes' 4-bit loading leaves alone; the
audit measures that (it used to refuse it). Its saved bytes are held against a count written here with
``saved_tensors_hooks`` alone (each storage once, parameters and quantization state left out), not read
from vramguard; the meta estimate with the CPU's kernels equals the CPU audit to the byte; and routing
forced to all tokens to the same experts and to balanced routing keeps the same bytes with grouped_mm
experts. With eager experts (a loop over the experts hit) routing moves the backward peak: each forced
routing estimated on meta equals the CPU audit forced to it, and the routing the audit draws lies between
the low (all tokens to the same experts) and the high (every expert hit, the highest-numbered with one token).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from vramguard.audit.run import run_audit
from vramguard.cli import main
from vramguard.errors import UsageError
from vramguard.estimate.techniques import used_by
from vramguard.workload.models import QLoRAConfig, build_qlora

SHAPE = {"seq_len": 64, "batch": 2}

MOE = [
    pytest.param("tiny-mixtral", id="mixtral"),
    pytest.param("tiny-qwen3-moe", id="qwen3-moe"),
    pytest.param("tiny-olmoe", id="olmoe", marks=pytest.mark.slow),
    pytest.param("tiny-gpt-oss", id="gpt-oss", marks=pytest.mark.slow),
]


def hook_count(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes the forward leaves saved for backward, by ``saved_tensors_hooks`` alone: the storages of the
    packed tensors still alive after the forward (a branch whose graph was dropped keeps nothing), each once,
    except the model's parameters, buffers and the tensors of their quantization state (resident)."""
    resident: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        resident.add(t.untyped_storage().data_ptr())
        qs = getattr(t, "quant_state", None)
        for inner in (qs, getattr(qs, "state2", None)):
            for value in vars(inner).values() if inner is not None else ():
                if isinstance(value, torch.Tensor):
                    resident.add(value.untyped_storage().data_ptr())
    packed: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    assert loss.requires_grad
    alive = [t for ref in packed if (t := ref()) is not None]  # all alive: no address is reused among them
    saved = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
    del loss
    return sum(n for ptr, n in saved.items() if ptr not in resident)


@contextmanager
def routing(kind: str) -> Iterator[None]:
    """Every router's choice replaced after its own ops ran (so it saves what it saves): ``worst``, all
    tokens to experts 0..k-1; ``balanced``, token t to experts t*k .. t*k+k-1 (mod the count)."""

    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not type(module).__name__.endswith("TopKRouter"):
            return None
        logits, scores, indices = out
        tokens, k = indices.shape
        experts = logits.shape[-1]
        if kind == "worst":
            forced = torch.arange(k).expand(tokens, k)
        else:
            forced = (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % experts
        return logits, scores, forced.to(indices.device, indices.dtype).contiguous()

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("model", MOE)
def test_moe_audit_measures_and_equals_an_independent_hook_count_and_the_estimate(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", model, "--seq-len", str(SHAPE["seq_len"]), "--batch", str(SHAPE["batch"]), "--quiet"]
    audit_json, estimate_json = tmp_path / "audit.json", tmp_path / "estimate.json"
    code = main(["audit", *argv, "--device", "cpu", "--steps", "2", "--json", str(audit_json)])
    out = capsys.readouterr()
    assert code in (0, 1) and "mixture-of-experts" not in out.err, out  # measured, never refused
    assert main(["estimate", *argv, "--trainer", "loop", "--target", "cpu", "--json", str(estimate_json)]) == code
    audit, estimate = json.loads(audit_json.read_text()), json.loads(estimate_json.read_text())

    q = build_qlora(QLoRAConfig(model=model, **SHAPE))  # the audit's model: same config, same seed
    counted = hook_count(q.model, q.batch(0))
    assert audit["totals"]["saved_bytes"] == counted and audit["totals"]["ctx_bytes"] == 0

    assert estimate["totals"] == audit["totals"]
    assert estimate["layers"] == audit["layers"]
    assert estimate["phases"] == audit["phases"]
    assert [s["peak_bytes"] for s in estimate["steps"]] == [s["peak_bytes"] for s in audit["steps"]]
    line = next(n for n in audit["verdict"]["notes"] if n.startswith("mixture of experts:"))
    assert "4-bit (bitsandbytes Linear4bit)" in line and "fused 3-D expert stacks" in line
    assert line in estimate["verdict"]["notes"]


def test_routing_does_not_change_a_byte_with_grouped_mm_experts() -> None:
    """The bound for balanced routing and for the worst case, and the measured value between them: equal
    saved bytes (counted by hooks) and equal phase peaks (the audit's tracker), because every expert
    matmul takes tokens x top_k rows whatever the routing. The forced routing really is different."""
    config = QLoRAConfig(model="tiny-mixtral", **SHAPE)
    q = build_qlora(config)
    assert q.model.config._experts_implementation == "grouped_mm"
    batch = q.batch(0)
    chosen: dict[str, list[torch.Tensor]] = {}
    counts = {}
    for kind in ("drawn", "worst", "balanced"):
        picks: list[torch.Tensor] = []

        def record(module: torch.nn.Module, args: Any, picks: list[torch.Tensor] = picks) -> None:
            if type(module).__name__.endswith("MixtralExperts"):  # (hidden, top_k_index, top_k_weights)
                picks.append(args[1].detach().clone())

        handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
        try:
            with routing(kind) if kind != "drawn" else _nothing():
                counts[kind] = hook_count(q.model, batch)
        finally:
            handle.remove()
        chosen[kind] = picks
    assert len(set(counts.values())) == 1, counts
    tokens_per_expert = {k: torch.bincount(v[0].flatten(), minlength=4).tolist() for k, v in chosen.items()}
    assert tokens_per_expert["worst"] == [128, 128, 0, 0]
    assert tokens_per_expert["balanced"] == [64, 64, 64, 64]
    assert tokens_per_expert["drawn"] not in (tokens_per_expert["worst"],)

    reports = {"drawn": run_audit(config, steps=1)}
    for kind in ("worst", "balanced"):
        with routing(kind):
            reports[kind] = run_audit(config, steps=1)
    peaks = {
        k: ({p: v.peak_bytes for p, v in r.phases.items()}, r.totals.saved_bytes) for k, r in reports.items()
    }
    assert peaks["worst"] == peaks["drawn"] == peaks["balanced"], peaks
    note = next(n for n in reports["drawn"].verdict.notes if n.startswith("routing:"))
    assert "grouped_mm" in note


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_expert_stacks_lora_copies_are_weight_copies() -> None:
    """PEFT's LoRA on expert parameters (what all-linear gives Mixtral under transformers 5) materialises
    W + B A per forward, which grouped_mm keeps for backward: the ledger calls it a weight copy."""
    report = run_audit(QLoRAConfig(model="tiny-mixtral", **SHAPE), steps=1)
    copies = [r for r in report.records if r["kind"] == "weight-copy" and len(r["shape"]) == 3]
    assert copies and all(r["node"] == "GroupedMmBackward0" for r in copies)
    # the merged stacks of both layers: (4, 2*176, 128) and (4, 128, 176), fp32, transposed as grouped_mm takes them
    assert sum(r["bytes"] for r in copies) == 2 * 4 * (2 * 176 * 128 + 128 * 176) * 4
    assert not report.verdict.ok


def test_target_modules_without_experts_keeps_no_weight_copy() -> None:
    """Asked for attention only (no expert parameters), the experts are not wrapped and nothing is copied.
    (96 tokens: at 128, the router's (tokens, 4) softmax output has its (4, 128) weight's shape, which the
    ledger's shape rule takes for a copy.)"""
    config = QLoRAConfig(model="tiny-mixtral", target_modules="q_proj,v_proj", seq_len=48, batch=2)
    report = run_audit(config, steps=1)
    assert report.totals.weight_copy_bytes == 0
    line = next(n for n in report.verdict.notes if n.startswith("mixture of experts:"))
    assert "LoRA (PEFT) on modules q_proj, v_proj" in line and "target_parameters" not in line


def eager(preset: str, tmp_path: Path) -> str:
    """A copy of ``preset``'s config asking for transformers' eager experts (a loop over the experts hit)."""
    from vramguard.workload.models import presets

    data = json.loads(presets()[preset].read_text())
    path = tmp_path / f"{preset}-eager.json"
    path.write_text(json.dumps({**data, "experts_implementation": "eager"}))
    return str(path)


class ForcedEstimates:
    """The tiny presets with eager experts (:func:`eager`, one copy a module) and the estimates of their
    step at :data:`SHAPE` forced to each routing (``steps=1, target="cpu"``), each run once a module: three
    tests read the same forced estimates (the bounds, the CPU audit's equality, the unforced one's high)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.reports: dict[tuple[str, str], Any] = {}

    def config(self, preset: str) -> QLoRAConfig:
        path = self.folder / f"{preset}-eager.json"
        return QLoRAConfig(model=str(path) if path.exists() else eager(preset, self.folder), **SHAPE)

    def __call__(self, preset: str, routing: str) -> Any:
        from vramguard.estimate.run import run_estimate

        if (preset, routing) not in self.reports:
            config = self.config(preset)
            self.reports[preset, routing] = run_estimate(config, steps=1, target="cpu", routing=routing)
        return self.reports[preset, routing]


@pytest.fixture(scope="module")
def forced_estimate(tmp_path_factory: pytest.TempPathFactory) -> ForcedEstimates:
    return ForcedEstimates(tmp_path_factory.mktemp("eager-experts"))


def test_a_config_asking_for_eager_experts_gets_them_in_the_audit_and_the_estimate(tmp_path: Path) -> None:
    """``experts_implementation`` in the model's config.json is what transformers' from_pretrained honours;
    save_pretrained does not write it, so the audit's load from its random checkpoint is told it."""
    from vramguard.estimate.meta import build_meta

    config = QLoRAConfig(model=eager("tiny-mixtral", tmp_path), **SHAPE)
    for q in (build_qlora(config), build_meta(config)):
        assert q.model.config._experts_implementation == "eager"
        line = next(n for n in q.notes if n.startswith("mixture of experts:"))
        assert "experts_implementation eager" in line


@pytest.mark.parametrize("kind", ["same", "balanced", "skewed"])
@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(128, 2, 4), (128, 2, 8), (5, 3, 4), (3, 2, 8)])
def test_forced_assignments_route_their_counts(kind: str, tokens: int, top_k: int, experts: int) -> None:
    from vramguard.workload.routing import assignment, expert_counts

    counts = expert_counts(kind, tokens, top_k, experts)
    index = assignment(counts, tokens, top_k)
    assert index.shape == (tokens, top_k) and index.dtype == torch.int64
    assert torch.bincount(index.flatten(), minlength=experts).tolist() == counts
    assert all(len(set(row)) == top_k for row in index.tolist())  # a token's experts are different
    if kind == "same":
        assert counts[:top_k] == [tokens] * top_k
    elif kind == "balanced":
        assert max(counts) - min(counts) <= 1
    else:  # every expert hit as far as there are choices, the highest-numbered with one token
        assert sum(c > 0 for c in counts) == min(experts, tokens * top_k) and counts[-1] <= 1


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_eager_forced_routing_on_meta_equals_the_cpu_audit(
    preset: str, forced_estimate: ForcedEstimates
) -> None:
    """Each forced routing, estimated on meta with the CPU's kernels (the expert loop's data-dependent steps
    answered from the assignment), equals the CPU audit forced to it, to the byte; the routings differ."""
    from vramguard.workload.routing import step_peak

    config = forced_estimate.config(preset)
    peaks = {}
    for kind in ("same", "balanced", "skewed"):
        audit = run_audit(config, steps=1, routing=kind)
        estimate = forced_estimate(preset, kind)
        assert estimate.totals == audit.totals
        assert estimate.layers == audit.layers
        assert estimate.phases == audit.phases
        assert estimate.estimate is not None
        forced = estimate.estimate.forced_decisions
        assert forced["routing_forced"] == 2 and forced["routing_answered"] > 0  # both layers' loops, on meta
        peaks[kind] = step_peak(audit)
    assert peaks["same"] < peaks["balanced"] < peaks["skewed"]


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_eager_experts_routing_bounds_hold_the_drawn_routing(
    preset: str, forced_estimate: ForcedEstimates
) -> None:
    """With eager experts routing decides the step's peak: the routing the audit's random router drew lies
    between the low (all tokens to the same experts) and the high (every expert hit, the highest-numbered with
    one token each), each the step estimated on meta with the routing forced (equal to the CPU audit forced to
    it: the test above), and the audit's routing line names all three."""
    from vramguard.estimate.run import forced_routing_figures
    from vramguard.units import format_bytes
    from vramguard.workload.routing import step_peak

    drawn = run_audit(forced_estimate.config(preset), steps=1, routing_figures=forced_routing_figures)
    figures = {}
    for kind in ("same", "balanced", "skewed"):
        forced = forced_estimate(preset, kind)
        figures[kind] = (step_peak(forced), forced.totals.saved_bytes)
    low, balanced, high = figures["same"], figures["balanced"], figures["skewed"]
    measured = (step_peak(drawn), drawn.totals.saved_bytes)
    assert low[0] < high[0]  # the bounds differ: routing really decides here
    assert low[0] < measured[0] < high[0]
    # the saved bytes do not move: the experts' tensors sum to tokens x top_k rows whatever the routing
    assert low[1] == measured[1] == balanced[1] == high[1]
    line = next(n for n in drawn.verdict.notes if n.startswith("routing:"))
    assert f"peaked at {format_bytes(measured[0])}, between the low {format_bytes(low[0])}" in line
    assert f"the high {format_bytes(high[0])}" in line
    assert f"balanced routing {format_bytes(balanced[0])}" in line
    assert "not bounded" not in line


def test_eager_experts_estimate_is_the_high(forced_estimate: ForcedEstimates) -> None:
    """meta has no routing to draw: the estimate of eager experts is the highest forced routing's step, and its
    routing line names the low."""
    from vramguard.estimate.run import run_estimate
    from vramguard.units import format_bytes
    from vramguard.workload.routing import step_peak

    estimate = run_estimate(forced_estimate.config("tiny-mixtral"), steps=1, target="cpu")
    high = forced_estimate("tiny-mixtral", "skewed")
    low = forced_estimate("tiny-mixtral", "same")
    assert estimate.estimate is not None and high.estimate is not None
    assert estimate.phases == high.phases and estimate.estimate.total_bytes == high.estimate.total_bytes
    assert step_peak(low) < step_peak(high)
    line = next(n for n in estimate.verdict.notes if n.startswith("routing:"))
    assert f"this estimate is the high {format_bytes(step_peak(high))}" in line
    assert f"the low {format_bytes(step_peak(low))} (all tokens to the same top 2 experts)" in line


def test_routing_line_says_what_the_figures_say() -> None:
    """The line is worked out from the figures: between, outside (not bounded), or no routing moving a byte."""
    from vramguard.workload.routing import bounds_line

    bounds = {"same": (100, 7), "balanced": (150, 7), "skewed": (200, 7)}
    assert "peaked at 120 B, between the low 100 B" in bounds_line("eager", 2, bounds, (120, 7))
    above = bounds_line("eager", 2, bounds, (250, 7))
    assert "peaked at 250 B, above every forced routing, not bounded" in above
    assert "this estimate is the high 200 B" in bounds_line("eager", 2, bounds, None)
    same = {k: (100, 7) for k in bounds}
    line = bounds_line("eager", 2, same, (100, 7))
    assert "here it does not" in line and "all peak at 100 B" in line and "between" not in line


def test_the_audit_command_holds_the_drawn_routing_between_the_forced_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``vramguard audit`` (its own loop, on the CPU) gives the forced routings' figures to the audit: its
    routing line holds the drawn peak between the low and the high (without them it is the build's line)."""
    argv = ["--model", eager("tiny-mixtral", tmp_path), "--seq-len", "64", "--batch", "2", "--steps", "1"]
    assert main(["audit", *argv, "--device", "cpu"]) in (0, 1)
    out = " ".join(capsys.readouterr().out.split())
    assert "routing: with the eager experts" in out
    assert ", between the low " in out and "not proven bounds" in out, out


@pytest.mark.parametrize("command", ["audit", "estimate"])
@pytest.mark.parametrize(
    "implementation, says",
    [
        ("no-such-kernel", "transformers cannot build"),
        ("sonicmoe", "experts_implementation sonicmoe runs a CUDA kernel package's experts"),
    ],
)
def test_an_experts_implementation_transformers_cannot_build_is_one_line(
    command: str, implementation: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config's ``experts_implementation`` that transformers refuses to build, or one from a CUDA kernel
    package (which transformers loads only at the first forward), is bad input: one line, exit 2, in the audit
    as in the estimate."""
    from vramguard.workload.models import presets

    data = json.loads(presets()["tiny-mixtral"].read_text())
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({**data, "experts_implementation": implementation}))
    argv = [command, "--model", str(path), "--seq-len", "8", "--batch", "1", "--steps", "1"]
    assert main([*argv, "--device", "cpu"] if command == "audit" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def _fake_rank_figures(config: QLoRAConfig, sharding: Any, rank: int, kind: str) -> Any:
    """``rank``'s row of ``config``'s FSDP2 step on the host's real tensors, in this process under torch's fake
    process group (collectives move nothing; every buffer is real), the routing forced by the audit's own hook
    (:func:`vramguard.workload.routing.forced_routing`): the reference the meta estimate is held to."""
    from vramguard.estimate.distributed import fake_process_group
    from vramguard.step.rank import measure_rank, rank_expectation
    from vramguard.step.request import StepRequest
    from vramguard.workload.routing import forced_routing
    from vramguard.workload.sharding import cpu_mesh

    q = build_qlora(config, sharded=True)
    expected = rank_expectation(q, config)
    with (
        fake_process_group(rank, sharding.world_size),
        forced_routing(q.model, kind, config.batch * config.seq_len),
    ):
        mesh = cpu_mesh(sharding.world_size)
        _, row = measure_rank(q, StepRequest.on_device(config, steps=1), sharding, mesh, rank, 3, expected)
    return row


def test_a_sharded_estimate_of_eager_experts_bounds_each_rank_by_its_forced_routings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``estimate --world-size`` with eager experts runs each rank's step with every forced routing (each rank
    routes its own batch): the rank rows are the highest routing's and equal, byte for byte, the same rank run
    on the host's real tensors with that routing forced; the routing line names the three routings' peaks of
    those real runs."""
    from vramguard.step.report import AuditReport
    from vramguard.units import format_bytes
    from vramguard.workload.sharding import ShardingConfig

    # 80 tokens a rank: no activation has a weight's shape (the ledger would call it a weight copy)
    config = QLoRAConfig(model=eager("tiny-mixtral", tmp_path), seq_len=40, batch=2)
    out = tmp_path / "estimate.json"
    argv = ["estimate", "--model", config.model, "--seq-len", "40", "--batch", "2", "--steps", "1"]
    argv += ["--trainer", "loop"]  # compared with the loop's ranks at its defaults
    sharded = ["--world-size", "2", "--sharding", "fsdp2", "--target", "cpu", "--json", str(out)]
    assert main([*argv, *sharded]) in (0, 1)  # measured, not refused
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
    estimate = AuditReport.from_dict(json.loads(out.read_text()))
    assert estimate.distributed is not None
    sharding = ShardingConfig(world_size=2, sharding="fsdp2")
    rows = {kind: _fake_rank_figures(config, sharding, 0, kind) for kind in ("same", "balanced", "skewed")}
    high = max(rows, key=lambda kind: rows[kind].step_peak_bytes)
    assert rows["same"].step_peak_bytes < rows[high].step_peak_bytes  # routing really decides here
    fields = (
        "step_peak_bytes",
        "saved_bytes",
        "allocator_peak_bytes",
        "phases",
        "terms",
        "gathered_weight_bytes",
    )
    got = estimate.distributed.per_rank[0]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(rows[high], f) for f in fields}
    line = next(n for n in estimate.verdict.notes if n.startswith("routing:"))
    assert f"this estimate is the high {format_bytes(rows[high].step_peak_bytes)}" in line
    assert f"the low {format_bytes(rows['same'].step_peak_bytes)}" in line
    assert f"balanced routing {format_bytes(rows['balanced'].step_peak_bytes)}" in line
    assert " ".join(line.split()) in printed  # and the command prints it


@pytest.mark.parametrize("command", ["estimate", "audit"])
def test_fsdp1_with_lora_on_expert_parameters_is_refused_in_one_line(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT's delta of a wrapped parameter (its ParamWrapper: all-linear on the fused expert stacks) cannot be
    made from FSDP1's flat parameters and fails at the first forward: said in one line, exit 2, by the estimate
    and by the audit before it starts a rank (the ranks' build on meta; a rank's own refusal is relayed, the
    test below). The estimate of the same model with LoRA on modules only runs."""
    argv = [command, "--model", "tiny-mixtral", "--seq-len", "40", "--batch", "2", "--steps", "1"]
    argv += ["--trainer", "loop"]  # the loop's all-linear (trl sft's default targets miss the experts)
    sharded = [
        "--world-size",
        "2",
        "--sharding",
        "fsdp1",
        *(["--device", "cpu"] if command == "audit" else []),
    ]
    from vramguard.bisect import procgroup

    monkeypatch.setattr(procgroup, "run_with_tail", None)  # no rank starts
    assert main([*argv, *sharded]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fsdp1 with LoRA on parameters (experts.down_proj" in err[0], err
    if command == "estimate":
        assert main([*argv, *sharded, "--target-modules", "q_proj,k_proj,v_proj,o_proj", "--quiet"]) == 0


@pytest.mark.parametrize(
    "model, sharding, extra, built",
    [
        ("tiny-llama", "fsdp2", [], False),  # dense: the parent imports no more than it did
        ("tiny-mixtral", "fsdp2", [], True),  # all-linear wraps the expert stacks
        ("tiny-mixtral", "zero3", [], False),  # DeepSpeed's ranks build inside its engine
        ("tiny-mixtral", "fsdp2", ["optim: adamw_8bit"], False),  # FSDP2 refuses it without a build, first
    ],
)
def test_the_ranks_build_is_tried_first_only_where_lora_may_wrap_parameters(
    model: str,
    sharding: str,
    extra: list[str],
    built: bool,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``audit --world-size`` builds the ranks' model on meta before a rank starts only where PEFT may wrap
    parameters (what its build and FSDP1 refuse), and only after what needs no build; here the launcher is a
    stand-in that fails, so the command ends in one line after the ranks would have started."""
    from vramguard.bisect import procgroup
    from vramguard.estimate import distributed as estimate_distributed
    from vramguard.workload.models import may_wrap_parameters

    builds: list[str] = []
    launched: list[list[str]] = []
    real = estimate_distributed.sharded_build

    def build(config: QLoRAConfig, how: Any) -> Any:
        builds.append(config.model_ref)  # the resolved model travels in config.model
        return real(config, how)

    def launcher(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, list[str]]:
        launched.append(cmd)
        return 1, []

    monkeypatch.setattr(estimate_distributed, "sharded_build", build)
    monkeypatch.setattr(procgroup, "run_with_tail", launcher)
    argv = ["audit", "--model", model, "--seq-len", "16", "--batch", "1", "--steps", "1", "--device", "cpu"]
    if extra:  # a TRL config's 8-bit optimizer, which FSDP2's ranks cannot step
        qlora = ["use_peft: true", "load_in_4bit: true", "lora_target_modules: all-linear"]
        (tmp_path / "sft.yaml").write_text("\n".join([*qlora, *extra]) + "\n")
        argv += ["--config", str(tmp_path / "sft.yaml")]
    code = main([*argv, "--world-size", "2", "--sharding", sharding, "--quiet"])
    assert builds == ([model] if built else [])
    assert may_wrap_parameters(QLoRAConfig(model=model)) is (model != "tiny-llama")
    if extra:
        assert code == 2 and not launched and "8-bit optimizers" in capsys.readouterr().err
    elif sharding != "zero3":
        assert code == 3 and len(launched) == 1  # the stand-in launcher's failure
    assert may_wrap_parameters(QLoRAConfig(target_parameters="mlp.down_proj.weight"))


def test_a_rank_whose_build_peft_refuses_writes_why_for_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank of ``audit --world-size`` builds its model before joining the process group; what PEFT refuses
    there (dropout on a ParamWrapper: all-linear on OLMoE's expert stacks) is the rank's exit 2 and a line in
    the run's folder, which the parent raises as one line (this used to end in an internal error, "the 2 ranks
    exited"). The command says it before any rank starts (the ranks' build on meta); the parent's relay is
    what ``run_distributed_audit`` does with a rank's refusal that only the rank sees: here the launcher is
    this process running rank 0 (the launcher's exit code for a failed rank is the killed-rank test's)."""
    from vramguard.audit import distributed
    from vramguard.bisect import procgroup
    from vramguard.workload.sharding import ShardingConfig

    config = QLoRAConfig(model="tiny-olmoe", seq_len=40, batch=2, lora_dropout=0.1, device="cpu")
    sharding = ShardingConfig(world_size=2, sharding="fsdp2")
    ranks: list[str] = []

    def launcher(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, list[str]]:
        assert cmd[-3:-1] == ["vramguard.audit.launch", "ranks"], cmd
        ranks.append(cmd[-1])
        return distributed.run_rank(cmd[-1], 0), []

    monkeypatch.setattr(procgroup, "run_with_tail", launcher)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # a rank's threads, not this session's
    with pytest.raises(UsageError) as refused:
        distributed.run_distributed_audit(config, sharding, steps=1)
    why = str(refused.value)
    assert why.startswith("PEFT refuses this LoRA setup") and "lora_dropout" in why, why
    (spec,) = ranks
    assert not (Path(spec).parent / "store").exists()  # refused before joining the process group
    argv = ["audit", "--model", "tiny-olmoe", "--seq-len", "40", "--batch", "2", "--lora-dropout", "0.1"]
    monkeypatch.setattr(procgroup, "run_with_tail", None)  # no rank starts
    assert main([*argv, "--world-size", "2", "--sharding", "fsdp2", "--device", "cpu", "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"vramguard: error: {why}"


def test_the_trainer_audit_keeps_the_builds_notes(tmp_path: Path) -> None:
    """``vramguard audit --trainer``: the build's notes (which weights are 4-bit, what routing decides) reach
    the report as in the audit's own loop; the callback sees only the model."""
    from vramguard.integrations.trainer_audit import run_trainer_audit

    config = QLoRAConfig(
        model="tiny-mixtral", seq_len=16, batch=1
    )  # grouped_mm: the build's routing line stays
    report = run_trainer_audit(config, steps=1, trainer="trainer", output_dir=tmp_path / "out")
    notes = report.verdict.notes
    assert any(n.startswith("routing: with the grouped_mm experts every expert matmul") for n in notes), notes
    assert any("4-bit (bitsandbytes Linear4bit)" in n for n in notes), notes


@pytest.mark.parametrize("command", ["audit", "estimate"])
@pytest.mark.parametrize(
    "keys, says",
    [
        ({}, "No `target_modules` passed"),  # TRL's default: PEFT's own targets, none for this model
        ({"lora_target_modules": "all-linear", "lora_dropout": 0.05}, "lora_dropout"),  # dropout on experts
    ],
)
def test_a_lora_setup_peft_refuses_is_one_line(
    command: str, keys: dict[str, Any], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TRL config whose LoRA PEFT refuses on this model is bad input, said as PEFT says it: one line, exit 2
    (PEFT refuses the same on the user's own run)."""
    from vramguard.workload.models import presets

    lines = {
        "model_name_or_path": str(presets()["tiny-mixtral"]),
        "max_length": 16,
        "per_device_train_batch_size": 1,
        "use_peft": True,
        "load_in_4bit": True,
        **keys,
    }
    path = tmp_path / "sft.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    assert main([command, "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PEFT refuses this LoRA setup" in err[0] and says in err[0], err


def test_a_trainer_audit_holds_the_drawn_routing_between_the_trainers_own_forced_runs(tmp_path: Path) -> None:
    """``vramguard audit --trainer trainer``: the trainer's step is not the loop's, so its routing bounds are the
    same trainer run again with each forced routing; its routing line holds the drawn peak between them (the
    forced runs' own peaks) and names how they ran. A forced run says it was forced."""
    from vramguard.integrations.trainer_audit import _train, run_trainer_audit
    from vramguard.step.request import StepRequest
    from vramguard.units import format_bytes
    from vramguard.workload.routing import step_peak

    config = QLoRAConfig(model=eager("tiny-mixtral", tmp_path), seq_len=64, batch=2, device="cpu")
    report = run_trainer_audit(config, "trainer", tmp_path / "out", used_by(config), steps=1)
    [line] = [f.message for f in report.verdict.findings if f.message.startswith("routing:")]
    assert "each forced routing a run of this trainer on the CPU" in line, line
    forced = {
        k: run_trainer_audit(config, "trainer", tmp_path / k, used_by(config), steps=1, routing=k)
        for k in ("same", "skewed")
    }
    low, high = (step_peak(forced[k]) for k in ("same", "skewed"))
    assert low < step_peak(report) < high
    # the drawn run came first: the same run after the forced ones peaks as high (no first-run cache counted)
    again, _ = _train(StepRequest.on_device(config, steps=1), "trainer", tmp_path / "again", [])
    assert step_peak(again) == step_peak(report)
    assert f"between the low {format_bytes(low)}" in line and f"the high {format_bytes(high)}" in line, line
    for r in forced.values():
        assert any(f.message.startswith("routing: forced to") for f in r.verdict.findings)


def test_a_routing_given_as_counts_is_checked_and_described() -> None:
    """A search's routing is the tokens per expert: checked to route every token to top_k different experts."""
    from vramguard.workload.routing import counts_of, describe, expert_counts

    assert counts_of("skewed", 8, 2, 4) == expert_counts("skewed", 8, 2, 4)
    assert counts_of((8, 4, 3, 1), 8, 2, 4) == [8, 4, 3, 1]
    for bad in ((8, 4, 3), (9, 4, 2, 1), (8, 4, 3, 2), (8, 9, -1, 0)):
        with pytest.raises(ValueError, match="do not route"):
            counts_of(bad, 8, 2, 4)
    assert describe((8, 4, 3, 1), 2) == "tokens per expert 8, 4, 3, 1"
