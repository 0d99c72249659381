"""Root conftest: the suites must never reach a model hub, and must not depend on the caller's cwd."""

from __future__ import annotations

import os

# Every model is built from a config with random weights; a download attempt is a bug, so fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
