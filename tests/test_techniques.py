"""Techniques as values in one registry (:mod:`vramguard.estimate.techniques`): each is one module with a
:class:`~vramguard.step.technique.Technique`, and one added through the ``vramguard.techniques`` entry-point group
reaches the estimate's step (its context, at its stage), its report (its findings) and ``--fit`` (its cheaper
alternative) with no other change."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vramguard.estimate import techniques
from vramguard.estimate.fit import cheaper_changes
from vramguard.estimate.run import run_estimate
from vramguard.step.patching import patched
from vramguard.step.report import Finding
from vramguard.step.technique import Place, Technique
from vramguard.workload.models import QLoRAConfig


def test_the_built_in_techniques_in_their_declared_order() -> None:
    assert [t.name for t in techniques.BUILT_IN] == [
        "offload_activations", "use_liger_kernel", "routing", "use_dora", "bf16", "flash_attention_2", "padding_free"
    ]
    assert [t.stage for t in techniques.BUILT_IN] == ["under", "around", "around", "around", "around", "under", "under"]
    assert techniques.used_by(QLoRAConfig()) == []
    used = techniques.used_by(QLoRAConfig(offload_activations=True, use_liger_kernel=True))
    assert [t.name for t in used] == ["offload_activations", "use_liger_kernel"]
    used = techniques.used_by(QLoRAConfig(mixed_precision="bf16", attn_implementation="flash_attention_2", padding_free=True))
    assert [t.name for t in used] == ["bf16", "flash_attention_2", "padding_free"]


def test_routing_applies_to_a_mixture_of_experts_and_dora_to_its_adapters() -> None:
    """The routing technique is a mixture of experts' (its routing can be forced), DoRA's the config's flag; DoRA
    says why the analytic model does not price it (the reason the report gives)."""
    assert [t.name for t in techniques.used_by(QLoRAConfig(model="tiny-mixtral"))] == ["routing"]
    assert [t.name for t in techniques.used_by(QLoRAConfig(use_dora=True))] == ["use_dora"]
    assert techniques.dora.TECHNIQUE.unmodelled == "no analytic model for DoRA (use_dora): measured only"


def test_a_stage_outside_the_declared_ones_is_refused() -> None:
    with pytest.raises(ValueError, match="stage must be one of around, under, got 'over'"):
        Technique("x", "a test technique", "over", lambda c: True, lambda m, r: contextlib.nullcontext())


class _Holds:
    """A probe technique's context: a meta tensor of ``nbytes`` made when entered and kept to the end."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self, model: Any, request: Any) -> Iterator[dict[str, Any]]:
        self.entered += 1
        held = torch.empty(self.nbytes, dtype=torch.uint8, device="meta")
        yield {"held": held.numel()}


def _probe(holds: _Holds, stage: str) -> Technique:
    return Technique(
        name="probe",
        description="a technique added by an entry point: holds a buffer for the step",
        stage=stage,
        applies=lambda config: config.lora_dropout == 0.0,
        context=holds,
        findings=lambda model, request, seen: [
            Finding("probe", f"probe held {seen['held']:,} B", seen["held"])
        ],
        cheaper=lambda config, place: ("--probe", dataclasses.replace(config, lora_rank=1)),
    )


@pytest.fixture
def registered_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Registers a probe technique through the entry-point group (a stand-in for an installed package's)."""

    def register(technique: Technique) -> None:
        entry = importlib.metadata.EntryPoint("probe", "probe_pkg:TECHNIQUE", techniques.ENTRY_POINT_GROUP)
        monkeypatch.setattr(entry.__class__, "load", lambda self: technique)
        monkeypatch.setattr(
            techniques.importlib.metadata,
            "entry_points",
            lambda group: [entry] if group == techniques.ENTRY_POINT_GROUP else [],
        )
        techniques.registered.cache_clear()

    yield register
    techniques.registered.cache_clear()


@pytest.mark.parametrize(("stage", "counted"), [("under", True), ("around", False)])
def test_a_technique_added_by_an_entry_point_reaches_the_step_the_report_and_fit(
    registered_probe: Any, stage: str, counted: bool
) -> None:
    """Under the tracker its buffer is in the step's figures, around it not; its finding is in the verdict; its
    alternative is among --fit's changes."""
    config = QLoRAConfig(seq_len=32, batch=1)
    plain = run_estimate(config, steps=1, target="cpu").estimate
    holds = _Holds(1 << 20)
    registered_probe(_probe(holds, stage))
    assert [t.name for t in techniques.registered()][-1] == "probe"
    report = run_estimate(config, steps=1, target="cpu")
    assert holds.entered == 1
    assert [f.message for f in report.verdict.findings if f.kind == "probe"] == ["probe held 1,048,576 B"]
    assert report.estimate is not None and plain is not None
    grown = report.estimate.allocator_peak_bytes - plain.allocator_peak_bytes
    assert (grown >= 1 << 20) is counted, grown
    def figure(changed: QLoRAConfig) -> int:
        """The probe's alternative (rank 1) priced by its own meta run, with the probe registered; the other
        changes, which this test does not read, a stand-in (the command-line --fit tests price each)."""
        if changed.lora_rank != 1:
            return report.estimate.total_bytes
        estimate = run_estimate(changed, steps=1, target="cpu").estimate
        assert estimate is not None
        return estimate.total_bytes

    rows = {r["change"]: r for r in cheaper_changes(config, 1, figure, place=Place("cpu"))}
    assert "--probe" in rows and "refused" not in rows["--probe"]


def test_a_technique_that_does_not_apply_is_not_entered(registered_probe: Any) -> None:
    holds = _Holds(1024)
    registered_probe(_probe(holds, "under"))
    report = run_estimate(QLoRAConfig(seq_len=32, batch=1, lora_dropout=0.1), steps=1, target="cpu")
    assert holds.entered == 0
    assert [f for f in report.verdict.findings if f.kind == "probe"] == []


def test_patched_restores_the_original_after_an_error() -> None:
    class Lib:
        value = "original"

    with pytest.raises(RuntimeError), patched(Lib, "value", "patched") as original:
        assert (Lib.value, original) == ("patched", "original")
        raise RuntimeError("inside the block")
    assert Lib.value == "original"


def test_patched_restores_what_the_owner_held() -> None:
    """``patched`` sets back what the owner itself held (a class's classmethod object, not the bound method), deletes
    what it held none of (a base class's attribute, a class's method on an instance), and sets back through an
    owner that stores elsewhere (an ``nn.Module``'s parameter, a transformers config's alias) or a property."""
    import torch
    from transformers import GPT2Config

    from vramguard.step.patching import patched

    class Base:
        @classmethod
        def make(cls) -> str:
            return cls.__name__

        def method(self) -> str:
            return "method"

    class Child(Base):
        pass

    with patched(Base, "make", classmethod(lambda cls: "patched")):
        assert Child.make() == "patched"
    assert Child.make() == "Child" and isinstance(vars(Base)["make"], classmethod)
    with patched(Child, "make", classmethod(lambda cls: "patched")):
        assert Child.make() == "patched"
    assert "make" not in vars(Child) and Child.make() == "Child"
    obj = Base()
    with patched(obj, "method", lambda: "patched"):
        assert obj.method() == "patched"
    assert "method" not in vars(obj) and obj.method() == "method"
    linear = torch.nn.Linear(2, 2)
    weight = linear.weight
    with patched(linear, "weight", torch.nn.Parameter(torch.zeros(2, 2))):
        pass
    assert linear.weight is weight
    config = GPT2Config()
    with patched(config, "hidden_size", 128):
        assert config.n_embd == 128
    assert config.hidden_size == config.n_embd == GPT2Config().n_embd
