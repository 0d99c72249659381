""":data:`vramguard.estimate.meta.VALUED_BYTES`: a valued op's result that is a new storage over the limit
carries no host value; one that shares an input's storage (a view, an in-place op's result) is no new storage
and keeps its value whatever its size. Inside ``__torch_dispatch__`` torch has not yet marked a view's output
as a view (``_is_view()`` is False there for ``view``, ``slice``, ``expand``): the test is the storage."""

from __future__ import annotations

import pytest
import torch

from vramguard.estimate import meta


def test_a_view_or_in_place_result_of_a_large_valued_tensor_keeps_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        assert mask.clone().nonzero().shape == (5, 2)  # no larger than a given tensor: a value
        with pytest.raises((NotImplementedError, RuntimeError)):  # a new storage over both: no value
            mask.repeat(2, 1).nonzero()
        small = values.give(host[:4].clone())  # 256 bytes: under the limit, a new storage keeps its value
        assert small.repeat(2, 1).nonzero().shape == (10, 2)


def test_what_the_batch_itself_holds_is_never_too_large_to_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idefics3 finds its real images from the pixels (``(pixel_values == 0.0).sum(...) != n``, after a bf16
    copy) and indexes with them: 17 tiles of 364x364 a row, the bf16 copy of 2 rows is 27 MB, over 16 MiB.
    Scaled down (the tiny batch's copy 640 KB, the limit just under it) the estimate must not change: a result
    no larger than the largest tensor the batch gave keeps its value."""
    pytest.importorskip("trl")
    import json
    from pathlib import Path

    from vramguard.estimate.trainer import run_trainer_estimate
    from vramguard.workload.models import QLoRAConfig

    vlm = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
    model = str(vlm / "tiny-idefics3.json")
    config = QLoRAConfig(model=model, seq_len=256, batch=2, image_size="56x56", target_modules="all-linear")
    docs = []
    for limit in (meta.VALUED_BYTES, 2 * 17 * 3 * 56 * 56 * 2 - 1):  # the bf16 copy of the pixels, over it
        monkeypatch.setattr(meta, "VALUED_BYTES", limit)
        doc = run_trainer_estimate(config, "sft", steps=1, target="cpu").to_dict()
        doc.pop("elapsed_s")
        docs.append(json.dumps(doc, sort_keys=True, default=str))
    assert docs[1] == docs[0]
