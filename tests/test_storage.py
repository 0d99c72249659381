"""Storage identity (views share one key and cost their whole storage), the ctx walk
(``tensors_in``) and residency (parameters, buffers and quantization state, with owner names)."""

from __future__ import annotations

from types import SimpleNamespace

import bitsandbytes as bnb
import torch
from torch import nn

from vramguard.measure.storage import resident_storages, storage_key, storage_nbytes, tensors_in


def test_views_share_one_storage_and_cost_all_of_it() -> None:
    base = torch.zeros(8, 16)  # 8 * 16 * 4 B
    views = [base[2:4], base.t(), base.view(128)[5:9], base[:, 3], base.detach()]
    for v in views:
        assert storage_key(v) == storage_key(base)
        assert storage_nbytes(v) == 8 * 16 * 4
    copy = base[2:4].clone()
    assert storage_key(copy) != storage_key(base)
    assert storage_nbytes(copy) == 2 * 16 * 4


def test_storage_key_distinguishes_meta_tensors() -> None:
    """On meta every data_ptr() is 0; the key must still tell storages apart."""
    a = torch.empty(4, 4, device="meta")
    b = torch.empty(4, 4, device="meta")
    assert a.data_ptr() == b.data_ptr() == 0
    assert storage_key(a) != storage_key(b)
    assert storage_key(a[1]) == storage_key(a)
    assert storage_nbytes(a) == 4 * 4 * 4


def test_tensors_in_containers_and_paths() -> None:
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    assert list(tensors_in(a)) == [("", a)]
    found = list(tensors_in((a, [b, {"k": c}], None, 3)))
    assert [p for p, _ in found] == ["[0]", "[1][0]", "[1][1]['k']"]
    assert all(x is y for (_, x), y in zip(found, (a, b, c), strict=True))
    assert list(tensors_in({"x": d, "n": 1})) == [("['x']", d)]


def test_tensors_in_objects_two_levels_deep() -> None:
    """A QuantState-like object: tensors directly on it and on its nested ``state2`` are found,
    a third object level is not (the depth limit), nor modules or callables."""
    absmax, code, code2, deep = torch.zeros(4), torch.zeros(16), torch.zeros(256), torch.zeros(3)
    level3 = SimpleNamespace(t=deep)
    state2 = SimpleNamespace(code=code2, deeper=level3)
    qs = SimpleNamespace(
        absmax=absmax,
        code=code,
        state2=state2,
        shape=torch.Size([4, 4]),
        blocksize=64,
        module=nn.Linear(2, 2),
        fn=lambda: deep,
    )
    found = {p: t for p, t in tensors_in(qs)}
    assert set(found) == {".absmax", ".code", ".state2.code"}
    assert found[".absmax"] is absmax and found[".state2.code"] is code2
    assert {p for p, _ in tensors_in(qs, depth=1)} == {".absmax", ".code"}
    assert {p for p, _ in tensors_in(qs, depth=3)} == {".absmax", ".code", ".state2.code", ".state2.deeper.t"}
    # a tuple holding the object counts no depth
    assert {p for p, _ in tensors_in((qs,))} == {"[0].absmax", "[0].code", "[0].state2.code"}


def test_tensors_in_survives_cycles() -> None:
    t = torch.zeros(2)
    a = SimpleNamespace(t=t)
    a.me = a
    lst: list[object] = [t]
    lst.append(lst)
    assert [p for p, _ in tensors_in(a)] == [".t"]
    assert [p for p, _ in tensors_in(lst)] == ["[0]"]


def test_resident_storages_of_a_plain_model() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    owners = resident_storages(model)
    expected = {
        model[0].weight: "0.weight",
        model[0].bias: "0.bias",
        model[1].weight: "1.weight",
        model[1].bias: "1.bias",
        model[1].running_mean: "1.running_mean",
        model[1].running_var: "1.running_var",
        model[1].num_batches_tracked: "1.num_batches_tracked",
    }
    assert owners == {storage_key(t): name for t, name in expected.items()}


def test_resident_storages_of_bnb_4bit_include_quant_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        bnb.nn.Linear4bit(
            64, 32, bias=True, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True
        ).to("cpu")
    )
    w = model[0].weight
    qs = w.quant_state
    assert qs.nested
    owners = resident_storages(model)
    expected = {
        w: "0.weight",
        model[0].bias: "0.bias",
        qs.absmax: "0.weight.quant_state.absmax",
        qs.code: "0.weight.quant_state.code",
        qs.offset: "0.weight.quant_state.offset",
        qs.state2.absmax: "0.weight.quant_state.state2.absmax",
        qs.state2.code: "0.weight.quant_state.state2.code",
    }
    assert owners == {storage_key(t): name for t, name in expected.items()}


def test_resident_storages_of_bnb_8bit_include_scb() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False).to("cpu"))
    w = model[0].weight
    assert w.dtype == torch.int8 and w.SCB is not None
    owners = resident_storages(model)
    assert owners[storage_key(w)] == "0.weight"
    assert owners[storage_key(w.SCB)] == "0.weight.SCB"
    assert set(owners) == {storage_key(w), storage_key(w.SCB)}
