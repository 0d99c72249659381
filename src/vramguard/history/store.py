"""The results store: benchmark JSON files in a directory tree keyed by library versions and device.

Layout (one file per writer, so concurrent xdist workers never share a file)::

    ROOT/index.jsonl                        one line per record, appended under a file lock
    ROOT/<env key>/<run id>/<writer>-<uuid>.json

A record is written to a temporary file in its final directory, fsynced, then renamed into place
with ``os.replace`` under the lock, after checking the name is free: a reader never sees half a
file and nothing written earlier is overwritten. The directory tree is the source of truth; the
index is a convenience that :meth:`ResultStore.verify` checks against it.

Runs are ordered by a sequence number the store hands out under the lock (``seq`` in the index,
``vramguard_seq`` in every record): the first record of a run id takes the next number, later
records of the same run (other xdist workers) share it. ``@latest`` / ``@previous`` follow that
number, never the clock. Runs written before sequence numbers existed have none; they keep their
old order (by run id) and come before every numbered run.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from vramguard.errors import UsageError

INDEX = "index.jsonl"
LOCK = ".store.lock"
SEQ = "vramguard_seq"
_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_name(text: str) -> str:
    """A path component made of ``[A-Za-z0-9._+-]`` only."""
    return _SAFE.sub("-", text).strip("-.") or "unknown"


def new_run_id() -> str:
    """Readable (UTC time, to the second) and unique by its random suffix; the store orders runs by
    its own sequence number, not by this id."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def env_key(machine_info: dict[str, Any]) -> str:
    """``<device>__<pkg>-<version>_...`` from the ``vramguard`` block of pytest-benchmark's machine info."""
    info = machine_info.get("vramguard") or {}
    device = (
        info.get("gpu_name") or info.get("device") or machine_info.get("cpu", {}).get("brand_raw") or "cpu"
    )
    packages = info.get("packages") or {}
    versions = "_".join(f"{k}-{v}" for k, v in sorted(packages.items()) if v)
    if info.get("cuda"):
        versions += f"_cuda-{info['cuda']}"
    return safe_name(f"{device}__{versions}" if versions else str(device))[:200]


@dataclass(frozen=True)
class Run:
    """All files of one run (one per writer) under one env key."""

    key: str
    run_id: str
    files: tuple[Path, ...] = field(default_factory=tuple)
    seq: int | None = None  # the store's sequence number; None for runs written before it had one


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> dict[str, Any]:
    """A benchmark document; UsageError (one line) if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"no such file: {path}") from None
    except RecursionError:
        raise UsageError(f"cannot read {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError, huge ints
        raise UsageError(
            f"cannot read {path}: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise UsageError(f"{path} is not a benchmark JSON file (no 'benchmarks' list)")
    return data


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several writers' files of the same run."""
    if not docs:
        return {"machine_info": {}, "benchmarks": []}
    merged = dict(docs[0])
    merged["benchmarks"] = [b for d in docs for b in d.get("benchmarks", [])]
    return merged


class ResultStore:
    """A directory of benchmark JSON files; safe for concurrent writers on one filesystem."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @staticmethod
    def is_store(path: Path) -> bool:
        """Whether ``path`` is a results store (it has an index)."""
        return (path / INDEX).is_file()

    def add(self, doc: dict[str, Any], run_id: str | None = None, writer: str = "main") -> Path:
        """Write ``doc`` as a new record and return its path; never replaces an existing file.

        The record's sequence number is taken under the lock: the run's own if the run id is already
        in the store (another writer of the same run), else one more than any run's.
        """
        key = env_key(doc.get("machine_info") or {})
        run_id = safe_name(run_id or doc.get("vramguard_run_id") or new_run_id())
        folder = self.root / key / run_id
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        try:
            with FileLock(str(self.root / LOCK)):
                seq = self._seq_for(run_id)
                record = dict(doc, vramguard_run_id=run_id, vramguard_key=key, vramguard_writer=writer)
                record[SEQ] = seq
                with open(tmp, "w") as fh:
                    json.dump(record, fh, indent=1, sort_keys=True, default=str)
                    fh.flush()
                    os.fsync(fh.fileno())
                final = folder / f"{safe_name(writer)}-{uuid.uuid4().hex[:12]}.json"
                while final.exists():  # astronomically unlikely; never replace a record
                    final = folder / f"{safe_name(writer)}-{uuid.uuid4().hex[:12]}.json"
                os.replace(tmp, final)
                _fsync_dir(folder)
                entry = {
                    "key": key,
                    "run_id": run_id,
                    "seq": seq,
                    "file": str(final.relative_to(self.root)),
                    "benchmarks": len(record.get("benchmarks", [])),
                    "written": time.time(),
                }
                with open(self.root / INDEX, "a") as index:
                    index.write(json.dumps(entry, sort_keys=True) + "\n")
                    index.flush()
                    os.fsync(index.fileno())
        finally:
            if tmp.exists():
                tmp.unlink()
        return final

    def _seq_for(self, run_id: str) -> int:
        """The sequence number of ``run_id``: its own if stored already, else the next one (call under the lock)."""
        runs = self.runs()
        for run in runs:
            if run.run_id == run_id and run.seq is not None:
                return run.seq
        return max((r.seq for r in runs if r.seq is not None), default=0) + 1

    def runs(self) -> list[Run]:
        """Every run in the store, oldest first: by sequence number; runs from before sequence numbers
        (none recorded) first, by run id."""
        out: list[Run] = []
        if not self.root.is_dir():
            return out
        indexed = {e["file"]: e.get("seq") for e in self.index()}
        for key_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for run_dir in sorted(p for p in key_dir.iterdir() if p.is_dir()):
                files = tuple(sorted(run_dir.glob("*.json")))
                if files:
                    seqs = [self._file_seq(f, indexed) for f in files]
                    known = [s for s in seqs if s is not None]
                    out.append(Run(key_dir.name, run_dir.name, files, max(known) if known else None))
        return sorted(out, key=lambda r: (r.seq is not None, r.seq or 0, r.run_id, r.key))

    def _file_seq(self, path: Path, indexed: dict[str, Any]) -> int | None:
        """A record's sequence number: from the index, else (not indexed yet) from the file itself."""
        rel = str(path.relative_to(self.root))
        if rel in indexed:
            seq = indexed[rel]
        else:
            try:
                seq = json.loads(path.read_text()).get(SEQ)
            except (OSError, ValueError, RecursionError, AttributeError):
                return None
        return seq if isinstance(seq, int) and not isinstance(seq, bool) else None

    def _read_index(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The index's well-formed entries, and a problem for every line that is not one."""
        path = self.root / INDEX
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            return [], [f"cannot read {INDEX}: {exc}"]
        entries: list[dict[str, Any]] = []
        problems: list[str] = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError) as exc:
                problems.append(
                    f"bad index line {number}: {(str(exc).splitlines() or ['not JSON'])[0]}"[:300]
                )
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
                problems.append(f"bad index line {number}: not an object with a 'file'")
                continue
            entries.append(entry)
        return entries, problems

    def index(self) -> list[dict[str, Any]]:
        """The index's entries (lines that are not an entry are skipped; :meth:`verify` names them)."""
        return self._read_index()[0]

    def verify(self) -> list[str]:
        """Problems found: bad index lines, index lines without a file, files without an index line."""
        entries, problems = self._read_index()
        files = {str(f.relative_to(self.root)) for run in self.runs() for f in run.files}
        indexed = {e["file"] for e in entries}
        return (
            problems
            + [f"not indexed: {f}" for f in sorted(files - indexed)]
            + [f"indexed but missing: {f}" for f in sorted(indexed - files)]
        )

    def load(self, run: Run) -> dict[str, Any]:
        """The run's benchmark documents merged into one (a run may be written by several processes)."""
        return merge([read_json(f) for f in run.files])

    def select(self, selector: str = "latest") -> Run:
        """``latest``, ``previous`` (the run before the latest) or a run id (or its unique prefix)."""
        runs = self.runs()
        if not runs:
            raise UsageError(f"results store {self.root} holds no runs")
        if selector == "latest":
            return runs[-1]
        if selector == "previous":
            if len(runs) < 2:
                raise UsageError(f"results store {self.root} holds only one run; no previous run")
            return runs[-2]
        matches = [r for r in runs if r.run_id == selector] or [
            r for r in runs if r.run_id.startswith(selector)
        ]
        if len(matches) != 1:
            what = "no run" if not matches else f"{len(matches)} runs"
            raise UsageError(f"{what} in {self.root} match {selector!r} (use latest, previous or a run id)")
        return matches[0]


def load_spec(spec: str) -> tuple[dict[str, Any], str]:
    """A run from ``FILE``, ``RUN_DIR`` (its JSON files merged) or ``STORE[@latest|@previous|@RUN_ID]``.

    A path that exists is taken whole (it may contain ``@``); otherwise the selector is what follows
    the last ``@`` (run ids never contain ``@`` or ``/``). Returns the document and a label for reports.
    """
    try:
        return _load_spec(spec)
    except (OSError, ValueError) as exc:  # a name too long for the filesystem, a NUL byte, ...
        raise UsageError(
            f"cannot read {spec[:200]!r}: {getattr(exc, 'strerror', None) or exc}"[:400]
        ) from None


def _load_spec(spec: str) -> tuple[dict[str, Any], str]:
    path_text, selector = spec, ""
    if "@" in spec and not Path(spec).exists():
        path_text, _, selector = spec.rpartition("@")
        if not selector or "/" in selector:
            raise UsageError(f"no such file or directory: {spec}")
    if not path_text:
        raise UsageError(f"{spec!r}: no file, run directory or results store given")
    path = Path(path_text)
    if path.is_file():
        if selector:
            raise UsageError(f"{spec}: a selector (@...) applies to a results store, not to a file")
        return read_json(path), str(path)
    if not path.is_dir():
        raise UsageError(f"no such file or directory: {path_text}")
    if ResultStore.is_store(path):
        store = ResultStore(path)
        run = store.select(selector or "latest")
        return store.load(run), f"{path}@{run.run_id} ({run.key})"
    if selector:
        raise UsageError(f"{path} is not a results store (no {INDEX}); drop the @{selector}")
    files = sorted(path.glob("*.json"))
    if not files:
        raise UsageError(f"{path} holds no benchmark JSON files")
    return merge([read_json(f) for f in files]), str(path)
