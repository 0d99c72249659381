"""The results store never loses or overwrites a record, even with many simultaneous writers."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from vramguard.errors import UsageError
from vramguard.store import ResultStore, env_key, load_spec

WRITERS = 6
RECORDS_EACH = 8


def _doc(writer: int, n: int, bnb: str = "0.50.2") -> dict:
    return {
        "machine_info": {
            "vramguard": {"device": "cpu", "packages": {"torch": "2.13.0", "bitsandbytes": bnb}}
        },
        "benchmarks": [
            {
                "name": f"test_x[w{writer}-{n}]",
                "params": {"w": writer, "n": n},
                "extra_info": {"vramguard": {"metrics": {"peak_allocated": 1000 + n}}},
            }
        ],
    }


def _write_many(root: str, writer: int, barrier: mp.synchronize.Barrier) -> None:
    store = ResultStore(root)
    barrier.wait()  # start together, to maximise contention
    for n in range(RECORDS_EACH):
        store.add(_doc(writer, n), run_id="20260101T000000Z-run", writer=f"gw{writer}")


def test_concurrent_writers_lose_no_record(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), w, barrier)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = ResultStore(tmp_path)
    runs = store.runs()
    assert len(runs) == 1  # one env key, one run id: every writer's files form one run
    files = runs[0].files
    assert len(files) == WRITERS * RECORDS_EACH
    names = {b["name"] for b in store.load(runs[0])["benchmarks"]}
    assert names == {f"test_x[w{w}-{n}]" for w in range(WRITERS) for n in range(RECORDS_EACH)}
    assert len(store.index()) == WRITERS * RECORDS_EACH
    assert store.verify() == []
    assert not list(tmp_path.rglob(".tmp-*"))  # no half-written leftovers


def test_same_document_twice_makes_two_records(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    first = store.add(_doc(0, 0), run_id="r1")
    before = first.read_text()
    second = store.add(_doc(0, 0), run_id="r1")
    assert first != second
    assert first.read_text() == before  # the earlier record is untouched
    assert len(store.runs()[0].files) == 2


def test_keyed_by_versions_and_device(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    a = store.add(_doc(0, 0, bnb="0.49.2"))
    b = store.add(_doc(0, 0, bnb="0.50.0"))
    assert a.parent.parent != b.parent.parent
    assert "bitsandbytes-0.49.2" in a.parent.parent.name and "cpu" in a.parent.parent.name
    gpu = env_key({"vramguard": {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "packages": {}}})
    assert "/" not in gpu and " " not in gpu and gpu.startswith("NVIDIA-H100")


def test_select_latest_previous_and_by_id(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.add(_doc(1, 0), run_id="20260101T000000Z-aaaa")
    store.add(_doc(2, 0), run_id="20260102T000000Z-bbbb")
    assert store.select("latest").run_id.endswith("bbbb")
    assert store.select("previous").run_id.endswith("aaaa")
    assert store.select("20260101").run_id.endswith("aaaa")
    doc, _ = load_spec(f"{tmp_path}@previous")
    assert doc["benchmarks"][0]["params"] == {"w": 1, "n": 0}
    with pytest.raises(UsageError, match="match"):
        store.select("2026")  # ambiguous


def test_empty_store_and_bad_files_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "index.jsonl").write_text("")
    with pytest.raises(UsageError, match="no runs"):
        load_spec(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        load_spec(str(bad))
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(UsageError, match="not a benchmark JSON"):
        load_spec(str(bad))
