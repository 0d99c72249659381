"""Every technique's context is entered through the registry (:func:`vramguard.step.technique.contexts_of`,
:func:`~vramguard.step.technique.enter_stage`): bf16 autocast, FlashAttention-2 and padding-free rows on the loop's
meta step, a trainer's step and a sharded step's ranks alike; DoRA's note on the measured step is the dora
technique's (``measured``), in every producer's report."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from vramguard.audit.run import run_audit
from vramguard.estimate import techniques
from vramguard.estimate.run import run_estimate
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.sharding import ShardingConfig

SMALL = QLoRAConfig(seq_len=32, batch=1)


def _registry_with(monkeypatch: pytest.MonkeyPatch, name: str, **changes: Any) -> None:
    """The registry with the built-in technique ``name`` changed (``dataclasses.replace``), for this test."""
    assert name in [t.name for t in techniques.BUILT_IN]
    built = tuple(dataclasses.replace(t, **changes) if t.name == name else t for t in techniques.BUILT_IN)
    monkeypatch.setattr(techniques, "registered", lambda: built)


class _Counted:
    """A technique's own context, counted each time a step enters it."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self, model: Any, request: Any) -> Iterator[Any]:
        with self.context(model, request) as seen:
            self.entered += 1
            yield seen


def _counting(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> dict[str, _Counted]:
    counted = {t.name: _Counted(t.context) for t in techniques.BUILT_IN if t.name in names}
    built = tuple(
        dataclasses.replace(t, context=counted[t.name]) if t.name in counted else t for t in techniques.BUILT_IN
    )
    monkeypatch.setattr(techniques, "registered", lambda: built)
    return counted


def test_the_step_runs_under_the_target_autocast_through_the_bf16_technique(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 technique's context is what puts the target's autocast on the step: with it nulled in the
    registry, nothing is routed through autocast and the activations are no longer bf16 (a higher peak)."""
    config = dataclasses.replace(SMALL, mixed_precision="bf16")
    with_autocast = run_estimate(config, steps=1, target="cpu").estimate
    assert with_autocast is not None and with_autocast.forced_decisions["autocast_routed"] > 0
    _registry_with(monkeypatch, "bf16", context=lambda model, request: contextlib.nullcontext())
    without = run_estimate(config, steps=1, target="cpu").estimate
    assert without is not None and "autocast_routed" not in without.forced_decisions
    assert without.step_peak_bytes != with_autocast.step_peak_bytes


FLASH_BF16 = dataclasses.replace(SMALL, mixed_precision="bf16", attn_implementation="flash_attention_2")


def test_a_rank_enters_autocast_and_flash_attention_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramguard.estimate.distributed import run_distributed_estimate

    counted = _counting(monkeypatch, ["bf16", "flash_attention_2"])
    run_distributed_estimate(FLASH_BF16, ShardingConfig(2, "fsdp2"), steps=1, target="cuda", ranks=[0])
    assert {name: c.entered for name, c in counted.items()} == {"bf16": 1, "flash_attention_2": 1}


def test_a_trainers_step_enters_autocast_flash_and_padding_free_through_the_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vramguard.estimate.trainer import run_trainer_estimate

    counted = _counting(monkeypatch, ["bf16", "flash_attention_2", "padding_free"])
    config = dataclasses.replace(FLASH_BF16, padding_free=True, packing=True)
    run_trainer_estimate(config, "sft", steps=1, target="cuda")
    assert {name: c.entered for name, c in counted.items()} == {"bf16": 1, "flash_attention_2": 1, "padding_free": 1}


def test_doras_note_is_the_dora_techniques_in_the_estimate_and_the_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The note comes from the dora technique's ``measured``: replaced in the registry, both reports lose it."""
    config = dataclasses.replace(SMALL, use_dora=True, device="cpu")

    def kinds() -> tuple[list[str], list[str]]:
        estimate = run_estimate(config, steps=1, target="cpu")
        audit = run_audit(config, steps=2)
        return [f.kind for f in estimate.verdict.findings], [f.kind for f in audit.verdict.findings]

    assert all("dora" in found for found in kinds())
    _registry_with(monkeypatch, "use_dora", measured=lambda model, ledger: None)
    assert not any("dora" in found for found in kinds())


def _eager_mixtral(tmp_path: Any) -> QLoRAConfig:
    """tiny-mixtral asking for transformers' eager experts (a loop over the experts hit)."""
    import json
    from pathlib import Path

    import vramguard.workload

    data = json.loads((Path(vramguard.workload.__file__).parent / "presets" / "tiny-mixtral.json").read_text())
    data.pop("description", None)
    path = tmp_path / "tiny-mixtral-eager.json"
    path.write_text(json.dumps({**data, "experts_implementation": "eager"}))
    return QLoRAConfig(model=str(path), seq_len=32, batch=2)


def test_the_routings_bounds_are_the_routing_techniques(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Eager experts whose routing is not forced are priced between their steps with each forced routing: the
    requests are the routing technique's (``bounded_by``), for the estimate and the audit's loop alike; a
    registry whose routing technique names none runs the step as it is (which meta cannot: the loop's ``nonzero``)
    and the audit holds the drawn routing against no bounds."""
    config = _eager_mixtral(tmp_path)

    def routing_line(report: Any) -> str:
        return next(n for n in report.verdict.notes if n.startswith("routing:"))

    bounded = run_estimate(config, steps=1, target="cpu")
    assert "three forced routings" in routing_line(bounded)
    asked: list[str] = []

    def none(request: Any, model: Any) -> dict[str, Any]:
        asked.append(request.target)
        return {}

    _registry_with(monkeypatch, "routing", bounded_by=none)
    with pytest.raises(NotImplementedError, match="nonzero"):  # the experts' loop run as it is: meta cannot draw it
        run_estimate(config, steps=1, target="cpu")
    audit = run_audit(config, steps=1, routing_figures=lambda bounds: pytest.fail("no bounds were asked for"))
    assert len(asked) == 2 and "between the low" not in routing_line(audit)


def test_a_trainers_audit_forces_the_routing_through_the_registry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``run_trainer_audit`` with a forced routing enters the routing technique's context (the hook the loop's
    audit and the meta step enter) and its line is the technique's (``revise``)."""
    from vramguard.integrations.trainer_audit import run_trainer_audit

    counted = _counting(monkeypatch, ["routing"])
    config = dataclasses.replace(_eager_mixtral(tmp_path), device="cpu")
    report = run_trainer_audit(config, "trainer", tmp_path / "out", techniques.used_by(config), steps=1, routing="same")
    assert counted["routing"].entered == 1
    assert any(n.startswith("routing: forced to") for n in report.verdict.notes)
