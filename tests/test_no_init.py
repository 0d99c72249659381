"""A meta build draws no values (:mod:`vramguard.estimate.no_init`): a meta tensor has none, and each draw
runs torch's Python decomposition for nothing. Tensors of any other device are initialised as ever."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vramguard.estimate.no_init import values_not_drawn


def _draws_on(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    devices: list[str] = []
    uniform, normal = torch.Tensor.uniform_, torch.Tensor.normal_

    def counted(draw: Any) -> Any:
        def drawn(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            devices.append(self.device.type)
            return draw(self, *args, **kwargs)

        return drawn

    monkeypatch.setattr(torch.Tensor, "uniform_", counted(uniform))
    monkeypatch.setattr(torch.Tensor, "normal_", counted(normal))
    return devices


def test_the_meta_build_draws_no_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramguard.estimate.meta import build_meta
    from vramguard.workload.models import QLoRAConfig

    devices = _draws_on(monkeypatch)
    q = build_meta(QLoRAConfig(seq_len=64, batch=2))
    assert q.trainable_parameters(), "the LoRA matrices were made"
    assert "meta" not in devices


def test_the_meta_build_draws_no_loras_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT makes each LoRA matrix on the host, draws it and moves it to its base layer's device: on meta the
    values are dropped, so the build draws none there either (an 8B loop estimate drew 224 x 3 matrices on the
    host: about 1 s of CPU, page faults included); the host build (the tests' reference) still draws its own."""
    from vramguard.estimate.meta import build_meta
    from vramguard.workload.models import QLoRAConfig

    devices = _draws_on(monkeypatch)
    q = build_meta(QLoRAConfig(seq_len=64, batch=2))
    assert devices == [] and {p.device.type for p in q.trainable_parameters()} == {"meta"}
    build_meta(QLoRAConfig(seq_len=64, batch=2), method="lora", device="cpu")
    assert "cpu" in devices


def test_other_devices_are_initialised_as_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _draws_on(monkeypatch)
    with values_not_drawn():
        meta = torch.nn.Linear(8, 8, device="meta")
        host = torch.nn.Linear(8, 8)
        torch.nn.init.zeros_(host.weight)
    assert devices.count("cpu") >= 1 and "meta" not in devices
    assert meta.weight.device.type == "meta" and not host.weight.any()
    torch.nn.init.kaiming_uniform_(torch.empty(4, 4, device="meta"))  # outside the block: drawn
    assert "meta" in devices


def test_a_parameter_left_on_the_host_by_the_trainers_setup_is_named() -> None:
    """The trainer's setup on meta draws no values anywhere: a parameter it left on the host would hold garbage,
    so it is an internal error naming it, not a silent figure (review)."""
    from vramguard.estimate.trainer import _all_on_meta

    model = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"^1\.weight is on cpu"):
        _all_on_meta(model)
    _all_on_meta(torch.nn.Linear(2, 2, device="meta"))
