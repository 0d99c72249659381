"""A bounded cache of single-package install directories ("overlays") for ``vramguard bisect``.

Each entry is ``pip install --no-deps --target`` of one (package, version, python tag), so putting it
first on ``PYTHONPATH`` swaps only that package while torch and the rest stay the current environment's.
An entry exists only complete: it is installed into a temporary directory, its marker is written last,
and it is renamed into place; eviction renames it away before deleting. ``filelock`` guards concurrent runs.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from packaging.utils import canonicalize_name
from packaging.version import Version

MARKER = ".vramguard-overlay.json"
STALE_TMP_S = 24 * 3600


def default_cache_dir() -> Path:
    """``$VRAMGUARD_CACHE`` or ``$XDG_CACHE_HOME/vramguard/overlays`` (``~/.cache`` by default)."""
    if env := os.environ.get("VRAMGUARD_CACHE"):
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vramguard" / "overlays"


def python_tag() -> str:
    """Interpreter and machine, e.g. ``cp311-x86_64``: an overlay is only valid for the same pair."""
    impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
    return f"{impl}{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"


class InstallError(Exception):
    """pip could not install the version (its last output lines are the message)."""


@dataclass(frozen=True)
class Overlay:
    """One complete cache entry."""

    path: Path
    package: str
    version: str
    import_names: tuple[str, ...]
    installed_now: bool


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _import_names(target: Path) -> tuple[str, ...]:
    """Top-level importable names in an install dir: the dist name often differs (``PyYAML`` -> ``yaml``)."""
    names = set()
    for child in target.iterdir():
        if child.name.endswith((".dist-info", ".egg-info", ".data")) or child.name in {"bin", "__pycache__"}:
            continue
        if child.name.startswith(".") or child.name.endswith(".pth"):
            continue
        if child.is_dir() and child.name.isidentifier():
            names.add(child.name)
        elif child.suffix == ".py" and child.stem.isidentifier():
            names.add(child.stem)
        elif child.suffix in {".so", ".pyd"} and child.name.split(".")[0].isidentifier():
            names.add(child.name.split(".")[0])
    return tuple(sorted(names))


def _installed_version(target: Path, package: str) -> str | None:
    """Version in the dist-info that pip wrote for ``package`` (None when absent)."""
    want = canonicalize_name(package)
    for meta in target.glob("*.dist-info/METADATA"):
        fields = dict(
            line.split(": ", 1) for line in meta.read_text(errors="replace").splitlines()[:40] if ": " in line
        )
        if canonicalize_name(fields.get("Name", "")) == want:
            return fields.get("Version")
    return None


class OverlayCache:
    """Install-once, LRU-bounded overlays under ``root``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.tmp = self.root / ".tmp"
        self.locks = self.root / ".locks"

    def entry_dir(self, package: str, version: str) -> Path:
        return self.root / canonicalize_name(package) / f"{Version(version)}-{python_tag()}"

    def _lock(self, name: str) -> FileLock:
        self.locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.locks / f"{name}.lock"))

    def lookup(self, package: str, version: str) -> Overlay | None:
        """The complete entry for (package, version), touching its last-use time; None if absent."""
        path = self.entry_dir(package, version)
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            return None
        os.utime(path / MARKER)
        return Overlay(path, package, version, tuple(marker.get("import_names", ())), installed_now=False)

    def get(
        self, package: str, version: str, pip_args: Sequence[str], timeout: float | None = None
    ) -> Overlay:
        """The overlay for (package, version), installing it once; raises InstallError if pip fails."""
        path = self.entry_dir(package, version)
        with self._lock(f"{path.parent.name}-{path.name}"):
            if (found := self.lookup(package, version)) is not None:
                return found
            overlay = self._install(package, version, path, pip_args, timeout)
        self.evict(keep=path)
        return overlay

    def _install(
        self, package: str, version: str, path: Path, pip_args: Sequence[str], timeout: float | None
    ) -> Overlay:
        self.tmp.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{path.parent.name}-{path.name}-", dir=self.tmp))
        try:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(work / "t")]
            cmd += ["--no-input", "--disable-pip-version-check", "--no-warn-script-location", *pip_args]
            cmd.append(f"{package}=={version}")
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                raise InstallError(f"pip install timed out after {timeout} s") from None
            if out.returncode != 0:
                lines = [ln for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
                errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
                raise InstallError(" | ".join(errors[-3:]) or f"pip exited {out.returncode}")
            got = _installed_version(work / "t", package)
            if got is None or Version(got) != Version(version):
                raise InstallError(f"pip installed {package} {got}, not {version}")
            names = _import_names(work / "t")
            marker = {
                "package": package,
                "version": version,
                "python_tag": python_tag(),
                "import_names": list(names),
                "size": _tree_size(work / "t"),
                "installed_at": time.time(),
            }
            (work / "t" / MARKER).write_text(json.dumps(marker, indent=1))
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():  # an incomplete leftover without a marker: never visible as an entry
                self._remove(path)
            os.rename(work / "t", path)
            return Overlay(path, package, version, names, installed_now=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _remove(self, path: Path) -> None:
        """Rename away first so a half-deleted entry is never seen, then delete."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        trash = Path(tempfile.mkdtemp(prefix="evict-", dir=self.tmp))
        os.rename(path, trash / "e")
        shutil.rmtree(trash, ignore_errors=True)

    def entries(self) -> list[tuple[Path, float, int]]:
        """(path, last use, size) of every complete entry."""
        found = []
        if not self.root.is_dir():
            return found
        for marker in self.root.glob(f"*/*/{MARKER}"):
            try:
                size = int(json.loads(marker.read_text()).get("size", 0))
                found.append((marker.parent, marker.stat().st_mtime, size))
            except (OSError, ValueError):
                continue
        return found

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Drop least-recently-used entries until the total fits ``max_bytes``; ``keep`` is never dropped."""
        removed: list[Path] = []
        with self._lock("evict"):
            entries = sorted(self.entries(), key=lambda e: e[1])
            total = sum(size for _, _, size in entries)
            for path, _, size in entries:
                if total <= self.max_bytes:
                    break
                if keep is not None and path == keep:
                    continue
                self._remove(path)
                removed.append(path)
                total -= size
            self._clean_stale_tmp()
        return removed

    def _clean_stale_tmp(self) -> None:
        """Temp dirs left by a killed run (a day old) are removed; live ones belong to other runs."""
        if not self.tmp.is_dir():
            return
        now = time.time()
        for child in self.tmp.iterdir():
            try:
                if now - child.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(child, ignore_errors=True)
            except OSError:
                continue
