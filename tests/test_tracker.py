"""Live-memory tracker: exact CPU peaks of known allocation sequences, nested frames, module
frames, a frozen 4-bit model, and equality of CPU and meta-device results for the same model."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from vramguard.measure.tracker import CpuAllocatorSource, FrameStats, MemoryTracker, StorageTracker

F32, F64, I8 = 4, 8, 1


def test_cpu_peak_of_a_known_sequence_is_exact_to_the_byte() -> None:
    with MemoryTracker("cpu") as tracker:
        with tracker.phase("a") as a_call:
            a = torch.empty(1000, dtype=torch.float32)
            b = torch.empty(10, dtype=torch.float64)
            del a
            c = torch.empty(100, dtype=torch.int8)
        with tracker.phase("b"):
            d = torch.ones(5)
            d.add_(1)  # in place: no new storage
            d_view = d[1:3]  # a view: same storage, counted once
            del d
    peak_a = 1000 * F32 + 10 * F64  # a and b were live together
    after_a = 10 * F64 + 100 * I8
    after_b = after_a + 5 * F32  # d's storage lives on through d_view
    assert tracker.result.peak_bytes == peak_a
    pa, pb = tracker.result.phases["a"], tracker.result.phases["b"]
    assert (pa.calls, pa.start_bytes, pa.end_bytes, pa.peak_bytes, pa.delta_bytes, pa.peak_above_start) == (
        1,
        0,
        after_a,
        peak_a,
        after_a,
        peak_a,
    )
    assert (pb.start_bytes, pb.end_bytes, pb.peak_bytes, pb.delta_bytes, pb.peak_above_start) == (
        after_a,
        after_b,
        after_b,
        5 * F32,
        5 * F32,
    )
    assert (a_call.peak_bytes, a_call.end_bytes) == (peak_a, after_a)
    del b, c, d_view


def test_views_of_storages_made_before_tracking_are_not_allocations() -> None:
    """``weight.t()`` inside F.linear returns a new tensor on the weight's (untracked) storage:
    only the output is allocated. (A regression: the whole weight used to be counted.)"""
    lin = nn.Linear(1000, 10, bias=False)
    x = torch.randn(2, 1000)
    with MemoryTracker("cpu") as tracker:
        y = lin(x)
        w_view = lin.weight[3]
    assert tracker.result.peak_bytes == 2 * 10 * F32
    del y, w_view


def test_freed_storages_are_subtracted_and_frames_nest() -> None:
    with MemoryTracker("cpu") as tracker:
        keep = torch.empty(64, dtype=torch.float32)  # 256 B
        with tracker.phase("outer"):
            for _ in range(2):  # two calls of "inner", aggregated
                with tracker.phase("inner"):
                    tmp = torch.empty(1024, dtype=torch.float32)  # 4096 B, freed inside
                    del tmp
            last = torch.empty(16, dtype=torch.float64)  # 128 B, kept
        assert tracker.current() == 256 + 128
    inner, outer = tracker.result.phases["inner"], tracker.result.phases["outer"]
    assert (inner.calls, inner.peak_bytes, inner.peak_above_start, inner.delta_bytes) == (
        2,
        256 + 4096,
        4096,
        0,
    )
    # the inner peak is folded into the enclosing frame and the whole run
    assert (outer.calls, outer.start_bytes, outer.peak_bytes, outer.end_bytes) == (
        1,
        256,
        256 + 4096,
        256 + 128,
    )
    assert tracker.result.peak_bytes == 256 + 4096
    del keep, last


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _train_step(model: nn.Module, x: torch.Tensor, device: str) -> MemoryTracker:
    with MemoryTracker(device, model=model) as tracker:
        with tracker.phase("forward"):
            loss = model(x).sum()
        with tracker.phase("backward"):
            loss.backward()
        del loss
    return tracker


def test_module_frames_of_a_small_mlp() -> None:
    model, x = _mlp(), torch.randn(4, 16)
    tracker = _train_step(model, x, "cpu")
    mods = tracker.result.modules
    h0, h1, out = 4 * 32 * F32, 4 * 32 * F32, 4 * 8 * F32  # Linear0 out, ReLU out, Linear2 out
    assert (mods["0"].delta_bytes, mods["1"].delta_bytes, mods["2"].delta_bytes) == (h0, h1, out)
    # Sequential drops Linear0's output once ReLU (which saves its result) has run
    assert (mods[""].peak_above_start, mods[""].delta_bytes) == (h0 + h1, h1 + out)
    fwd = tracker.result.phases["forward"]
    # after forward: ReLU's output (saved by Linear2 for its weight gradient) and the scalar loss;
    # the model's output itself is dropped (sum saves nothing)
    assert (fwd.peak_bytes, fwd.end_bytes) == (h0 + h1, h1 + F32)


def test_frozen_4bit_layer_is_tracked_exactly() -> None:
    """Frozen Linear4bit, fp32 compute: forward allocates only its output (the packed weight's
    view is not an allocation); backward dequantizes the weight for grad_input."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    assert not layer.weight.requires_grad
    x = torch.randn(4, 64, requires_grad=True)
    tracker = _train_step(layer, x, "cpu")
    out, loss, ones = 4 * 32 * F32, F32, F32
    dequantized, grad_x = 32 * 64 * F32, 4 * 64 * F32
    fwd, bwd = tracker.result.phases["forward"], tracker.result.phases["backward"]
    # nothing is saved for backward (frozen weight, sum saves no input), so the output is dropped
    assert (fwd.peak_bytes, fwd.end_bytes) == (out + loss, loss)
    assert bwd.peak_bytes == loss + ones + dequantized + grad_x
    assert bwd.end_bytes == loss + grad_x  # x.grad stays; the dequantized copy is gone
    assert x.grad is not None and x.grad.shape == (4, 64)


def _summary(tracker: MemoryTracker) -> dict[str, object]:
    return {
        "peak": tracker.result.peak_bytes,
        "phases": {k: {**v.to_dict(), "name": k} for k, v in tracker.result.phases.items()},
        "modules": {k: v.to_dict() for k, v in tracker.result.modules.items()},
        "allocations": tracker.source.allocations,  # type: ignore[attr-defined]
    }


def test_meta_device_equals_cpu_for_the_same_model() -> None:
    model = _mlp()
    x = torch.randn(4, 16)
    cpu = _summary(_train_step(model, x, "cpu"))
    model.zero_grad(set_to_none=True)
    meta = _summary(_train_step(model.to("meta"), x.to("meta"), "meta"))
    assert cpu == meta
    assert cpu["peak"] > 0


def _linear4bit_on(device: str) -> nn.Module:
    # What works on meta with bitsandbytes 0.50.2: bnb.functional.quantize_4bit / dequantize_4bit
    # and bnb.matmul_4bit all run on meta tensors, and Params4bit.to("meta") moves the packed
    # weight with its (nested) QuantState. Module.to("meta") does not: torch's Module._apply
    # rebuilds the Parameter and fails ("detach() returns ... Tensor"), so the quantized
    # parameter is moved on its own and put back.
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    if device == "meta":
        layer._parameters["weight"] = layer.weight.to("meta")
        assert layer.weight.quant_state.absmax.device.type == "meta"
    return layer


def test_meta_device_equals_cpu_for_a_frozen_4bit_layer() -> None:
    results = {}
    for device in ("cpu", "meta"):
        layer = _linear4bit_on(device)
        x = torch.randn(4, 64, device=device, requires_grad=True)
        results[device] = _summary(_train_step(layer, x, device))
    assert results["cpu"] == results["meta"]


def test_device_filter_ignores_other_devices() -> None:
    tracker = StorageTracker("cpu")
    tracker.start()
    try:
        m = torch.empty(1000, device="meta")
        c = torch.empty(3)
    finally:
        tracker.stop()
    assert tracker.peak() == 3 * F32
    del m, c


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_storages_freed_after_stop_do_not_touch_a_new_run(device: str) -> None:
    tracker = StorageTracker(device)
    tracker.start()
    kept = torch.empty(10, device=device)
    tracker.stop()
    tracker.start()
    del kept  # freed during the second run, allocated in the first: not subtracted
    fresh = torch.empty(2, device=device)
    assert tracker.current() == 2 * F32
    tracker.stop()
    del fresh


def test_tensors_from_python_data_are_allocations() -> None:
    """``torch.tensor(data)`` reaches the dispatcher only as ``lift_fresh`` of a storage it made
    outside; it is still a new allocation (Adam's step counters are made this way)."""
    with MemoryTracker("cpu") as tracker:
        values = torch.tensor([1.0, 2.0, 3.0])  # 3 x fp32
        step = torch.tensor(0.0)  # 1 x fp32
        assert tracker.current() == 3 * 4 + 4
        del values, step
        assert tracker.current() == 0


def _nested(draw_leaf):  # a tree of the containers ops take and return, with tensors and scalars
    from collections import OrderedDict, namedtuple

    from hypothesis import strategies as st

    Pair = namedtuple("Pair", "a b")
    leaf = st.sampled_from([0, 1.5, None, True, "s", torch.float32, torch.device("cpu")]) | draw_leaf
    return st.recursive(
        leaf,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.text(max_size=2), inner, max_size=3)
            | st.dictionaries(st.text(max_size=2), inner, max_size=2).map(OrderedDict)
            | st.tuples(inner, inner).map(lambda ab: Pair(*ab))
        ),
        max_leaves=12,
    )


def test_tensor_leaves_are_exactly_the_tensors_of_torchs_pytree() -> None:
    """The tracker's fast walk finds the tensors ``tree_flatten`` finds (an earlier hand-written walk
    stopped 4 levels deep and lost storages), named tuples and ``torch.return_types`` included."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.utils._pytree import tree_flatten

    from vramguard.measure.tracker import tensor_leaves

    pool = [torch.zeros(2), torch.ones(3), nn.Parameter(torch.zeros(1))]
    deep: object = pool[0]
    for _ in range(9):
        deep = [deep]
    assert [id(t) for t in tensor_leaves(deep)] == [id(pool[0])]
    values, indices = result = torch.zeros(4, 2).max(dim=1)  # a torch.return_types structseq
    assert [id(t) for t in tensor_leaves(result)] == [id(values), id(indices)]

    @settings(max_examples=300, deadline=None)
    @given(_nested(st.sampled_from(pool)))
    def check(tree: object) -> None:
        expected = [id(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
        assert sorted(id(t) for t in tensor_leaves(tree)) == sorted(expected)

    check()


def test_frames_opened_by_hooks_close_out_of_order_with_exact_peaks() -> None:
    """The public frame API (what a trainer callback uses for autograd nodes): two overlapping frames
    closed in the order they were opened each get the peak of their own span."""
    with MemoryTracker("cpu") as tracker:
        from vramguard.measure.tracker import FrameStats

        a = tracker.open_frame(FrameStats("a"))
        x = torch.empty(1000, dtype=torch.uint8)  # 1000 B live in a only
        b = tracker.open_frame(FrameStats("b"))
        assert tracker.open_frames == 3  # the root, a, b
        del x
        y = torch.empty(300, dtype=torch.uint8)
        sa = tracker.close_frame(a)  # a closes first although b opened later
        z = torch.empty(500, dtype=torch.uint8)
        sb = tracker.close_frame(b)
        del y, z
    assert (sa.peak_above_start, sa.delta_bytes) == (1000, 300)
    assert (sb.start_bytes, sb.peak_above_start, sb.delta_bytes) == (1000, 0, -200)  # 1000 at its start
    assert tracker.open_frames == 0


def test_frames_equal_in_value_are_still_different_frames() -> None:
    """Two frames opened at the same bytes with same-named stats (an autograd node type that occurs twice,
    as the callback's backward attribution opens them) are equal as values. Frames were dataclasses
    compared by value, so closing the second removed the first from the open list, and closing the first
    then raised ``ValueError: list.remove(x): x not in list`` (seen on CUDA in a Trainer run, where the
    allocator's rounding makes equal readings common). Each close removes its own frame."""
    from vramguard.measure.tracker import FrameStats

    with MemoryTracker("cpu") as tracker:
        first = tracker.open_frame(FrameStats("node"))
        second = tracker.open_frame(FrameStats("node"))
        held = torch.empty(1024, dtype=torch.uint8)
        assert tracker.close_frame(second).peak_above_start == 1024
        del held
        assert tracker.close_frame(first).peak_above_start == 1024
        assert tracker.open_frames == 1  # the root frame only


# CpuAllocatorSource: the c10 CPU allocator's events, counted by torch's profiler ----------------------
MIB = 1 << 20


def test_allocator_source_counts_a_known_sequence_to_the_byte() -> None:
    with MemoryTracker("cpu", source=CpuAllocatorSource()) as tracker:
        with tracker.phase("a"):
            a = torch.empty(MIB, dtype=torch.uint8)
            b = torch.empty(1000, dtype=torch.float32)
            del a
        with tracker.phase("b"):
            c = torch.empty(10, dtype=torch.float64)
            del b
    pa, pb = tracker.result.phases["a"], tracker.result.phases["b"]
    assert (pa.peak_bytes, pa.end_bytes) == (MIB + 1000 * F32, 1000 * F32)
    assert (pb.start_bytes, pb.peak_bytes, pb.end_bytes) == (1000 * F32, 1000 * F32 + 10 * F64, 10 * F64)
    assert tracker.result.peak_bytes == MIB + 1000 * F32
    assert tracker.source.allocations == 3  # type: ignore[attr-defined]
    del c


def test_allocator_source_counts_from_its_start() -> None:
    """Blocks made before the start are not counted, and freeing them subtracts nothing."""
    before = torch.empty(MIB, dtype=torch.uint8)
    source = CpuAllocatorSource()
    source.start()
    try:
        del before
        assert (source.current(), source.peak()) == (0, 0)
        x = torch.empty(MIB, dtype=torch.uint8)
        assert (source.current(), source.peak()) == (MIB, MIB)
        del x
        assert (source.current(), source.peak()) == (0, MIB)
        source.reset_peak()
        assert source.peak() == 0
    finally:
        source.stop()


def test_allocator_source_sees_a_kernels_scratch_buffer() -> None:
    """``median`` copies its input inside the kernel: the allocator sees the copy, the storage tracker
    (which sees only the tensors ops return) sees the 4-byte result."""
    x = torch.randn(MIB // F32)
    peaks = {}
    for source in (StorageTracker(), CpuAllocatorSource()):
        with MemoryTracker("cpu", source=source) as tracker:
            x.median()
        peaks[type(source).__name__] = tracker.result.peak_bytes
    assert peaks["StorageTracker"] == F32
    assert peaks["CpuAllocatorSource"] >= MIB + F32


def test_allocator_source_equals_the_storage_tracker_on_a_qlora_step() -> None:
    """Phases outside the autograd engine (as ``vramguard audit``'s loop runs them): on a tiny QLoRA step
    the two sources agree on every phase to a few scalars (numbers Python hands to ops, which the
    allocator sees and the storage tracker does not)."""
    from vramguard.workload.models import QLoRAConfig, build_qlora
    from vramguard.workload.training import make_optimizer

    q = build_qlora(QLoRAConfig(model="tiny-llama", seq_len=64, batch=2))
    optimizer = make_optimizer(q)
    results = {}
    for source in (StorageTracker(), CpuAllocatorSource(), StorageTracker(), CpuAllocatorSource()):
        with MemoryTracker("cpu", source=source) as tracker:
            with tracker.phase("forward"):
                loss = q.model(**q.batch(0)).loss
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del loss
        results[type(source).__name__] = tracker.result  # the second round (optimizer state exists)
    storage, allocator = results["StorageTracker"], results["CpuAllocatorSource"]
    for name in ("forward", "backward", "optimizer"):
        s, a = storage.phases[name], allocator.phases[name]
        assert s.peak_above_start > 30_000, name  # something was measured
        assert 0 <= a.peak_bytes - s.peak_bytes <= 256, (name, s.peak_bytes, a.peak_bytes)
        assert 0 <= a.peak_above_start - s.peak_above_start <= 256, name


def test_allocator_source_cannot_be_read_inside_backward() -> None:
    """The engine puts back the profiler state it copied when backward began: a restart in a hook would
    lose events, so reading there raises, and the source still stops cleanly."""
    x = torch.randn(8, requires_grad=True)
    loss = (x * 2).sum()
    tracker = MemoryTracker("cpu", source=CpuAllocatorSource()).__enter__()

    def open_in_backward(*_: object) -> None:
        tracker.open_frame(FrameStats("in backward"))

    loss.grad_fn.register_prehook(open_in_backward)
    with pytest.raises(RuntimeError, match="inside backward"):
        loss.backward()
    tracker.__exit__(None, None, None)
    assert not torch._C._autograd._profiler_enabled()


def test_allocator_source_leaves_torchs_profiler_as_it_found_it() -> None:
    """It refuses to start beside a running profiler, and after it stops no profiler runs. torch's legacy
    profiler stands in for ``torch.profiler`` (the same thread-local profiler state): kineto's hung now and
    then in a long xdist worker on this machine (every thread waiting). Whether ``torch.profiler`` records ops
    afterwards is not checked here any more (it did); the legacy profiler does not (known, see docs/trainer.md)."""
    with torch.autograd.profiler_legacy.profile(), pytest.raises(RuntimeError, match="profiler already runs"):
        CpuAllocatorSource().start()
    with MemoryTracker("cpu", source=CpuAllocatorSource()):
        torch.ones(3).add(1)
    assert not torch._C._autograd._profiler_enabled()
