"""The ``vramguard`` command and every rich/markdown view; the core packages never render."""

from __future__ import annotations

from vramguard.cli.app import main

__all__ = ["main"]
