"""The memory timeline: ``--snapshot`` writes PyTorch's memory-snapshot format, whose replay gives the tracker's
peak to the byte (CPU audit, meta estimate of Llama-3.1-8B), and recording it changes no number of the report.

"The viewer reads it" is checked twice: ``torch.cuda._memory_viz.trace_plot`` renders it, and :func:`viewer`
re-reads it the way PyTorch's viewer (``torch/utils/viz/MemoryViz.js``) does: its unpickler's opcodes and
protocols, ``annotate_snapshot`` (free_requested + free_completed elided into one free; the category
``unknown`` required once any category is used) and ``process_alloc_data`` (the bytes alive at each event:
blocks alive before the trace, then allocs and frees).
"""

from __future__ import annotations

import json
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch

from vramguard.audit.run import run_audit
from vramguard.cli.app import main
from vramguard.estimate.run import run_estimate
from vramguard.measure.events import UNKNOWN, AllocationLog, dump_snapshot
from vramguard.measure.tracker import StorageTracker
from vramguard.step.report import AuditReport
from vramguard.workload.models import QLoRAConfig

SMALL = QLoRAConfig(seq_len=32, batch=1)

#: The opcodes MemoryViz.js's ``unpickle`` handles (any other throws "UNKNOWN OPCODE").
VIEWER_OPCODES = frozenset(
    [
        "APPENDS",
        "BINGET",
        "BININT",
        "BININT1",
        "BININT2",
        "EMPTY_DICT",
        "EMPTY_LIST",
        "FRAME",
        "LONG1",
        "LONG_BINGET",
        "MARK",
        "MEMOIZE",
        "PROTO",
        "SETITEMS",
        "SHORT_BINUNICODE",
        "STOP",
        "TUPLE2",
        "APPEND",
        "NEWFALSE",
        "BINPUT",
        "BINUNICODE",
        "EMPTY_TUPLE",
        "NEWTRUE",
        "NONE",
        "BINFLOAT",
        "TUPLE",
        "TUPLE1",
        "TUPLE3",
        "LONG_BINPUT",
        "LIST",
        "DICT",
        "SETITEM",
    ]
)


class Unreadable(AssertionError):
    """What the viewer would fail on."""


def viewer(data: bytes) -> dict[str, int]:
    """Read a snapshot pickle as PyTorch's viewer does; the bytes it plots for device 0: ``total`` (its
    ``max_size``: blocks alive before the trace included) and ``traced`` (the highest sum of the blocks the
    trace allocated, what vramguard's tracker counts)."""
    ops = list(pickletools.genops(data))
    proto = next((arg for op, arg, _ in ops if op.name == "PROTO"), None)
    if proto is None or not 2 <= proto <= 4:
        raise Unreadable(f"pickle protocol {proto}: the viewer reads 2-4")
    unknown = {op.name for op, _, _ in ops} - VIEWER_OPCODES
    if unknown:
        raise Unreadable(f"opcodes the viewer cannot read: {sorted(unknown)}")
    snap = pickle.loads(data)
    # annotate_snapshot
    categories: list[str] = []
    trace: list[dict[str, Any]] = []
    for t in snap["device_traces"][0]:
        prev = trace[-1] if trace else {}
        if (
            t["action"] == "free_completed"
            and prev.get("action") == "free_requested"
            and prev["addr"] == t["addr"]
        ):
            trace[-1] = {**prev, "action": "free"}
            continue
        if "category" in t and t["category"] not in categories:
            categories.append(t["category"])
        trace.append(t)
    if categories and UNKNOWN not in categories:
        raise Unreadable("categories without 'unknown': annotate_snapshot throws (snapshot.categores)")
    # process_alloc_data, device 0, not plot_segments
    elements: list[dict[str, Any]] = []
    initially: list[int] = []
    actions: list[int] = []
    by_addr: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            elements.append(e)
            by_addr[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif e["action"] in ("free", "free_completed"):
            if e["addr"] in by_addr:
                actions.append(by_addr.pop(e["addr"]))
            else:
                elements.append(e)
                initially.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for seg in snap["segments"]:
        if seg["device"] != 0:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and addr not in by_addr:
                elements.append({"action": "alloc", "addr": addr, "size": b["requested_size"]})
                initially.append(len(elements) - 1)
            addr += b["size"]
    current = set(initially)
    total = best_total = sum(elements[i]["size"] for i in current)
    traced = best_traced = 0
    for i in actions:
        size = elements[i]["size"]
        if i in current:
            current.discard(i)
            total -= size
            if i not in initially:
                traced -= size
        else:
            current.add(i)
            total += size
            traced += size
        best_total = max(best_total, total)
        best_traced = max(best_traced, traced)
    return {"total": best_total, "traced": best_traced}


def trace_plot_renders(snapshot: dict[str, Any]) -> str:
    """``trace_plot``'s page, with the snapshot it embeds checked to be this one."""
    import base64

    from torch.cuda._memory_viz import trace_plot

    page = trace_plot(snapshot)
    start = page.index('"base64": "') + len('"base64": "')
    embedded = base64.b64decode(page[start : page.index('"', start)])
    assert pickle.loads(embedded) == snapshot  # (trace_plot pads with NUL bytes after the STOP)
    return page


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditReport, Path, AllocationLog]:
    out = tmp_path_factory.mktemp("audit")
    events = AllocationLog()
    report = run_audit(SMALL, steps=3, events=events)
    snap = out / "s.pickle"
    snap.write_bytes(dump_snapshot(events.snapshot()))
    return report, snap, events


def test_audit_snapshot_replays_to_the_trackers_peak(
    audited: tuple[AuditReport, Path, AllocationLog],
) -> None:
    report, path, _ = audited
    data = path.read_bytes()
    seen = viewer(data)
    tracker_peak = max(p.peak_bytes for p in report.phases.values())
    assert seen["traced"] == tracker_peak == report.timeline.traced_peak_bytes
    # under the steps' storages, the model's: frozen weights with their quantization state, and the LoRA weights
    lora = sum(p.numel() * p.element_size() for p in _lora_params())
    assert (
        seen["total"]
        == report.totals.model_resident_bytes + lora + tracker_peak
        == report.timeline.peak_bytes
    )
    assert trace_plot_renders(pickle.loads(data)).startswith("\n<!DOCTYPE html>")


def _lora_params() -> list[torch.nn.Parameter]:
    from vramguard.workload.models import build_qlora

    return build_qlora(SMALL).trainable_parameters()


def test_the_snapshot_has_categories_frames_and_plain_types(
    audited: tuple[AuditReport, Path, AllocationLog],
) -> None:
    _, path, _ = audited
    snap = pickle.loads(path.read_bytes())
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    cats = {e["category"] for e in allocs}
    assert {"saved activations", "gradients", "optimizer state", "temporaries"} <= cats
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed", "snapshot"}
    # every saved activation was made inside a module's forward: its innermost frame names the module
    saved = [e for e in allocs if e["category"] == "saved activations"]
    assert saved and all(e["frames"][0]["name"] in ("forward", "backward") for e in saved)
    assert any("layers.0" in e["frames"][0]["filename"] for e in saved)
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert {"weights", "trainable"} <= {b["category"] for b in blocks}

    def plain(v: Any) -> bool:
        if type(v) in (dict,):
            return all(type(k) is str and plain(x) for k, x in v.items())
        if type(v) is list:
            return all(map(plain, v))
        return type(v) in (str, int, float, bool)

    assert plain(snap)


def test_recording_changes_no_number_of_the_report(audited: tuple[AuditReport, Path, AllocationLog]) -> None:
    recorded, _, _ = audited
    plain = run_audit(SMALL, steps=3)
    assert plain.timeline is None
    for name in ("layers", "totals", "phases", "steps", "records", "leak_bytes", "budget"):
        assert getattr(recorded, name) == getattr(plain, name), name


def test_a_lost_free_makes_the_replay_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted fault: the tracker forgets to tell the log about one free. The replay no longer equals the
    tracker's peak (the check above can fail)."""
    original = AllocationLog.free
    dropped: list[int] = []

    def lossy(self: AllocationLog, key: int) -> None:
        if not dropped and len(self.events) > 200:
            dropped.append(key)
            return
        original(self, key)

    monkeypatch.setattr(AllocationLog, "free", lossy)
    events = AllocationLog()
    report = run_audit(QLoRAConfig(seq_len=16, batch=1), steps=2, events=events)
    assert dropped
    seen = viewer(dump_snapshot(events.snapshot()))
    assert seen["traced"] != max(p.peak_bytes for p in report.phases.values())


def test_the_viewer_check_refuses_what_the_viewer_cannot_read() -> None:
    """Each rule of :func:`viewer` can fail: a protocol-5 pickle, a class in the pickle, bytes, and
    categories without ``unknown``."""
    log = AllocationLog()
    snap = log.snapshot()
    assert viewer(dump_snapshot(snap)) == {"total": 0, "traced": 0}
    with pytest.raises(Unreadable, match="protocol 5"):
        viewer(pickle.dumps(snap, protocol=5))
    with pytest.raises(Unreadable, match="opcodes"):
        viewer(pickle.dumps({**snap, "x": QLoRAConfig()}, protocol=4))
    with pytest.raises(Unreadable, match="opcodes"):
        viewer(pickle.dumps({**snap, "x": b"raw"}, protocol=4))
    without = {**snap, "device_traces": [[{"action": "alloc", "addr": 0, "size": 1, "category": "weights"}]]}
    with pytest.raises(Unreadable, match="unknown"):
        viewer(pickle.dumps(without, protocol=4))


def test_cli_audit_writes_the_snapshot_and_the_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap, page, doc = tmp_path / "s.pickle", tmp_path / "a.html", tmp_path / "a.json"
    argv = ["audit", "--model", "tiny-llama", "--seq-len", "16", "--batch", "1", "--steps", "2"]
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    outputs = ["--snapshot", str(snap), "--html", str(page), "--json", str(doc), "--timeline-image", str(png)]
    assert main([*argv, *outputs]) == 0
    report = AuditReport.from_dict(json.loads(doc.read_text()))
    assert report.timeline is not None
    assert viewer(snap.read_bytes())["traced"] == report.timeline.traced_peak_bytes
    assert 'id="peak-run"' in page.read_text()
    assert png.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert f"memory snapshot written to {snap}" in out and f"page written to {page}" in out
    estimate = ["estimate", *argv[1:-2], "--timeline-image", str(svg), "--quiet"]
    assert main(estimate) == 0
    assert svg.read_text().startswith("<svg") and 'id="peak-image"' in svg.read_text()


@pytest.mark.parametrize("flag", ["--snapshot", "--html", "--timeline-image"])
def test_unwritable_timeline_paths_are_one_line_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    assert main(["audit", "--model", "tiny-llama", flag, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {tmp_path} is a directory" in err and "Traceback" not in err


def test_the_timeline_needs_the_storage_tracker(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(["audit", "--model", "tiny-llama", "--trainer", "sft", "--html", str(tmp_path / "x.html")]) == 2
    )
    assert "--trainer loop" in capsys.readouterr().err


class _Fixed:
    """A memory source that reads a fixed figure (the CUDA allocator's place, on a machine without one)."""

    device = "cpu"

    def current(self) -> int:
        return 12345

    def peak(self) -> int:
        return 12345

    def reset_peak(self) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


def test_another_source_keeps_its_figures_and_a_storage_tracker_records_the_events() -> None:
    """With the allocator as the source (CUDA), ``--snapshot``'s events come from a storage tracker of the device's
    type beside it: the tracker's figures stay the source's, the log holds the ops' storages."""
    from vramguard.measure.tracker import MemoryTracker

    events = AllocationLog()
    tracker = MemoryTracker("cpu", source=_Fixed(), events=events)
    with tracker, tracker.phase("forward"):
        x = torch.ones(1000)
        del x
    assert tracker.result.peak_bytes == 12345
    snapshot = events.snapshot()
    sizes = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert 4000 in sizes
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []  # the recorder stopped with the block
    torch.ones(500)
    assert len(events.snapshot()["device_traces"][0]) == len(snapshot["device_traces"][0])


class _FailingStart(_Fixed):
    def start(self) -> None:
        raise RuntimeError("the source cannot start")


class _FailingStop(_Fixed):
    def stop(self) -> None:
        raise RuntimeError("the source cannot stop")


@pytest.mark.parametrize("source", [_FailingStart, _FailingStop])
def test_a_failing_source_leaves_no_recorder_behind(source: type) -> None:
    """Whatever fails in the tracker's entry or exit, the events' recorder (a dispatch mode) is stopped: a later
    test in the same process must not run under it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from vramguard.measure.tracker import MemoryTracker

    with (
        pytest.raises(RuntimeError, match="cannot"),
        MemoryTracker("cpu", source=source(), events=AllocationLog()),
    ):
        torch.ones(10)
    assert _get_current_dispatch_mode_stack() == []


def _estimate_replays(model: str, tmp_path: Path) -> None:
    events = AllocationLog()
    report = run_estimate(QLoRAConfig(model=model, device="cpu"), events=events)
    path = tmp_path / "s.pickle"
    path.write_bytes(dump_snapshot(events.snapshot()))
    est = report.estimate
    assert est is not None and report.timeline is not None
    seen = viewer(path.read_bytes())
    assert seen["traced"] == est.step_peak_bytes
    assert seen["total"] == est.allocator_peak_bytes == report.timeline.peak_bytes
    trace_plot_renders(pickle.loads(path.read_bytes()))


def test_estimate_snapshot_replays_to_its_peaks(tmp_path: Path) -> None:
    """An estimate on meta with every allocation logged: the replay gives the tracker's step peak, and with
    the model's own storages the estimate's allocator peak (the 8B run: ``-m slow``; its time is a
    benchmark, ``benchmarks/test_estimate_speed.py``)."""
    _estimate_replays("tiny-llama", tmp_path)


@pytest.mark.slow
def test_estimate_of_llama_8b_snapshot_replays_to_its_peaks(tmp_path: Path) -> None:
    """The full Llama-3.1-8B step on meta (2 steps at the default shape), every allocation logged."""
    _estimate_replays("llama-3.1-8b", tmp_path)


def test_the_log_follows_the_tracker_event_by_event() -> None:
    """Unit check of the invariant: after every op the log's running sum equals the tracker's current bytes."""
    log = AllocationLog()
    tracker = StorageTracker("cpu")
    tracker.events = log
    tracker.start()
    try:
        readings = []
        a = torch.ones(1000)
        readings.append(tracker.current())
        b = a * 2
        readings.append(tracker.current())
        del a
        readings.append(tracker.current())
        b.resize_(5000)
        readings.append(tracker.current())
        del b
        readings.append(tracker.current())
    finally:
        tracker.stop()
    sums, running = [], 0
    for is_alloc, alloc, _ in log.events:
        running += alloc.size if is_alloc else -alloc.size
        sums.append(running)
    assert readings == [4000, 8000, 4000, 20000, 0]
    assert set(readings) <= set(sums) and sums[-1] == 0
    assert log.replay()[0] == tracker.peak() == 20000


def test_compare_html_takes_two_reports_with_timelines_or_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_timeline, without = tmp_path / "a.json", tmp_path / "b.json"
    report = run_estimate(QLoRAConfig(seq_len=16, batch=1, device="cpu"), events=AllocationLog())
    with_timeline.write_text(json.dumps(report.to_dict()))
    without.write_text(json.dumps({**report.to_dict(), "timeline": None}))
    benchmark, binary = tmp_path / "bench.json", tmp_path / "s.pickle"
    benchmark.write_text(json.dumps({"benchmarks": []}))
    binary.write_bytes(dump_snapshot(AllocationLog().snapshot()))
    page = tmp_path / "c.html"
    for other, why in (
        (without, "has no timeline"),
        (benchmark, "no vramguard audit/estimate --json report"),
        (binary, "not a JSON document"),
        (tmp_path / "missing.json", "No such file"),
    ):
        assert main(["compare", str(with_timeline), str(other), "--html", str(page)]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not page.exists()
    assert main(["compare", str(with_timeline), str(with_timeline), "--html", str(page)]) == 0
    assert capsys.readouterr().out.endswith("(0 B)\n") and page.exists()  # a run against itself: no change


def test_the_trainer_callback_writes_a_snapshot_that_replays_to_its_trackers_peak(tmp_path: Path) -> None:
    from test_integrations import _trainer

    from vramguard.integrations.transformers import VramGuardCallback
    from vramguard.workload.models import build_qlora

    config = QLoRAConfig(model="tiny-llama", seq_len=32, batch=2)
    path = tmp_path / "cb.pickle"
    cb = VramGuardCallback(table=False, snapshot_path=path)
    q = build_qlora(config)
    lora = sum(p.numel() * p.element_size() for p in q.trainable_parameters())
    trainer = _trainer(q, cb, tmp_path, steps=2, per_device_train_batch_size=config.batch)
    trainer.train()
    assert cb.report is not None and cb.report.timeline is not None and cb._tracker is not None
    seen = viewer(path.read_bytes())
    assert seen["traced"] == cb._tracker.result.peak_bytes == cb.report.timeline.traced_peak_bytes
    assert seen["total"] == cb.report.totals.model_resident_bytes + lora + seen["traced"]
    snap = pickle.loads(path.read_bytes())
    cats = {e.get("category") for e in snap["device_traces"][0]}
    assert {"saved activations", "gradients", "optimizer state"} <= cats
    trace_plot_renders(snap)


def test_the_callbacks_snapshot_needs_the_storage_tracker(tmp_path: Path) -> None:
    from vramguard.errors import UsageError
    from vramguard.integrations.transformers import VramGuardCallback

    with pytest.raises(UsageError, match="cpu_source='storage'"):
        VramGuardCallback(snapshot_path=tmp_path / "s.pickle", cpu_source="allocator")
    with pytest.raises(UsageError, match="is a directory"):
        VramGuardCallback(snapshot_path=tmp_path)


def _phase(event: dict[str, Any]) -> tuple[str, str] | None:
    """(step, phase) of an event from its phase-call frame, e.g. ("<step 1>", "forward")."""
    for f in event["frames"]:
        if f["filename"].startswith("<step "):
            return f["filename"], f["name"]
    return None


def test_the_categories_hold_the_ledgers_bytes(audited: tuple[AuditReport, Path, AllocationLog]) -> None:
    """Not only the category names: at the end of the first forward the storages labelled "saved
    activations" that are alive add up to the ledger's saved bytes exactly, and at the end of the first
    optimizer step the "optimizer state" alive is AdamW's two fp32 moments and step count of every LoRA
    parameter."""
    report, path, _ = audited
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    alive: dict[int, tuple[int, str]] = {}
    first_end: dict[str, dict[str, int]] = {}  # phase -> the bytes per category at the end of its first call
    calls: list[tuple[str, str]] = []
    for e in trace:
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], e["category"])
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
        else:
            continue
        phase = _phase(e)
        if phase is None or e["action"] != "alloc":  # a free carries its allocation's frames, not its time's
            continue
        if phase not in calls:
            calls.append(phase)
        if sum(1 for c in calls if c[1] == phase[1]) == 1:  # still this phase's first call
            sums: dict[str, int] = {}
            for size, cat in alive.values():
                sums[cat] = sums.get(cat, 0) + size
            first_end[phase[1]] = sums
    assert first_end["forward"].get("saved activations", 0) == report.totals.saved_bytes
    lora = _lora_params()
    moments = 2 * sum(p.numel() * 4 for p in lora) + 4 * len(lora)  # exp_avg, exp_avg_sq; a float32 step each
    assert first_end["optimizer"].get("optimizer state", 0) == moments


@pytest.mark.parametrize("command", ["audit", "estimate"])
def test_the_timeline_of_a_sharded_run_is_refused_in_one_line(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--snapshot``/``--html`` record one process's allocations: with ``--world-size`` they are refused
    before anything runs, in one line."""
    args = [command, "--model", "tiny-llama", "--world-size", "2", "--sharding", "fsdp2"]
    assert main([*args, "--snapshot", str(tmp_path / "s.pickle")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--world-size" in err[0]
    assert not (tmp_path / "s.pickle").exists()


def test_the_picture_and_the_phase_table_say_what_their_peaks_count(
    audited: tuple[AuditReport, Path, AllocationLog],
) -> None:
    """The page's peak counts the model's storages, the phase table's does not (7.28 vs 6.44 MiB for the README's
    audit, unsaid): each says which, and the page gives both."""
    import io

    from vramguard.units import format_bytes
    from vramguard.view.console import text_console
    from vramguard.view.report import audit_phases
    from vramguard.view.timeline import render_run_html

    report, _, _ = audited
    t = report.timeline
    assert t is not None and t.peak_bytes > t.traced_peak_bytes
    buf = io.StringIO()
    audit_phases(report, text_console(buf, width=300))
    assert "the steps' storages, not the model's weights" in " ".join(buf.getvalue().split())
    page = " ".join(render_run_html(report).split())
    assert f"together, {format_bytes(t.peak_bytes)}" in page
    assert f"without them, is {format_bytes(t.traced_peak_bytes)}" in page
