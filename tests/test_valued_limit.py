""":data:`vramguard.estimate.meta.VALUED_BYTES`: a valued op's result that is a new storage over the limit carries
no host value; one that shares an input's storage (a view, an in-place op's result) is no new storage and keeps
its value whatever its size. Inside ``__torch_dispatch__`` torch has not yet marked a view's output as a view
(``_is_view()`` is False there for ``view``, ``slice``, ``expand``), so the test is the storage, not the flag."""

from __future__ import annotations

import pytest
import torch

from vramguard.estimate import meta


def test_a_view_or_in_place_result_of_a_large_valued_tensor_keeps_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meta, "VALUED_BYTES", 1024)
    host = torch.zeros(64, 64, dtype=torch.bool)  # 4 KiB, over the limit
    host[3, :5] = True
    values = meta._RoutedValues()
    with values:
        mask = values.give(host)
        assert mask.view(-1).nonzero().shape == (5, 1)  # a view: its base's value
        assert mask[3:].nonzero().shape == (5, 2)
        assert mask.unsqueeze(-1).expand(64, 64, 8).nonzero().shape == (40, 3)
        assert mask.logical_not_().logical_not_().nonzero().shape == (5, 2)  # in place: the value follows
        with pytest.raises((NotImplementedError, RuntimeError)):  # a new storage over the limit: no value
            mask.clone().nonzero()
        small = values.give(host[:4].clone())  # 256 bytes: a new storage under the limit keeps its value
        assert small.clone().nonzero().shape == (5, 2)
