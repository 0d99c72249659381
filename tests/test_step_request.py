"""One step request (:class:`vramguard.step.request.StepRequest`), validated once at construction, is what the
estimate's runs and the audit take; a config with options still makes one."""

from __future__ import annotations

import dataclasses

import pytest

from vramguard.audit.run import run_audit
from vramguard.errors import UsageError
from vramguard.estimate.run import run_estimate
from vramguard.step.request import StepRequest
from vramguard.workload.models import ModelSpec, QLoRAConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target": "tpu"}, "target must be one of cuda, cpu, got 'tpu'"),
        ({"steps": 0}, "steps must be at least 1, got 0"),
        ({"routing": "same"}, "routing forced to same, but tiny-llama has no experts to route"),
        ({"config": QLoRAConfig(seq_len=0)}, "seq-len must be positive, got 0"),
    ],
    ids=["target", "steps", "routing-on-a-dense-model", "config"],
)
def test_a_request_is_refused_at_construction(changes: dict, message: str) -> None:
    fields = {"config": QLoRAConfig(), **changes}
    with pytest.raises(UsageError) as err:
        StepRequest(**fields)
    assert str(err.value) == message


def test_a_request_holds_its_model_resolved_and_stays_resolved_when_derived() -> None:
    request = StepRequest(QLoRAConfig(model="tiny-llama"), target="cpu", steps=1)
    assert isinstance(request.config.model, ModelSpec)
    derived = dataclasses.replace(request, one_sequence_per_row=True)
    assert derived.config.model is request.config.model  # validated again, not resolved again
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.steps = 2  # type: ignore[misc]


def test_of_applies_the_config_overrides() -> None:
    request = StepRequest.of(QLoRAConfig(), method="lora", optimizer=None, target="cpu", steps=1)
    assert (request.config.method, request.config.optimizer, request.target) == ("lora", "adamw", "cpu")


def _without_time(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "elapsed_s"}


def test_run_estimate_takes_a_request_as_it_takes_a_config_and_options() -> None:
    config = QLoRAConfig(seq_len=32, batch=1)
    by_request = run_estimate(StepRequest(config, target="cpu", steps=1), top=2)
    by_options = run_estimate(config, top=2, steps=1, target="cpu")
    assert _without_time(by_request.to_dict()) == _without_time(by_options.to_dict())
    with pytest.raises(TypeError, match="a StepRequest carries its options"):
        run_estimate(StepRequest(config, target="cpu", steps=1), steps=2)


ON_CPU = QLoRAConfig(seq_len=16, batch=1, device="cpu")


def test_the_audit_of_a_request_is_the_audit_of_its_config() -> None:
    """``run_audit(request)`` runs the request's steps on its config's device, as ``run_audit(config, steps=)``."""
    request = StepRequest.on_device(ON_CPU, steps=1)
    assert (request.target, request.device, request.steps) == ("cpu", "cpu", 1)
    by_request, by_config = run_audit(request), run_audit(ON_CPU, steps=1)
    assert len(by_request.steps) == len(by_config.steps) == 1
    assert by_request.totals == by_config.totals and by_request.phases == by_config.phases


def test_a_request_refuses_what_the_audit_cannot_take() -> None:
    """A meta request is the estimate's, not the audit's; a request carries its options; a bad device is named
    first (the config is validated before the target is read from it)."""
    with pytest.raises(UsageError, match="not on meta"):
        run_audit(StepRequest(ON_CPU, target="cpu"))
    with pytest.raises(TypeError, match="carries its options"):
        run_audit(StepRequest.on_device(ON_CPU), steps=1)
    with pytest.raises(UsageError, match="device must be cpu or cuda, got 'mps'"):
        StepRequest.on_device(QLoRAConfig(device="mps"))
