"""vramguard: where the memory of quantized fine-tuning goes, measured per layer and per storage."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
