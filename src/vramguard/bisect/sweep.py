"""One sweep: run one command once per release of a package, each run kept in the results store
(``vramguard sweep`` is :mod:`vramguard.cli.sweep`, a thin layer over this).

Each release is installed once into the overlay cache that ``vramguard bisect`` uses
(:mod:`vramguard.bisect.overlay`: reused by later sweeps, bisections and matrix runs) and put first on
``PYTHONPATH``; torch and everything else stay the current environment's. The command gets the
store and a run id through the environment (``VRAMGUARD_STORE``, ``VRAMGUARD_RUN_ID``), which the
benchmark plugin reads as the default of ``--vram-store`` and as its run id, so a plain
``python -m pytest benchmarks -m benchmark`` writes its records where the sweep looks for them.

Per release the outcome is ``ok`` (exit 0 and a run in the store whose versions name the release),
``skip`` (exit 125, or the overlay is not what gets imported), ``failed`` (any other exit, or exit 0
with nothing stored: missing data is never a pass), ``timeout`` or ``install-failed``. After a run
that stored something, the sweep adds a marker record (``writer`` ``sweep``, no benchmarks) to the
same run with the release, the exit code and the outcome. A rerun skips the releases whose ``ok``
marker is in the store for the same environment (the other tracked library versions, Python,
device), so an interrupted sweep resumes where it stopped. The JSON log is rewritten atomically
after every release. Exit: 0 every release ok or skipped, 1 some release failed, 2 bad input.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from vramguard.bisect.overlay import InstallError, OverlayCache, python_tag
from vramguard.bisect.pkgindex import IndexOptions, available_versions, sort_versions
from vramguard.bisect.run import SKIP_CODE, LoggedRun, check_import, probe_env, run_command
from vramguard.environment import TRACKED_PACKAGES, package_version
from vramguard.errors import UsageError
from vramguard.history.store import ResultStore, new_run_id, read_json

STORE_ENV = "VRAMGUARD_STORE"
RUN_ID_ENV = "VRAMGUARD_RUN_ID"
MARKER_WRITER = "sweep"
INSTALL_TIMEOUT_S = 1800.0
FAILED = ("failed", "timeout", "install-failed")


# -- which releases ---------------------------------------------------------------------------------
def _version(text: str, flag: str) -> Version:
    try:
        return Version(text.strip())
    except InvalidVersion:
        raise UsageError(f"{flag} {text!r} is not a version") from None


def check_release_options(
    versions: str | None = None, start: str | None = None, end: str | None = None, every: int = 1
) -> list[Version]:
    """UsageError (one line) for release options that are wrong whatever the index lists: ``--every`` below
    1, both ``--versions`` and ``--from``/``--to`` or neither, a text that is no version, an empty list or
    range. Returns the versions ``--versions`` lists (empty for a range)."""
    if every < 1:
        raise UsageError(f"--every must be at least 1, not {every}")
    if versions is not None:
        if start is not None or end is not None:
            raise UsageError("give either --versions or --from/--to, not both")
        wanted = [_version(t, "--versions") for t in versions.split(",") if t.strip()]
        if not wanted:
            raise UsageError("--versions lists no version")
        return wanted
    if start is None or end is None:
        raise UsageError("give the releases: --versions A,B,C or --from V1 --to V2 [--every N]")
    if _version(start, "--from") > _version(end, "--to"):
        raise UsageError(f"empty range: --from {start} is newer than --to {end}")
    return []


def select_releases(
    available: Sequence[Version],
    versions: str | None = None,
    start: str | None = None,
    end: str | None = None,
    every: int = 1,
    source: str = "the package index",
) -> list[Version]:
    """The releases to sweep, oldest first.

    ``versions``: a comma-separated list, each of which must be listed by the index. ``start`` /
    ``end``: every release listed between them (inclusive), every ``every``-th one, the last always
    included so both ends of the range are measured. UsageError when nothing is left.
    """
    wanted = check_release_options(versions, start, end, every)
    if wanted:
        unknown = [str(v) for v in wanted if v not in available]
        if unknown:
            raise UsageError(f"--versions: {', '.join(unknown)} not listed by {source}"[:400])
        return sorted(set(wanted))
    assert start is not None and end is not None  # checked above
    lo, hi = _version(start, "--from"), _version(end, "--to")
    inside = [v for v in available if lo <= v <= hi]
    if not inside:
        raise UsageError(f"no release of the package between {start} and {end} is listed by {source}")
    picked = inside[::every]
    if picked[-1] != inside[-1]:
        picked.append(inside[-1])
    return picked


# -- the environment a run is measured in -------------------------------------------------------------
def environment_for(package: str, version: str) -> dict[str, Any]:
    """What the command's runs will record: this environment's tracked versions with ``package`` at
    ``version``, the Python version and the device kind. Runs in the store with the same values are
    measurements of the same thing."""
    packages = {name: package_version(name) for name in TRACKED_PACKAGES}
    packages[_package_key(package, packages)] = version
    return {"packages": packages, "python": platform.python_version(), "device": _device()}


def _package_key(package: str, packages: dict[str, Any]) -> str:
    """The spelling of ``package`` among ``packages`` (names compare canonicalised), else ``package``."""
    want = canonicalize_name(package)
    return next((k for k in packages if canonicalize_name(k) == want), package)


def _device() -> str:
    """``cuda`` or ``cpu``, as the benchmark plugin records it (torch is imported only if already loaded
    or importable; no torch means the command cannot use CUDA either). A CPU-only build of torch (a ``+cpu``
    local version in its metadata) has no CUDA on any machine: that is answered without importing torch,
    which would cost every command of a sweep that records its runs ~2 CPU seconds."""
    if "torch" not in sys.modules and (package_version("torch") or "").endswith("+cpu"):
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _comparable(text: object) -> Version | str:
    """A version to compare; a recorded string that is no version compares as itself (equal only to it)."""
    try:
        return Version(str(text))
    except InvalidVersion:
        return str(text)


def same_environment(info: dict[str, Any], env: dict[str, Any]) -> bool:
    """Whether a record's ``machine_info.vramguard`` block describes ``env``."""
    if not isinstance(info, dict) or not isinstance(info.get("packages"), dict):
        return False
    recorded = {canonicalize_name(k): v for k, v in info["packages"].items()}
    for name, version in env["packages"].items():
        got = recorded.get(canonicalize_name(name))
        if (got is None) != (version is None):
            return False
        if got is not None and _comparable(got) != _comparable(version):
            return False
    return info.get("python") == env["python"] and info.get("device") == env["device"]


def done_runs(store: ResultStore) -> list[dict[str, Any]]:
    """The sweep markers in ``store`` whose release was measured (outcome ``ok``)."""
    out = []
    for run in store.runs():
        for path in run.files:
            if not path.name.startswith(f"{MARKER_WRITER}-"):
                continue
            try:
                doc = read_json(path)
            except UsageError:
                continue
            marker = doc.get("vramguard_sweep") if isinstance(doc, dict) else None
            info = doc.get("machine_info") if isinstance(doc, dict) else None
            if isinstance(marker, dict) and marker.get("outcome") == "ok" and isinstance(info, dict):
                # a marker of another shape resumes nothing: that release is measured again
                out.append(dict(marker, run_id=run.run_id, info=info.get("vramguard")))
    return out


def already_measured(markers: list[dict[str, Any]], package: str, env: dict[str, Any]) -> str | None:
    """The run id of an ``ok`` run of ``package`` in ``env``, or None."""
    for m in markers:
        if canonicalize_name(str(m.get("package"))) == canonicalize_name(package) and same_environment(
            m.get("info") or {}, env
        ):
            return m["run_id"]
    return None


# -- one release ---------------------------------------------------------------------------------------
@dataclass
class Release:
    """One release of the sweep: what the JSON log records."""

    version: str
    outcome: str = "pending"  # ok | skip | failed | timeout | install-failed | resumed | pending
    exit_code: int | None = None
    duration_s: float = 0.0
    overlay: str = ""  # cached | installed | install-failed
    install_s: float = 0.0
    run_id: str | None = None
    stored: list[str] = field(default_factory=list)
    reason: str = ""
    output_tail: list[str] = field(default_factory=list)


@dataclass
class Sweep(LoggedRun):
    """Installs each release into the overlay cache, runs the command against it and records the outcome;
    ``say`` receives one progress line per release (the CLI prints them to stderr)."""

    log_name = "sweep log"
    package: str
    releases: list[Version]
    command: list[str]
    store: ResultStore
    cache: OverlayCache
    index: IndexOptions
    timeout: float | None = None
    import_check: bool = True
    resume: bool = True
    log_path: Path | None = None
    say: Callable[[str], None] = field(default=lambda line: None)
    results: list[Release] = field(default_factory=list)
    status: str = "running"
    error: str = ""

    def __post_init__(self) -> None:
        self.started = time.time()
        self.sweep_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> int:
        """Measure every release; the log is rewritten after each one and on every way out."""
        with self.recording_the_end():
            self.write_log()
            markers = done_runs(self.store) if self.resume else []
            for n, version in enumerate(self.releases, 1):
                release = self.one(str(version), markers)
                self.results.append(release)
                self._progress(n, release)
                self.write_log()
        self.status = "done"
        self.write_log()
        return 1 if self.failures() else 0

    def failures(self) -> list[Release]:
        """The releases whose outcome fails the sweep (failed, timeout, install-failed)."""
        return [r for r in self.results if r.outcome in FAILED]

    def one(self, version: str, markers: list[dict[str, Any]]) -> Release:
        """Measure one release (or find it in ``markers``, the ``ok`` runs already stored) and say how it went."""
        env = environment_for(self.package, version)
        earlier = already_measured(markers, self.package, env)
        if earlier is not None:
            return Release(version, "resumed", run_id=earlier, reason=f"already in the store: run {earlier}")
        release = Release(version)
        start = time.monotonic()
        try:
            overlay = self.cache.get(self.package, version, self.index.pip_args(), INSTALL_TIMEOUT_S)
        except InstallError as exc:
            release.outcome, release.overlay, release.reason = "install-failed", "install-failed", str(exc)
            release.install_s = round(time.monotonic() - start, 3)
            return release
        except OSError as exc:  # the cache itself: not a verdict on the release
            raise UsageError(f"overlay cache {self.cache.root}: {exc.strerror or exc}") from None
        release.install_s = round(time.monotonic() - start, 3)
        release.overlay = "installed" if overlay.installed_now else "cached"
        run_id = new_run_id()
        env_vars = probe_env(overlay.path, self.package, version)
        env_vars[STORE_ENV] = str(self.store.root.absolute())
        env_vars[RUN_ID_ENV] = run_id
        start = time.monotonic()
        if self.import_check:
            code, tail = check_import(overlay, self.package, version, env_vars, self.timeout)
            if code != 0:
                release.outcome, release.exit_code, release.output_tail = "skip", code, tail
                release.reason = f"import check failed: {tail[-1] if tail else f'exit {code}'}"
                release.duration_s = round(time.monotonic() - start, 3)
                return release
        code, tail = run_command(self.command, env_vars, self.timeout)
        release.duration_s = round(time.monotonic() - start, 3)
        release.exit_code, release.output_tail = code, tail
        stored = [r for r in self.store.runs() if r.run_id == run_id]
        release.stored = [str(f.relative_to(self.store.root)) for r in stored for f in r.files]
        release.run_id = run_id if stored else None
        if code is None:
            release.outcome, release.reason = "timeout", f"timed out after {self.timeout} s"
        elif code == SKIP_CODE:
            release.outcome, release.reason = "skip", "the command exited 125 (skip)"
        elif code != 0:
            release.outcome, release.reason = "failed", f"the command exited {code}"
        elif not stored:
            release.outcome = "failed"
            release.reason = (
                f"the command exited 0 but stored no run in {self.store.root} "
                f"(does it write to ${STORE_ENV}, e.g. pytest with vramguard's benchmark plugin?)"
            )
        else:
            wrong = self._wrong_versions(stored[0], version)
            release.outcome, release.reason = ("failed", wrong) if wrong else ("ok", "")
        if stored:
            self._mark(stored[0], release)
        return release

    def _wrong_versions(self, run: Any, version: str) -> str:
        """Why the stored run is not a measurement of ``version`` ("" when it is)."""
        doc = self.store.load(run)
        info = (doc.get("machine_info") or {}).get("vramguard") or {}
        packages = info.get("packages") or {}
        got = packages.get(_package_key(self.package, packages))
        if got is None:
            return f"the stored run records no {self.package} version"
        if Version(str(got)) != Version(version):
            return f"the stored run measured {self.package} {got}, not {version}"
        return ""

    def _mark(self, run: Any, release: Release) -> None:
        """Add the sweep's record of this release to the run (same environment key, no benchmarks)."""
        doc = self.store.load(run)
        marker = {
            "machine_info": doc.get("machine_info") or {},
            "benchmarks": [],
            "vramguard_sweep": {
                "package": self.package,
                "version": release.version,
                "outcome": release.outcome,
                "exit_code": release.exit_code,
                "command": self.command,
                "sweep_id": self.sweep_id,
            },
        }
        try:
            self.store.add(marker, run.run_id, MARKER_WRITER)
        except OSError as exc:
            raise UsageError(f"cannot write to the results store {self.store.root}: {exc}") from None

    def _progress(self, n: int, r: Release) -> None:
        how = {None: "timeout"}.get(r.exit_code, f"exit {r.exit_code}") if r.outcome != "resumed" else ""
        src = f"installed in {r.install_s:.1f} s" if r.overlay == "installed" else r.overlay
        parts = [p for p in (how, f"{r.duration_s:.1f} s" if r.outcome != "resumed" else "", src) if p]
        detail = f" ({', '.join(parts)})" if parts else ""
        why = f" - {r.reason}" if r.reason else ""
        stored = f" run {r.run_id}" if r.run_id and r.outcome != "resumed" else ""
        self.say(f"[{n}/{len(self.releases)}] {self.package} {r.version}: {r.outcome}{detail}{stored}{why}")

    # -- the log -------------------------------------------------------------------------------------
    def log(self) -> dict[str, Any]:
        """The JSON log: the sweep's settings, its status and every release's :class:`Release`."""
        return {
            "tool": "vramguard sweep",
            "package": self.package,
            "command": self.command,
            "store": str(self.store.root),
            "cache_dir": str(self.cache.root),
            "python_tag": python_tag(),
            "releases": [str(v) for v in self.releases],
            "status": self.status,
            "error": self.error,
            "sweep_id": self.sweep_id,
            "started_at": self.started,
            "elapsed_s": round(time.time() - self.started, 3),
            "counts": {
                o: sum(r.outcome == o for r in self.results)
                for o in sorted({r.outcome for r in self.results})
            },
            "results": [asdict(r) for r in self.results],
        }

    def summary(self) -> str:
        """The closing lines: counts per outcome, each failed release with its reason, the log's path."""
        counts = self.log()["counts"]
        lines = [
            f"{self.package}: {len(self.results)} release(s): "
            + ", ".join(f"{v} {k}" for k, v in counts.items())
        ]
        for r in self.failures():
            lines.append(f"  {r.version}: {r.outcome} - {r.reason}")
        if self.log_path is not None:
            lines.append(f"log: {self.log_path}")
        return "\n".join(lines)


# -- before the first install -------------------------------------------------------------------------
def open_store(store_dir: Path | None) -> ResultStore:
    """The results store the runs go to: ``store_dir`` or ``$VRAMGUARD_STORE``, created if missing."""
    store_dir = store_dir or (Path(os.environ[STORE_ENV]) if os.environ.get(STORE_ENV) else None)
    if store_dir is None:
        raise UsageError(f"no results store: give --store DIR (or set ${STORE_ENV})")
    if store_dir.exists() and not store_dir.is_dir():
        raise UsageError(f"--store {store_dir}: not a directory")
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--store {store_dir}: cannot create it ({exc.strerror or exc})") from None
    return ResultStore(store_dir)


def releases_to_sweep(
    package: str,
    index: IndexOptions,
    versions: str | None,
    start: str | None,
    end: str | None,
    every: int = 1,
    pre: bool = False,
) -> list[Version]:
    """Ask the index for ``package``'s releases and pick the ones to sweep (:func:`select_releases`);
    the options are checked before the index is asked (:func:`check_release_options`: no ``pip`` runs for
    them)."""
    check_release_options(versions, start, end, every)
    available = available_versions(package, index, pre=True)
    if versions is None:
        available = sort_versions([str(v) for v in available], pre=pre)
    return select_releases(available, versions, start, end, every, index.source())


def default_log_path(cache: OverlayCache, package: str) -> Path:
    """A new log file name per sweep beside the overlays (no earlier log is overwritten)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return cache.root / ".logs" / f"sweep-{canonicalize_name(package)}-{stamp}-{uuid.uuid4().hex[:6]}.json"
