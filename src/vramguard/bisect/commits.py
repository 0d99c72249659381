"""Bisect by commit: the commits of a local clone between two refs, each built once into the overlay cache.

The candidates are the first-parent chain from the old ref to the new one (``git log --first-parent``), so
the search sees a line, as with releases. Each probed commit's tree is taken from the clone's object store
with ``git archive`` into a scratch folder: the user's clone (work tree, index, HEAD, worktree list) is
never touched. There it is built (``--build``, or the package's default: bitsandbytes' CMake CPU backend)
and ``pip install --no-deps --target``-ed into an overlay entry named after the commit's sha
(:meth:`vramguard.bisect.overlay.OverlayCache.get_commit`), so a commit is built once per machine and
Python. A commit that does not build is skipped, as ``git bisect skip`` would.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

from vramguard.bisect.overlay import InstallError, Overlay, OverlayCache, pip_install
from vramguard.bisect.procgroup import run_with_tail
from vramguard.errors import UsageError

#: Lines of a failed build's output kept in its skip reason.
BUILD_ERROR_LINES = 3


def default_build(package: str) -> str | None:
    """The build run in a commit's tree before its pip install when ``--build`` is not given:
    bitsandbytes' CMake CPU backend (its native library; pip then packages it, BNB_SKIP_CMAKE=1), nothing
    for a pure-Python package (pip builds it)."""
    if canonicalize_name(package) == "bitsandbytes":
        jobs = os.cpu_count() or 1
        return f"cmake -DCOMPUTE_BACKEND=cpu -S . -B build && cmake --build build -j {jobs}"
    return None


@dataclass(frozen=True)
class Commit:
    """One candidate commit: its full sha and subject; shown by its short sha."""

    sha: str
    subject: str

    def __str__(self) -> str:
        return self.sha[:12]


def _git(repo: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise UsageError("--git needs git on PATH") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"--git {repo}: git {args[0]} took more than {timeout:.0f} s") from None


def _resolve(repo: Path, ref: str, flag: str) -> str:
    if ref.startswith("-"):
        raise UsageError(f"{flag} {ref}: not a commit in {repo}")
    result = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if result.returncode != 0 or not result.stdout.strip():
        raise UsageError(f"{flag} {ref}: not a commit in {repo}")
    return result.stdout.strip()


def commit_range(repo: Path, good: str, bad: str, find_fix: bool) -> list[Commit]:
    """The commits from the old endpoint (``good``, or ``bad`` with ``find_fix``) to the new one, oldest
    first, both included: the new one's first-parent chain back to the old one. One line on a bad ref."""
    if not repo.is_dir():
        raise UsageError(f"--git {repo}: not a directory")
    probe = _git(repo, "rev-parse", "--git-dir")
    if probe.returncode != 0:
        raise UsageError(f"--git {repo}: not a git repository")
    (old_flag, old_ref), (new_flag, new_ref) = (
        (("--bad", bad), ("--good", good))
        if find_fix
        else (
            ("--good", good),
            ("--bad", bad),
        )
    )
    old, new = _resolve(repo, old_ref, old_flag), _resolve(repo, new_ref, new_flag)
    if old == new:
        raise UsageError(
            f"{old_flag} {old_ref} and {new_flag} {new_ref} are the same commit: nothing to bisect"
        )
    if _git(repo, "merge-base", "--is-ancestor", old, new).returncode != 0:
        raise UsageError(
            f"{old_flag} {old_ref} is not an ancestor of {new_flag} {new_ref}: no commits between"
        )
    log = _git(repo, "log", "--first-parent", "--reverse", "--format=%H%x00%s", f"{old}..{new}")
    if log.returncode != 0:
        raise UsageError(f"--git {repo}: git log failed: {log.stderr.strip()[-300:]}")
    subject = _git(repo, "log", "-1", "--format=%s", old).stdout.strip()
    commits = [Commit(old, subject)]
    for line in log.stdout.splitlines():
        sha, _, subj = line.partition("\0")
        commits.append(Commit(sha, subj))
    line = _git(repo, "rev-list", "--first-parent", new).stdout.split()
    if len(commits) < 2 or old not in line:  # merged in from a side branch: the line's commits lack it
        raise UsageError(f"{old_flag} {old_ref} is not on the first-parent line of {new_flag} {new_ref}")
    return commits


@dataclass
class CommitBuilder:
    """Builds commits of ``repo`` into ``cache``: archive, ``build`` (a shell command run in the tree;
    None: :func:`default_build`), then pip install of the tree into the overlay."""

    package: str
    repo: Path
    cache: OverlayCache
    build: str | None = None
    pip_args: Sequence[str] = field(default_factory=tuple)
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.build is None:
            self.build = default_build(self.package)

    def overlay(self, commit: Commit) -> Overlay:
        """The commit's overlay, built now or found in the cache; InstallError when it does not build."""
        return self.cache.get_commit(
            self.package, commit.sha, lambda work, target: self._fill(commit, work, target), build=self.build or ""
        )

    def _fill(self, commit: Commit, work: Path, target: Path) -> None:
        src = work / "src"
        src.mkdir()
        tar = work / "src.tar"
        archived = _git(self.repo, "archive", "--format=tar", "-o", str(tar), commit.sha, timeout=600)
        if archived.returncode != 0:
            raise InstallError(f"git archive {commit}: {archived.stderr.strip()[-300:]}")
        try:
            with tarfile.open(tar) as tf:
                tf.extractall(src, filter="data")  # nothing outside src, whatever the tree holds
        except tarfile.TarError as exc:
            raise InstallError(f"git archive {commit}: cannot unpack: {exc}") from None
        tar.unlink()
        env = dict(os.environ)
        if self.build:
            script = f"cd {shlex.quote(str(src))} && {self.build}"
            code, tail = run_with_tail(["bash", "-c", script], env, self.timeout, max_lines=200)
            if code != 0:
                how = "timed out" if code is None else f"exited {code}"
                lines = [ln[:300] for ln in tail if ln.strip()][-BUILD_ERROR_LINES:]
                raise InstallError(f"build {how}: " + " | ".join(lines))
            if canonicalize_name(self.package) == "bitsandbytes":
                env["BNB_SKIP_CMAKE"] = "1"  # its setup.py would run CMake again, for the default backend
        pip_install(target, [*self.pip_args, str(src)], work, self.timeout, env)
