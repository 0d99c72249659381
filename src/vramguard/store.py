"""The results store: benchmark JSON files in a directory tree keyed by library versions and device.

Layout (one file per writer, so concurrent xdist workers never share a file)::

    ROOT/index.jsonl                        one line per record, appended under a file lock
    ROOT/<env key>/<run id>/<writer>-<uuid>.json

A record is written to a temporary file in its final directory, fsynced, then renamed into place
with ``os.replace`` under the lock, after checking the name is free: a reader never sees half a
file and nothing written earlier is overwritten. The directory tree is the source of truth; the
index is a convenience that :meth:`ResultStore.verify` checks against it.
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
_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_name(text: str) -> str:
    """A path component made of ``[A-Za-z0-9._+-]`` only."""
    return _SAFE.sub("-", text).strip("-.") or "unknown"


def new_run_id() -> str:
    """Sortable by time (UTC, to the second), unique by its random suffix."""
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
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
        return (path / INDEX).is_file()

    def add(self, doc: dict[str, Any], run_id: str | None = None, writer: str = "main") -> Path:
        """Write ``doc`` as a new record and return its path; never replaces an existing file."""
        key = env_key(doc.get("machine_info") or {})
        run_id = safe_name(run_id or doc.get("vramguard_run_id") or new_run_id())
        folder = self.root / key / run_id
        folder.mkdir(parents=True, exist_ok=True)
        record = dict(doc, vramguard_run_id=run_id, vramguard_key=key, vramguard_writer=writer)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            with FileLock(str(self.root / LOCK)):
                final = folder / f"{safe_name(writer)}-{uuid.uuid4().hex[:12]}.json"
                while final.exists():  # astronomically unlikely; never replace a record
                    final = folder / f"{safe_name(writer)}-{uuid.uuid4().hex[:12]}.json"
                os.replace(tmp, final)
                _fsync_dir(folder)
                entry = {
                    "key": key,
                    "run_id": run_id,
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

    def runs(self) -> list[Run]:
        """Every run in the store, oldest first (run ids start with their UTC time)."""
        out: list[Run] = []
        if not self.root.is_dir():
            return out
        for key_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for run_dir in sorted(p for p in key_dir.iterdir() if p.is_dir()):
                files = tuple(sorted(run_dir.glob("*.json")))
                if files:
                    out.append(Run(key_dir.name, run_dir.name, files))
        return sorted(out, key=lambda r: (r.run_id, r.key))

    def index(self) -> list[dict[str, Any]]:
        path = self.root / INDEX
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def verify(self) -> list[str]:
        """Problems found: index lines without a file, files without an index line."""
        files = {str(f.relative_to(self.root)) for run in self.runs() for f in run.files}
        indexed = {e["file"] for e in self.index()}
        return [f"not indexed: {f}" for f in sorted(files - indexed)] + [
            f"indexed but missing: {f}" for f in sorted(indexed - files)
        ]

    def load(self, run: Run) -> dict[str, Any]:
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
        matches = [r for r in runs if r.run_id.startswith(selector)]
        if len(matches) != 1:
            what = "no run" if not matches else f"{len(matches)} runs"
            raise UsageError(f"{what} in {self.root} match {selector!r} (use latest, previous or a run id)")
        return matches[0]


def load_spec(spec: str) -> tuple[dict[str, Any], str]:
    """A run from ``FILE``, ``RUN_DIR`` (its JSON files merged) or ``STORE[@latest|@previous|@RUN_ID]``.

    Returns the document and a label for reports.
    """
    path_text, _, selector = (
        spec.partition("@") if "@" in spec and not Path(spec).exists() else (spec, "", "")
    )
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
