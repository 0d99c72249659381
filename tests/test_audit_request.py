"""The audit takes the step request (issue 43, item 2): one value, validated once, on the config's own device."""

from __future__ import annotations

import pytest

from vramguard.audit.run import run_audit
from vramguard.errors import UsageError
from vramguard.step.request import StepRequest
from vramguard.workload.models import QLoRAConfig

CONFIG = QLoRAConfig(seq_len=16, batch=1, device="cpu")


def test_the_audit_of_a_request_is_the_audit_of_its_config() -> None:
    """``run_audit(request)`` runs the request's steps on its config's device, as ``run_audit(config, steps=)``."""
    request = StepRequest.on_device(CONFIG, steps=1)
    assert (request.target, request.device, request.steps) == ("cpu", "cpu", 1)
    by_request, by_config = run_audit(request), run_audit(CONFIG, steps=1)
    assert len(by_request.steps) == len(by_config.steps) == 1
    assert by_request.totals == by_config.totals and by_request.phases == by_config.phases


def test_a_request_refuses_what_the_audit_cannot_take() -> None:
    """A meta request is the estimate's, not the audit's; a request carries its options; a bad device is named
    first (the config is validated before the target is read from it)."""
    with pytest.raises(UsageError, match="not on meta"):
        run_audit(StepRequest(CONFIG, target="cpu"))
    with pytest.raises(TypeError, match="carries its options"):
        run_audit(StepRequest.on_device(CONFIG), steps=1)
    with pytest.raises(UsageError, match="device must be cpu or cuda, got 'mps'"):
        StepRequest.on_device(QLoRAConfig(device="mps"))
