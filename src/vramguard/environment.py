"""Which libraries and which device produced a number: every report and benchmark carries this."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACKED_PACKAGES: tuple[str, ...] = ("torch", "bitsandbytes", "transformers", "peft", "accelerate", "trl")


def package_version(name: str) -> str | None:
    """Installed distribution version, or None when the package is absent. Read once a process for each
    search path (``sys.path``): importlib.metadata scans every entry of it on each call (about 2 ms, and
    every report reads six), and an install while the process runs changes the files, not the modules the
    process imported."""
    return _version(name, tuple(sys.path))


@functools.lru_cache(maxsize=256)
def _version(name: str, search_path: tuple[str, ...]) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Environment:
    """Library versions and device identity, the key under which measurements are comparable."""

    packages: dict[str, str | None]
    python: str
    platform: str
    device: str
    gpu_name: str | None = None
    cuda: str | None = None
    commit: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The environment as the JSON documents record it."""
        return asdict(self)

    def key(self) -> str:
        """A filesystem-safe key: device plus the tracked package versions."""
        parts = [self.gpu_name or self.device]
        parts += [f"{k}-{v}" for k, v in sorted(self.packages.items()) if v]
        return "_".join(p.replace(" ", "-").replace("/", "-") for p in parts)


def git_commit(path: Path | None = None) -> str | None:
    """The commit checked out at ``path`` (the current folder by default), or None outside a git checkout or
    without git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect(device: str = "cpu", commit_dir: Path | None = None) -> Environment:
    """Describe this process's environment for ``device`` (``cpu``, ``cuda``, ``cuda:1``, ``meta``)."""
    import torch

    gpu_name = cuda = None
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu_name = torch.cuda.get_device_name(torch.device(device))
        cuda = torch.version.cuda
    return Environment(
        packages={name: package_version(name) for name in TRACKED_PACKAGES},
        python=platform.python_version(),
        platform=platform.platform(),
        device=device,
        gpu_name=gpu_name,
        cuda=cuda,
        commit=git_commit(commit_dir),
    )
