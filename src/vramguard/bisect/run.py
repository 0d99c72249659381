"""``vramguard bisect``: find the release (or the commit) of one package where memory or gradients changed.

Only the bisected package varies: each version is installed once into a cached overlay
(:mod:`vramguard.bisect.overlay`) put first on ``PYTHONPATH``, so torch and everything else stay the current
environment's; with ``--git`` the candidates are a clone's commits, each built once
(:mod:`vramguard.bisect.commits`) into the same cache, searched, logged and reported the same way. Verdicts follow ``git bisect run`` (0 good, 125 skip, other non-zero or timeout bad);
the search itself is :mod:`vramguard.bisect.search`. Named ``bisect`` inside the package only: every
import here is absolute, so the stdlib ``bisect`` is never shadowed.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from filelock import FileLock, Timeout
from packaging.utils import canonicalize_name
from packaging.version import Version

from vramguard.atomic import write_text_atomic
from vramguard.bisect.commits import Commit, CommitBuilder
from vramguard.bisect.overlay import InstallError, Overlay, OverlayCache, python_tag
from vramguard.bisect.pkgindex import IndexOptions
from vramguard.bisect.procgroup import run_with_tail
from vramguard.bisect.search import Bisection, EndpointError, State, probe_bound
from vramguard.errors import UsageError

SKIP_CODE = 125
#: Lines of the probe's output shown before an endpoint error.
ENDPOINT_TAIL_LINES = 10
INSTALL_TIMEOUT_S = 1800.0
EXIT_AMBIGUOUS = 3
#: After SIGINT / SIGTERM / SIGHUP, repeats are ignored this long (seconds) while the run cleans up.
CLEANUP_S = 10.0

# Run in the probe's environment before the probe: is the overlay really what gets imported?
_IMPORT_CHECK = r"""
import importlib, importlib.metadata as md, os, sys
from packaging.version import Version
pkg, ver, root, *names = sys.argv[1:]
root = os.path.realpath(root)
try:
    got = md.version(pkg)
except md.PackageNotFoundError:
    print(f"no metadata for {pkg} on sys.path"); sys.exit(3)
if Version(got) != Version(ver):
    print(f"{pkg} {got} is seen instead of {ver}: the overlay is shadowed"); sys.exit(3)
for name in names:
    try:
        mod = importlib.import_module(name)
    except BaseException as exc:
        print(f"import {name} failed: {type(exc).__name__}: {exc}"); sys.exit(4)
    where = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", [])), "")
    if not os.path.realpath(where).startswith(root + os.sep):
        print(f"{name} was imported from {where}, not from the overlay"); sys.exit(5)
print(f"{pkg} {got} from {root}")
"""


@dataclass
class VersionProbe:
    """One probe of one version: what the JSON log records."""

    version: str
    verdict: str  # good | bad | skip
    exit_code: int | None
    duration_s: float
    overlay: str = "cached"  # cached | installed | install-failed
    install_s: float = 0.0
    reason: str = ""
    output_tail: list[str] = field(default_factory=list)
    subject: str = ""  # a commit's subject (bisect --git); its full sha is ``version``


def verdict_for(exit_code: int | None) -> str:
    """``git bisect run`` semantics; ``None`` (timed out) is bad."""
    if exit_code == 0:
        return "good"
    if exit_code == SKIP_CODE:
        return "skip"
    return "bad"


def probe_env(overlay: Path, package: str, version: str) -> dict[str, str]:
    """The current environment with the overlay first on PYTHONPATH (before site-packages and .pth)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(overlay), env.get("PYTHONPATH", "")) if p)
    env["VRAMGUARD_BISECT_PACKAGE"] = package
    env["VRAMGUARD_BISECT_VERSION"] = version
    env.pop("PYTHONSAFEPATH", None)
    env.pop("PYTHONNOUSERSITE", None)
    return env


def run_command(
    cmd: Sequence[str], env: dict[str, str], timeout: float | None
) -> tuple[int | None, list[str]]:
    """Exit code (None on timeout) and the bounded tail of the output.

    The command runs in its own process group, killed on timeout, on an exception here and when this
    process dies (SIGKILL included): see :mod:`vramguard.bisect.procgroup`.
    """
    code, lines = run_with_tail(cmd, env, timeout)
    if code is None:
        lines.append(f"[vramguard] probe timed out after {timeout} s")
    return code, lines


def check_import(
    overlay: Overlay, package: str, version: str, env: dict[str, str], timeout: float | None
) -> tuple[int | None, list[str]]:
    """Whether ``package`` ``version`` and its import names come from ``overlay`` in ``env`` (the probe's
    environment): 0 when they do; otherwise the exit code and the output tail whose last line says why."""
    check = [sys.executable, "-c", _IMPORT_CHECK, package, version, str(overlay.path)]
    return run_command(check + list(overlay.import_names), env, timeout)


# -- signals and killed runs ---------------------------------------------------------------------------
class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP as an exception, so the run ends as on Ctrl-C: probe group killed, log written."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signame = signal.Signals(signum).name
        super().__init__(self.signame)


@contextmanager
def signals_end_the_run() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and SIGTERM / SIGHUP raise :class:`Terminated`. A repeat within
    :data:`CLEANUP_S` is ignored, so it cannot cut short the clean-up (killing the probe group, writing
    the log: well under a second); a later one raises again, in case the first was swallowed. Signals the
    caller ignores (``nohup``, a background job's SIGINT) stay ignored. Main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: float | None = None

    def handler(signum: int, _frame: object) -> None:
        nonlocal fired
        if fired is not None and time.monotonic() - fired < CLEANUP_S:
            return
        fired = time.monotonic()
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    names = ("SIGINT", "SIGTERM", "SIGHUP")
    wanted = [getattr(signal, n) for n in names if hasattr(signal, n)]
    previous = {s: signal.getsignal(s) for s in wanted}
    try:
        for sig, old in previous.items():
            if old is not signal.SIG_IGN:
                signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


class LiveRuns:
    """The bisect runs in progress on one cache, so that a later run can mark the log of a killed one.

    Each run holds an OS file lock (``<id>.lock``, via ``filelock``) for its lifetime and records its log's
    path beside it (``<id>.json``). The kernel drops the lock when the process ends, however it ends, so a
    record whose lock can be taken belongs to a dead run: its log, still ``running``, becomes ``killed``.
    Unlike "is that pid alive?" this is not fooled by a reused pid.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @contextmanager
    def register(self, run_id: str, log: Path, package: str, command: Sequence[str]) -> Iterator[None]:
        """Hold the run's lock (taken before its record is written, so a live record is never stale)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.folder / f"{run_id}.lock"))
        lock.acquire()
        record = self.folder / f"{run_id}.json"
        try:
            info = {
                "run_id": run_id,
                "log": str(log.absolute()),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "package": package,
                "command": list(command),
                "started_at": time.time(),
            }
            write_text_atomic(record, json.dumps(info, indent=1) + "\n")
            yield
        finally:
            record.unlink(missing_ok=True)
            lock.release()
            Path(lock.lock_file).unlink(missing_ok=True)

    def mark_stale(self) -> list[Path]:
        """Mark the logs of dead runs ``killed``; return their paths. Live runs' records are untouched."""
        marked: list[Path] = []
        if not self.folder.is_dir():
            return marked
        for lock_path in sorted(self.folder.glob("*.lock")):
            lock = FileLock(str(lock_path))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue  # its run is alive
            except OSError:
                continue
            record = lock_path.with_suffix(".json")
            try:
                info = json.loads(record.read_text())
                if _mark_killed(Path(info["log"]), info):
                    marked.append(Path(info["log"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no record (it died before writing one) or an unreadable one: only tidy up
            finally:
                record.unlink(missing_ok=True)
                lock.release()
                lock_path.unlink(missing_ok=True)
        return marked


def _mark_killed(log: Path, info: dict[str, Any]) -> bool:
    """Rewrite a dead run's log with status ``killed`` if it still says ``running`` (and is that run's)."""
    text = log.read_text()
    if text.strip():
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("status") != "running":
            return False
        if data.get("run_id") != info["run_id"]:
            return False  # the path now holds another run's log
    else:  # claimed, then killed before its first write
        data = {"tool": "vramguard bisect", "package": info.get("package"), "command": info.get("command")}
        data |= {"run_id": info["run_id"], "probes": [], "result": None}
    data["status"] = "killed"
    data["error"] = (
        f"the run (pid {info.get('pid')} on {info.get('host')}) ended without finishing its log: killed "
        f"(e.g. SIGKILL) or crashed; marked by a later run (pid {os.getpid()}). The probes listed are "
        "what it measured."
    )
    write_text_atomic(log, json.dumps(data, indent=2) + "\n")
    return True


class LoggedRun:
    """A long run (a bisection, a sweep) that keeps a JSON log: rewritten atomically after every step and
    on every way out, so it says ``running`` only while the run is alive and nothing measured is lost.

    Subclasses provide ``log_path``, ``status``, ``error`` and :meth:`log`; ``log_name`` names the log in
    the one-line error a failed write becomes."""

    log_name = "log"
    log_path: Path | None
    status: str
    error: str

    def log(self) -> dict[str, Any]:
        """The whole log document (the subclass's)."""
        raise NotImplementedError

    def write_log(self) -> None:
        """Rewrite the whole log atomically; a write failure (disk full, folder removed) is one line."""
        if self.log_path is None:
            return
        try:
            write_text_atomic(self.log_path, json.dumps(self.log(), indent=2) + "\n")
        except OSError as exc:
            raise UsageError(
                f"cannot write the {self.log_name} {self.log_path}: {exc.strerror or exc}"
            ) from None

    def _write_log_last(self) -> None:
        """The final write on the way out of an error: a failure to write is not allowed to hide that error."""
        try:
            self.write_log()
        except UsageError:
            pass

    @contextmanager
    def recording_the_end(self) -> Iterator[None]:
        """Record how the run ended if it ends by an exception (``interrupted`` on SIGINT / SIGTERM /
        SIGHUP, ``failed`` otherwise), write the log and re-raise. A run that already recorded its end
        (status no longer ``running``) keeps that record."""
        try:
            yield
        except KeyboardInterrupt as exc:
            if self.status == "running":
                self.status = "interrupted"
                self.error = f"interrupted by {exc.signame if isinstance(exc, Terminated) else 'SIGINT'}"
            self._write_log_last()
            raise
        except BaseException as exc:
            if self.status == "running":
                self.status, self.error = "failed", str(exc) or type(exc).__name__
            self._write_log_last()
            raise


class Reporter(Protocol):
    """Where a bisection reports progress: the CLI passes rich's ``Console`` (stderr); the default is silent."""

    def status(self, status: str) -> AbstractContextManager[Any]:
        """A context in which a long step (an install, a probe) shows ``status`` as under way."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Show one progress line as it is (never read as markup); ``style=`` colours the whole line."""


class Silent:
    """A :class:`Reporter` that shows nothing (a bisection run from code, not from the CLI)."""

    def status(self, status: str) -> AbstractContextManager[Any]:
        """Show nothing while the step runs."""
        return nullcontext()

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Drop the progress line."""


@dataclass
class BisectRun(LoggedRun):
    """Installs, probes and records one bisection; ``search`` decides what to probe next."""

    log_name = "bisect log"

    package: str
    candidates: list[Version] | list[Commit]
    command: list[str]
    cache: OverlayCache
    index: IndexOptions
    find_fix: bool = False
    timeout: float | None = None
    import_check: bool = True
    log_path: Path | None = None
    console: Reporter = field(default_factory=lambda: Silent())
    builder: CommitBuilder | None = None  # bisect --git: candidates are Commits built by it
    probes: list[VersionProbe] = field(default_factory=list)
    status: str = "running"
    error: str = ""
    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:12]}")

    def __post_init__(self) -> None:
        self.search = Bisection(len(self.candidates))
        self.started = time.time()

    # -- one probe --------------------------------------------------------------------------------
    def _overlay(self, candidate: Version | Commit) -> tuple[Overlay | None, str, float]:
        start = time.monotonic()
        try:
            if isinstance(candidate, Commit):
                assert self.builder is not None
                with self.console.status(f"building {self.package} {candidate} {candidate.subject} ..."):
                    overlay = self.builder.overlay(candidate)
            else:
                with self.console.status(f"installing {self.package} {candidate} ..."):
                    overlay = self.cache.get(
                        self.package, str(candidate), self.index.pip_args(), INSTALL_TIMEOUT_S
                    )
        except InstallError as exc:
            what = "build" if isinstance(candidate, Commit) else "install"
            return None, f"{what} failed: {exc}", time.monotonic() - start
        except OSError as exc:  # the cache itself (disk full, folder removed): not a verdict on the version
            where = f" ({exc.filename})" if exc.filename else ""
            raise UsageError(f"overlay cache {self.cache.root}: {exc.strerror or exc}{where}") from None
        return overlay, "", time.monotonic() - start

    def probe(self, candidate: Version | Commit) -> VersionProbe:
        """Install or build (or reuse) the overlay, check it is what gets imported, run the command."""
        version = candidate.sha if isinstance(candidate, Commit) else str(candidate)
        subject = candidate.subject if isinstance(candidate, Commit) else ""
        overlay, reason, install_s = self._overlay(candidate)
        if overlay is None:
            return VersionProbe(
                version, "skip", None, 0.0, "install-failed", round(install_s, 3), reason, subject=subject
            )
        env = probe_env(overlay.path, self.package, version)
        how = "installed" if overlay.installed_now else "cached"
        start = time.monotonic()
        with self.console.status(f"probing {self.package} {candidate} ..."):
            if self.import_check:
                code, tail = check_import(overlay, self.package, overlay.version, env, self.timeout)
                if code != 0:
                    why = tail[-1] if tail else f"exit {code}"
                    return VersionProbe(
                        version,
                        "skip",
                        code,
                        round(time.monotonic() - start, 3),
                        how,
                        round(install_s, 3),
                        reason=f"import check failed: {why}",
                        output_tail=tail,
                        subject=subject,
                    )
            code, tail = run_command(self.command, env, self.timeout)
        reason = "timeout" if code is None else ""
        return VersionProbe(
            version,
            verdict_for(code),
            code,
            round(time.monotonic() - start, 3),
            how,
            round(install_s, 3),
            reason,
            output_tail=tail,
            subject=subject,
        )

    def state_of(self, verdict: str) -> State:
        """The search's state for a probe's verdict: good is the old state unless the run looks for a fix
        (then bad is)."""
        if verdict == "skip":
            return State.SKIP
        is_old = (verdict == "good") != self.find_fix
        return State.OLD if is_old else State.NEW

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        """Probe until the search is done; endpoint contradictions raise UsageError (log written first).

        The log says ``running`` only while this runs: every way out (interrupt, SIGTERM, error) rewrites it.
        """
        bound = probe_bound(len(self.candidates))
        with self.recording_the_end():
            try:
                self.write_log()  # before the first install: the log exists (and says running) from the start
                while (index := self.search.next_index()) is not None:
                    result = self.probe(self.candidates[index])
                    self.probes.append(result)
                    try:
                        self.search.record(index, self.state_of(result.verdict))
                    finally:
                        self._progress(result, bound)
                        self.write_log()
            except EndpointError as exc:
                self.status, self.error = "endpoint_error", self._endpoint_message(exc)
                self.write_log()
                self._show_endpoint_probe(exc.index)
                raise UsageError(self.error) from None
        self.status = "found" if len(self.search.candidates()) == 1 else "ambiguous"
        self.write_log()

    def _endpoint_message(self, exc: EndpointError) -> str:
        probe = self.probes[-1]
        flag = "--good" if (exc.index == 0) != self.find_fix else "--bad"
        claimed = "good" if flag == "--good" else "bad"
        name = self._label(exc.index)
        if exc.got is State.SKIP:
            return f"{flag} {name} cannot be tested ({probe.reason or 'probe exited 125'})"
        how = "timed out" if probe.exit_code is None else f"exited {probe.exit_code}"
        return f"{flag} {name} is not {claimed}: the probe {how} on it, so there is nothing to bisect"

    def _show_endpoint_probe(self, index: int) -> None:
        """Before an endpoint error's one line: the probe's last lines (what it said about the endpoint)
        and where the log is, on the progress console (stderr)."""
        tail = self.probes[-1].output_tail[-ENDPOINT_TAIL_LINES:]
        if tail:
            self.console.print(
                f"the last {len(tail)} lines of the probe on {self._label(index)}:",
                highlight=False,
                soft_wrap=True,
            )
            for line in tail:
                self.console.print(f"  | {line}", highlight=False, soft_wrap=True)
        if self.log_path is not None:
            self.console.print(f"log: {self.log_path}", highlight=False, soft_wrap=True)

    def _label(self, index: int) -> str:
        """How a candidate is named in messages: a version, or a commit's short sha and subject."""
        candidate = self.candidates[index]
        return f"{candidate} ({candidate.subject})" if isinstance(candidate, Commit) else str(candidate)

    def _progress(self, p: VersionProbe, bound: int) -> None:
        lo, hi = self.candidates[self.search.lo], self.candidates[self.search.hi]
        colour = {"good": "green", "bad": "red", "skip": "yellow"}[p.verdict]
        how = "timeout" if p.reason == "timeout" else f"exit {p.exit_code}"
        src = f"installed in {p.install_s:.1f} s" if p.overlay == "installed" else p.overlay
        self.console.print(  # in the verdict's colour; the reason (a probe's or pip's words) is never markup
            f"step {len(self.probes)} (≤ {bound}): {self.package} {p.version[:12] if p.subject else p.version} -> "
            f"{p.verdict} ({how}, {p.duration_s:.1f} s, {src})"
            + (f" - {p.reason}" if p.reason and p.reason != "timeout" else "")
            + f"  range {lo} .. {hi}",
            style=colour,
            highlight=False,
            soft_wrap=True,
        )

    # -- results --------------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """First changed version, last unchanged one, skipped ones; keys named after the mode."""
        first, last = ("first_fixed", "last_bad") if self.find_fix else ("first_bad", "last_good")
        cands = [self._id(i) for i in self.search.candidates()]
        return {
            first: cands[-1] if len(cands) == 1 else None,
            last: self._id(self.search.last_old()),
            "possible": cands,
            "skipped": [p.version for p in self.probes if p.verdict == "skip"],
        }

    def _id(self, index: int) -> str:
        """A candidate in the log and the result: a version, or a commit's full sha."""
        candidate = self.candidates[index]
        return candidate.sha if isinstance(candidate, Commit) else str(candidate)

    def log(self) -> dict[str, Any]:
        """The JSON log: the run's settings, its status, the result once there is one, and every probe
        (with ``--git``: the clone, the build command and every candidate commit's subject)."""
        n = len(self.candidates)
        git = None
        if self.builder is not None:
            commits = [{"sha": c.sha, "subject": c.subject} for c in self.candidates if isinstance(c, Commit)]
            git = {"repo": str(self.builder.repo), "build": self.builder.build, "commits": commits}
        return {
            "tool": "vramguard bisect",
            "package": self.package,
            "mode": "find-fix" if self.find_fix else "find-regression",
            "command": self.command,
            "python_tag": python_tag(),
            "cache_dir": str(self.cache.root),
            "candidates": [self._id(i) for i in range(n)],
            "git": git,
            "status": self.status,
            "error": self.error,
            "run_id": self.run_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "result": self.result() if self.status in ("found", "ambiguous") else None,
            "probe_count": len(self.probes),
            "probe_bound": probe_bound(n),
            "installs": sum(1 for p in self.probes if p.overlay == "installed"),
            "started_at": self.started,
            "elapsed_s": round(time.time() - self.started, 3),
            "probes": [asdict(p) for p in self.probes],
        }

    def summary(self) -> str:
        """The closing lines on stdout: the first changed and last unchanged version, the skipped ones, the
        probe count against its bound, the log's path."""
        res = self.result()
        n = len(self.candidates)
        first_key, last_key = ("first_fixed", "last_bad") if self.find_fix else ("first_bad", "last_good")
        what = "commit" if self.builder is not None else "version"
        first_label = f"first fixed {what}" if self.find_fix else f"first bad {what}"
        last_label = f"last bad {what}" if self.find_fix else f"last good {what}"
        subjects = {c.sha: c.subject for c in self.candidates if isinstance(c, Commit)}

        def named(ident: str) -> str:  # a commit: its full sha and subject
            return f"{ident} {subjects[ident]}" if ident in subjects else ident

        lines = []
        if res[first_key] is not None:
            lines.append(f"{first_label}: {self.package} {named(res[first_key])}")
        else:
            possible = ", ".join(p[:12] if p in subjects else p for p in res["possible"])
            lines.append(f"{first_label}: undetermined, one of {possible} (the others were skipped)")
        lines.append(f"{last_label}: {self.package} {named(res[last_key])}")
        if subjects:
            skipped = [
                f"{p.version[:12]} {p.subject} ({p.reason[:120]})" for p in self.probes if p.verdict == "skip"
            ]
            lines.append("skipped: " + ("; ".join(skipped) or "none"))
        else:
            lines.append(f"skipped: {', '.join(res['skipped']) or 'none'}")
        lines.append(f"probes: {len(self.probes)} for {n} candidates (bound {probe_bound(n)} + skips)")
        if self.log_path is not None:
            lines.append(f"log: {self.log_path}")
        return "\n".join(lines)


def default_log_path(cache_root: Path, package: str) -> Path:
    """A new file per run beside the overlays, so no earlier log is overwritten when --log is not given.

    The name is claimed by creating the file exclusively: two runs in the same second (and process)
    get different names.
    """
    folder = cache_root / ".logs"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"bisect-{canonicalize_name(package)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in itertools.count():
        path = folder / (f"{stamp}.json" if n == 0 else f"{stamp}-{n}.json")
        try:
            path.open("x").close()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")
