"""A bounded cache of single-package install directories ("overlays") for ``vramguard bisect``.

Each entry is ``pip install --no-deps --target`` of one (package, version, python tag), or of one commit
of a local clone built by :mod:`vramguard.bisect.commits` (``git-<sha>-<python tag>``), so putting it
first on ``PYTHONPATH`` swaps only that package while torch and the rest stay the current environment's.
An entry exists only complete: it is installed into a temporary directory, its marker is written last,
and it is renamed into place; eviction renames it away before deleting. ``filelock`` guards concurrent runs.

pip runs in its own process group that dies with this process (:mod:`vramguard.bisect.procgroup`), with its own
temporary files inside the install's temporary directory. That directory is named after the entry's lock,
held for the whole install, so the next run removes what a killed install left (the lock is free) and
never what a running one is using (the lock is held).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout
from packaging.utils import canonicalize_name
from packaging.version import Version

from vramguard.bisect.procgroup import run_with_tail
from vramguard.errors import UsageError

MARKER = ".vramguard-overlay.json"
#: A temporary folder whose owner cannot be told (not made by this version) is removed after a day.
STALE_TMP_S = 24 * 3600
#: Separates the entry's lock name from mkdtemp's random part in an install's temporary folder.
_TMP_SEP = "~"
#: Bytes of pip's output searched for its error lines.
PIP_TAIL_BYTES = 64 * 1024
#: The exception line of a traceback in pip's output (a build backend's error), e.g. "RuntimeError: ...".
_RAISED = re.compile(r"\s*(\w+\.)*\w*(Error|Exception): \S")


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


def pip_install(
    target: Path, args: Sequence[str], work: Path, timeout: float | None, env: dict[str, str] | None = None
) -> None:
    """``pip install --no-deps --target target ARGS``, pip's temporary files in ``work``; InstallError with
    pip's error lines when it fails."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target)]
    cmd += ["--no-input", "--disable-pip-version-check", "--no-warn-script-location", *args]
    (work / "pip-tmp").mkdir(exist_ok=True)
    # pip's own temp files die with `work`
    full_env = dict(os.environ if env is None else env, TMPDIR=str(work / "pip-tmp"))
    code, tail = run_with_tail(cmd, full_env, timeout, max_lines=10**6, max_bytes=PIP_TAIL_BYTES)
    if code is None:
        raise InstallError(f"pip install timed out after {timeout} s")
    if code != 0:
        lines = [ln[:500] for ln in tail if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
        # a build backend's failure: pip's last lines only say "see above"; its exception line says why
        raised = [ln.strip() for ln in lines if _RAISED.match(ln)][-1:]
        raise InstallError(" | ".join(raised + errors[-3:]) or f"pip exited {code}")


class OverlayCache:
    """Install-once, LRU-bounded overlays under ``root``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.tmp = self.root / ".tmp"
        self.locks = self.root / ".locks"

    def entry_dir(self, package: str, version: str) -> Path:
        """The folder of the entry for (package, version) on this interpreter and machine, whether or not it
        exists."""
        return self.root / canonicalize_name(package) / f"{Version(version)}-{python_tag()}"

    def _lock(self, name: str) -> FileLock:
        self.locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.locks / f"{name}.lock"))

    def prepare(self) -> list[Path]:
        """Create the cache's folders, check they can be written, remove what killed runs left behind.

        Raises OSError when the cache cannot be used (a file, a read-only folder); returns what was removed.
        """
        for folder in (self.root, self.tmp, self.locks):
            folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=self.root)
        os.close(fd)
        os.unlink(probe)
        return self.clean_tmp()

    def open(self, flag: str) -> None:
        """:meth:`prepare` for a command: the cache must be a folder this process can write to (else one
        line naming ``flag``, the option or "overlay cache"), with the ``.logs`` and ``.runs`` folders of
        bisect and sweep logs."""
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"{flag} {self.root}: not a directory")
        try:
            self.prepare()
            for folder in (".logs", ".runs"):
                (self.root / folder).mkdir(exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{flag} {self.root}: cannot write there ({exc.strerror or exc})") from None

    def commit_entry_dir(self, package: str, sha: str, build: str = "") -> Path:
        """The folder of the entry for one commit's build of ``package`` by the build command ``build`` on this
        interpreter and machine: another command (a CUDA build after a CPU one) is another entry."""
        how = hashlib.sha256(build.encode()).hexdigest()[:12]
        return self.root / canonicalize_name(package) / f"git-{sha}-{how}-{python_tag()}"

    def lookup(self, package: str, version: str) -> Overlay | None:
        """The complete entry for (package, version), touching its last-use time; None if absent."""
        return self._lookup(self.entry_dir(package, version), package)

    def _lookup(self, path: Path, package: str) -> Overlay | None:
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            return None
        os.utime(path / MARKER)
        names = tuple(marker.get("import_names", ()))
        return Overlay(path, package, str(marker.get("version", "")), names, installed_now=False)

    def get_commit(
        self,
        package: str,
        sha: str,
        fill: Callable[[Path, Path], None],
        timeout: float | None = None,
        build: str = "",
    ) -> Overlay:
        """The overlay of commit ``sha``, built once: ``fill(work, target)`` builds it in the scratch folder
        ``work`` and installs it into ``target`` (raising InstallError when it cannot); the version is the
        one the build installed."""
        path = self.commit_entry_dir(package, sha, build)
        with self._lock(f"{path.parent.name}-{path.name}"):
            if (found := self._lookup(path, package)) is not None:
                return found
            overlay = self._publish(package, None, path, lambda work: fill(work, work / "t"), {"commit": sha})
        self.evict(keep=path)
        return overlay

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
        def fill(work: Path) -> None:
            pip_install(work / "t", [*pip_args, f"{package}=={version}"], work, timeout)

        return self._publish(package, version, path, fill, {})

    def _publish(
        self,
        package: str,
        version: str | None,
        path: Path,
        fill: Callable[[Path], None],
        extra: dict[str, str],
    ) -> Overlay:
        """Make the entry ``path``: ``fill(work)`` installs into ``work / "t"``, which must then hold
        ``package`` (at ``version`` when given); the marker is written last and the folder renamed into place."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        # Named after the entry's lock (held by the caller): clean_tmp() tells a leftover from a live install.
        work = Path(tempfile.mkdtemp(prefix=f"{path.parent.name}-{path.name}{_TMP_SEP}", dir=self.tmp))
        try:
            fill(work)
            got = _installed_version(work / "t", package) if (work / "t").is_dir() else None
            if version is None and got is None:
                raise InstallError(
                    f"the build installed no {package} (no {package} dist-info in the overlay)"
                )
            if version is not None and (got is None or Version(got) != Version(version)):
                raise InstallError(f"pip installed {package} {got}, not {version}")
            version = version if version is not None else str(got)
            names = _import_names(work / "t")
            marker = {
                **extra,
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
                os.rename(path, work / "old")  # deleted with `work`
            os.rename(work / "t", path)
            return Overlay(path, package, version, names, installed_now=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _remove(self, path: Path) -> None:
        """Rename away first so a half-deleted entry is never seen, then delete (under the evict lock)."""
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
            self._clean_tmp()
        return removed

    def clean_tmp(self) -> list[Path]:
        """Remove what killed runs left in the temporary folder; return what was removed.

        An install's folder is removed when its entry's lock is free (no install of that entry is running:
        its owner was killed); an interrupted eviction's folder when the evict lock is free (it was only
        ever being deleted); anything else once it is a day old.
        """
        with self._lock("evict"):
            return self._clean_tmp()

    def _clean_tmp(self) -> list[Path]:
        removed: list[Path] = []
        if not self.tmp.is_dir():
            return removed
        for child in sorted(self.tmp.iterdir()):
            if _TMP_SEP in child.name:
                lock = self._lock(child.name.rsplit(_TMP_SEP, 1)[0])
                try:
                    lock.acquire(timeout=0)
                except (Timeout, OSError):
                    continue  # that entry is being installed right now
                try:
                    shutil.rmtree(child, ignore_errors=True)
                finally:
                    lock.release()
            elif child.name.startswith("evict-"):
                shutil.rmtree(child, ignore_errors=True)
            else:
                try:
                    if time.time() - child.stat().st_mtime <= STALE_TMP_S:
                        continue
                except OSError:
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            if not os.path.lexists(child):
                removed.append(child)
        return removed
