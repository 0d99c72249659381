"""Which versions of a package exist, asked through pip so its index, proxy and certificate settings apply.

``pip index versions`` reports an unreachable index the same way as an unknown package ("No matching
distribution"), so on that answer the index itself is contacted to tell the two apart.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from vramguard.errors import UsageError

DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class IndexOptions:
    """Where packages come from: pip's own configuration unless overridden."""

    index_url: str | None = None
    find_links: tuple[str, ...] = field(default_factory=tuple)
    timeout: float = 30.0

    def pip_args(self) -> list[str]:
        """Arguments for ``pip install`` / ``pip index``: a wheel directory alone means offline."""
        args = ["--timeout", str(int(self.timeout)), "--retries", "1"]
        if self.index_url:
            args += ["--index-url", self.index_url]
        elif self.find_links:
            args.append("--no-index")
        for link in self.find_links:
            args += ["--find-links", link]
        return args

    def source(self) -> str:
        """Where the versions were listed, for messages: the index URL, the wheel folders or pip's index."""
        return self.index_url or (", ".join(self.find_links) if self.find_links else "the package index")

    def check(self) -> None:
        """Fail (one line) on a ``--find-links`` folder that does not exist, before pip is asked."""
        for link in self.find_links:
            if "://" not in link and not Path(link).exists():
                raise UsageError(f"--find-links {link}: no such directory")


#: PEP 508 project names (no path separators: the name becomes part of file names)
_PROJECT_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def check_package_name(name: str) -> str:
    """``name`` if it is a PEP 508 project name (so it is safe in file names), else UsageError."""
    if not _PROJECT_NAME.match(name):
        raise UsageError(f"not a package name: {name!r}")
    return name


def sort_versions(texts: Iterable[str], pre: bool = False) -> list[Version]:
    """Unique, ascending, parseable versions; pre-releases (and dev releases) only when ``pre``."""
    out = set()
    for text in texts:
        try:
            v = Version(text.strip())
        except InvalidVersion:
            continue
        if pre or not (v.is_prerelease or v.is_devrelease):
            out.add(v)
    return sorted(out)


def _configured_index_url() -> str:
    """The index pip would use: ``--index-url`` from its env/config files, else PyPI."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_INDEX
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url") and not key.endswith("extra-index-url"):
            return value.strip().strip("'\"")
    return DEFAULT_INDEX


def check_reachable(url: str, package: str, timeout: float) -> None:
    """Raise a UsageError naming the index when it cannot be contacted at all (no network)."""
    if not url.startswith(("http://", "https://")):
        return
    page = f"{url.rstrip('/')}/{canonicalize_name(package)}/"
    try:
        with urllib.request.urlopen(page, timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # the index answered: 404 means an unknown package, reported by the caller
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(f"cannot reach the package index {url}: {reason}") from None


def available_versions(package: str, options: IndexOptions, pre: bool = False) -> list[Version]:
    """All versions of ``package`` that pip sees, ascending; UsageError for unknown package / no network."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"]
    cmd += options.pip_args() + (["--pre"] if pre else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=options.timeout * 4, check=False)
    except subprocess.TimeoutExpired:
        raise UsageError(f"the package index did not answer within {options.timeout * 4:.0f} s") from None
    for line in out.stdout.splitlines():
        if line.startswith("Available versions:"):
            return sort_versions(line.split(":", 1)[1].split(","), pre=pre)
    if options.index_url or not options.find_links:
        check_reachable(options.index_url or _configured_index_url(), package, options.timeout)
    where = options.index_url or (
        ", ".join(options.find_links) if options.find_links else "the package index"
    )
    raise UsageError(f"package {package!r} not found on {where}")


def select_range(
    versions: Sequence[Version], good: str, bad: str, find_fix: bool, source: str
) -> list[Version]:
    """Candidates between the endpoints, oldest first; UsageError when an endpoint is not listed."""
    ends = {}
    for flag, text in (("--good", good), ("--bad", bad)):
        try:
            ends[flag] = Version(text)
        except InvalidVersion:
            raise UsageError(f"{flag} {text!r} is not a version") from None
        if ends[flag] not in versions:
            hint = " (pre-releases are excluded; add --pre)" if ends[flag].is_prerelease else ""
            raise UsageError(f"{flag} {text} is not a version listed by {source}{hint}")
    old, new = (ends["--bad"], ends["--good"]) if find_fix else (ends["--good"], ends["--bad"])
    if old >= new:
        if find_fix:
            raise UsageError(f"with --find-fix, --bad ({bad}) must be older than --good ({good})")
        raise UsageError(
            f"--good ({good}) must be older than --bad ({bad}); to find where it was fixed use --find-fix"
        )
    return [v for v in versions if old <= v <= new]
