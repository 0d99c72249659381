"""The results store never loses or overwrites a record, even with many simultaneous writers."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from vramguard.errors import UsageError
from vramguard.history.store import INDEX, ResultStore, env_key, load_spec

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


def test_a_version_is_read_again_for_another_search_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Versions are read once a process for each search path (environment.package_version): a distribution
    that a new ``sys.path`` entry brings (a release overlaid on ``PYTHONPATH``) is seen, and leaving that
    path again gives the answer of the path before."""
    from vramguard.environment import package_version

    info = tmp_path / "vg_overlaid-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vg-overlaid\nVersion: 1.2.3\n")
    assert package_version("vg-overlaid") is None
    with monkeypatch.context() as m:
        m.syspath_prepend(str(tmp_path))
        assert package_version("vg-overlaid") == "1.2.3"
    assert package_version("vg-overlaid") is None


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


def test_latest_follows_the_order_runs_were_stored_not_their_ids(tmp_path: Path) -> None:
    """Two runs in the same second: the random suffix used to decide which one was 'latest'."""
    store = ResultStore(tmp_path)
    store.add(_doc(1, 0), run_id="20260101T000000Z-ffff")
    store.add(_doc(2, 0), run_id="20260101T000000Z-0000")  # stored second, sorts first by id
    assert store.select("latest").run_id.endswith("0000")
    assert store.select("previous").run_id.endswith("ffff")
    assert [r.seq for r in store.runs()] == [1, 2]
    store.add(_doc(3, 0), run_id="20260101T000000Z-ffff")  # another writer of the first run
    assert [(r.run_id[-4:], r.seq, len(r.files)) for r in store.runs()] == [("ffff", 1, 2), ("0000", 2, 1)]
    record = json.loads(store.select("previous").files[0].read_text())
    assert record["vramguard_seq"] == 1  # the tree, not only the index, knows the order


def test_order_survives_a_lost_index(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.add(_doc(1, 0), run_id="b-run")
    store.add(_doc(2, 0), run_id="a-run")
    (tmp_path / INDEX).write_text("")
    assert [r.run_id for r in store.runs()] == ["b-run", "a-run"]
    store.add(_doc(3, 0), run_id="0-run")
    assert store.select("latest").run_id == "0-run" and store.select("latest").seq == 3


def test_a_store_written_before_sequence_numbers_stays_readable(tmp_path: Path) -> None:
    """Old records carry no sequence number: they keep their old order (by id), new runs follow."""
    key = env_key(_doc(0, 0)["machine_info"])
    lines = []
    for n, run_id in enumerate(["20250102T000000Z-bbbb", "20250101T000000Z-aaaa"]):
        folder = tmp_path / key / run_id
        folder.mkdir(parents=True)
        record = dict(_doc(n, 0), vramguard_run_id=run_id, vramguard_key=key, vramguard_writer="main")
        (folder / "main-000000000000.json").write_text(json.dumps(record))
        lines.append(
            json.dumps({"key": key, "run_id": run_id, "file": f"{key}/{run_id}/main-000000000000.json"})
        )
    (tmp_path / INDEX).write_text("\n".join(lines) + "\n")
    store = ResultStore(tmp_path)
    assert [r.run_id[-4:] for r in store.runs()] == ["aaaa", "bbbb"] and store.verify() == []
    store.add(_doc(5, 0), run_id="20240101T000000Z-cccc")  # an id from the past, stored now
    assert store.select("latest").run_id.endswith("cccc")
    assert store.select("previous").run_id.endswith("bbbb")
    doc, label = load_spec(f"{tmp_path}@20250101")
    assert doc["benchmarks"][0]["params"] == {"w": 1, "n": 0} and "aaaa" in label


def _write_runs(root: str, writer: int, barrier: mp.synchronize.Barrier) -> None:
    store = ResultStore(root)
    barrier.wait()
    for n in range(3):
        store.add(_doc(writer, n), run_id=f"w{writer}-n{n}", writer=f"gw{writer}")


def test_concurrent_runs_get_distinct_increasing_sequence_numbers(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_write_runs, args=(str(tmp_path), w, barrier)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    runs = ResultStore(tmp_path).runs()
    assert [r.seq for r in runs] == list(range(1, 3 * WRITERS + 1))
    for w in range(WRITERS):  # every writer's own runs keep the order it stored them in
        assert [r.run_id for r in runs if r.run_id.startswith(f"w{w}-")] == [f"w{w}-n{n}" for n in range(3)]


def test_verify_reports_bad_index_lines_without_raising(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    store.add(_doc(1, 0), run_id="r1")
    with open(tmp_path / INDEX, "ab") as fh:
        fh.write(b"{not json\n")
        fh.write(b"[1, 2]\n")
        fh.write(b'{"key": "k", "run_id": "r"}\n')  # no 'file'
        fh.write(b"[" * 100_000 + b"\n")  # RecursionError in json
        fh.write(b'{"file": "gone\xff.json"}\n')  # not UTF-8
    problems = store.verify()
    assert [p.split(":")[0] for p in problems] == [
        "bad index line 2",
        "bad index line 3",
        "bad index line 4",
        "bad index line 5",
        "indexed but missing",
    ]
    assert all("\n" not in p and len(p) < 400 for p in problems)
    assert store.select("latest").run_id == "r1"  # the store still reads
    assert len(store.index()) == 2


def test_paths_with_at_signs_still_take_a_selector(tmp_path: Path) -> None:
    root = tmp_path / "ci@host" / "store"
    store = ResultStore(root)
    store.add(_doc(1, 0), run_id="r1")
    store.add(_doc(2, 0), run_id="r2")
    assert load_spec(f"{root}@previous")[0]["benchmarks"][0]["params"]["w"] == 1
    assert load_spec(f"{root}@r2")[0]["benchmarks"][0]["params"]["w"] == 2
    assert load_spec(str(root))[0]["benchmarks"][0]["params"]["w"] == 2  # latest
    odd = tmp_path / "ci@host" / "run@1.json"  # an existing file is taken whole
    odd.write_text(json.dumps(_doc(3, 0)))
    assert load_spec(str(odd))[0]["benchmarks"][0]["params"]["w"] == 3
    with pytest.raises(UsageError, match="no such file"):
        load_spec(f"{tmp_path}/nowhere@latest")
    with pytest.raises(UsageError, match="no such file"):
        load_spec(f"{root}@")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / ("x" * 5000), "cannot read"),
        (lambda p: _text(p / "deep.json", "[" * 100_000), "nested too deeply"),
        (lambda p: _text(p / "big.json", '{"benchmarks": [], "n": ' + "9" * 5000 + "}"), "cannot read"),
        (lambda p: _bytes(p / "bin.json", b"\x80\xff\x00"), "cannot read"),
    ],
)
def test_unreadable_inputs_are_usage_errors(tmp_path: Path, make, message) -> None:
    with pytest.raises(UsageError, match=message):
        load_spec(str(make(tmp_path)))


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
