"""Size strings ("12 MiB", "24G", "1.5GB", "3%") in and out, so markers and options read like pytest-memray's.

A size string needs its unit: ``24`` alone is refused (``--fit 24`` had meant 24 bytes). Binary units:
``KiB``/``MiB``/``GiB``/``TiB`` and their short forms ``K``/``M``/``G``/``T`` (as ``ls -h`` and ``free -h`` write
them); SI units: ``kB``/``MB``/``GB``/``TB`` (powers of 1000, as GPU vendors write a card's memory); ``B``: bytes.
A Python number (``4096``) is bytes."""

from __future__ import annotations

import math
import re

from vramguard.errors import UsageError

_UNITS = {
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*)\s*$")


SIZE_HELP = "24GiB or 24G: binary (2^30 bytes); 24GB: SI (10^9 bytes); a unit is required"
"""How a size option's help says what :func:`parse_size` reads."""

MAX_COUNT = 2**31 - 1
"""The largest count (sequence length, batch, rank, steps, ranks) a run takes: counts beyond it are no run
anyone launches, and their products with the model's widths overflow torch's 64-bit sizes."""


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"12 MiB"`` / ``"24G"`` / ``"1.5GB"`` / ``4096`` (a number: bytes); raises UsageError on
    anything else, a string without a unit among them."""
    if isinstance(text, bool):
        raise UsageError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            raise UsageError(f"not a size: {text!r}")
        if text < 0:
            raise UsageError(f"a size cannot be negative: {text!r}")
        return int(round(text))
    m = _SIZE.match(str(text))
    if m and not m.group(2):
        raise UsageError(
            f"{str(text).strip()[:40]!r} has no unit: say e.g. '{str(text).strip()[:40]}GiB' (binary, 2^30) or "
            f"'{str(text).strip()[:40]}GB' (SI, 10^9)"
        )
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"not a size: {text!r} (use e.g. '512 KiB', '12 MiB', '1.5 GiB')")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise UsageError(f"a size cannot be negative: {text!r}")
    if not math.isfinite(value):
        raise UsageError(f"not a size: {str(text)[:40]!r}... is beyond any memory")
    return int(round(value))


def parse_percent(text: str | float) -> float:
    """A fraction from ``"3%"`` (0.03) or a plain number taken as a fraction (``0.03``)."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise UsageError(f"not a percentage: {text!r} (use e.g. '3%')") from None
    if not math.isfinite(value):
        raise UsageError(f"not a percentage: {text!r} (use e.g. '3%')")
    if value < 0:
        raise UsageError(f"a percentage cannot be negative: {text!r}")
    return value


def format_bytes(n: float, signed: bool = False) -> str:
    """Human size in binary units, e.g. ``1.50 MiB``; ``signed`` adds ``+`` to positive deltas."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
