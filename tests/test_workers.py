"""``--fit``'s changes in forked worker processes (:mod:`vramguard.estimate.workers`): the same answers as one
after another, nothing printed by a child, no child left behind (an error, the parent killed), and no child hung by
the parent's OpenMP pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from vramguard.errors import UsageError
from vramguard.estimate.workers import WORKERS, Refused, WorkerFailed, map_in_workers, worker_count


def _reaped(pids: list[int]) -> bool:
    """Whether none of ``pids`` is a child of this process any more, running or waiting to be reaped (other
    children of a test worker, such as torch's compile workers, may run)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        return False
    return True


def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value * value


def test_results_come_back_in_order_from_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS, "2")
    results = map_in_workers(_pid_and, list(range(5)))
    assert [square for _, square in results] == [0, 1, 4, 9, 16]  # type: ignore[misc]
    pids = [pid for pid, _ in results]  # type: ignore[misc]
    assert os.getpid() not in pids and _reaped(pids)


def _refuse(value: int) -> int:
    if value == 1:
        raise UsageError("not priced: a one-line refusal")
    return value


_PIDS: list[Path] = []  # where a child of the next test writes its pid (set before the fork)


def _fail_beside_a_sleeper(value: int) -> int:
    """Value 2 fails once the other running child has written its pid; any other never returns (it is ended):
    only the failure can come back, whatever the scheduling."""
    (_PIDS[0] / str(os.getpid())).touch()
    if value == 2:
        for _ in range(3000):  # (the other child was forked beside this one: it writes at once)
            if len(list(_PIDS[0].iterdir())) == 2:
                break
            time.sleep(0.01)
        raise ValueError("an internal error")
    time.sleep(20)  # (ended at once; were the runs after a failure started, the test would fail in ~40 s)
    return value


def test_a_refusal_is_its_message_and_a_failure_raises_after_every_child_ended(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(WORKERS, "2")
    assert map_in_workers(_refuse, [0, 1, 3], refusals=(UsageError,)) == [
        0,
        Refused("UsageError", "not priced: a one-line refusal"),
        3,
    ]
    monkeypatch.setattr(sys.modules[__name__], "_PIDS", [tmp_path])
    with pytest.raises(WorkerFailed, match="ValueError: an internal error"):
        map_in_workers(_fail_beside_a_sleeper, [0, 2, 3, 4], refusals=(UsageError,))
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and _reaped(pids)  # the failing one and the one beside it (ended), not all four


def _noisy(value: int) -> int:
    print("from a child", flush=True)
    print("from a child", file=sys.stderr, flush=True)
    return value


def test_a_child_prints_nothing(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(WORKERS, "2")
    assert map_in_workers(_noisy, [1, 2]) == [1, 2]
    out, err = capfd.readouterr()
    assert "from a child" not in out + err


def test_one_worker_runs_here_and_a_bad_count_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS, "1")
    assert map_in_workers(_pid_and, [3]) == [(os.getpid(), 9)]
    refused = Refused("UsageError", "not priced: a one-line refusal")
    assert map_in_workers(_refuse, [1], refusals=(UsageError,)) == [refused]
    monkeypatch.setenv(WORKERS, "many")
    with pytest.raises(UsageError, match="VRAMGUARD_WORKERS must be a whole number"):
        worker_count(3)
    monkeypatch.delenv(WORKERS)
    assert 1 <= worker_count(3) <= 3 and worker_count(1) == 1


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_parallel_region_in_the_parent_does_not_hang_a_child(tmp_path: Path) -> None:
    """torch's CPU op on 20 M floats runs an OpenMP parallel region in the parent, then in each child: a forked
    child on the parent's pool hangs in it (the child runs torch on one thread)."""
    script = _script(
        tmp_path,
        """
        import torch
        from vramguard.estimate.workers import map_in_workers
        torch.set_num_threads(2)
        assert float(torch.ones(20_000_000).sum()) == 20_000_000
        print(map_in_workers(lambda n: float(torch.ones(n).sum()), [20_000_000, 20_000_000]))
        """,
    )
    env = {**os.environ, WORKERS: "2"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[20000000.0, 20000000.0]"


def test_children_end_with_their_parent(tmp_path: Path) -> None:
    """The parent killed (SIGKILL: no handler runs) while its children run: each child's lifeline closes and the
    children end too, none left running."""
    pids = tmp_path / "pids"
    pids.mkdir()
    script = _script(
        tmp_path,
        f"""
        import os, time
        from vramguard.estimate.workers import map_in_workers

        def sleep(i):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            time.sleep(120)

        map_in_workers(sleep, [0, 1])
        """,
    )
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, WORKERS: "2"})
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p.name) for p in pids.iterdir()]
    assert len(children) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is not running: it waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_fits_changes_are_the_same_in_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--fit`` of a shape that does not fit prices its changes in two worker processes: the document equals
    the one priced one after another in this process."""
    from vramguard.cli.app import main

    docs = []
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS, workers)
        out = tmp_path / f"fit-{workers}.json"
        args = ["estimate", "--model", "tiny-llama", "--seq-len", "64", "--trainer", "loop", "--fit", "2MiB"]
        assert main([*args, "--quiet", "--json", str(out)]) == 1
        doc = json.loads(out.read_text())
        doc.pop("elapsed_s")
        docs.append(doc)
    assert len(docs[0]["estimate"]["fit"]["changes"]) >= 5
    assert docs[1] == docs[0]


def test_a_bad_worker_count_is_refused_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vramguard.cli.app import main

    monkeypatch.setenv(WORKERS, "0")
    assert main(["estimate", "--model", "tiny-llama", "--seq-len", "64", "--trainer", "loop", "--fit", "2MiB"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith("VRAMGUARD_WORKERS must be a whole number of processes, 1 or more; got '0'")


def _unpicklable(value: int) -> Any:
    return lambda: value  # a function made here: pickle refuses it


def test_a_result_that_will_not_pickle_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS, "2")
    with pytest.raises(WorkerFailed, match="Can't pickle|can't pickle|PicklingError|AttributeError"):
        map_in_workers(_unpicklable, [1, 2])


def test_no_process_to_be_had_runs_the_item_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """fork() refused (memory, the process limit): each item runs in this process, its pipes closed."""
    from vramguard.estimate import workers

    def refused() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setenv(WORKERS, "2")
    monkeypatch.setattr(workers, "fork", refused)
    before = len(os.listdir("/proc/self/fd"))
    assert map_in_workers(_pid_and, [2, 3]) == [(os.getpid(), 4), (os.getpid(), 9)]
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_default_count_is_the_cores_and_the_memory_that_holds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """No more children than copies of this process fit in the available memory (each counted whole)."""
    import psutil

    from vramguard.estimate import workers

    monkeypatch.delenv(WORKERS, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    here = psutil.Process().memory_info().rss
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": int(3.5 * here)})())
    assert worker_count(20) == 3
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 100 * here})())
    assert worker_count(20) == workers.MAX_WORKERS
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 0})())
    assert worker_count(20) == 1
