"""The hypothesis profiles of the gradient-equivalence suite (``tests_grad``), apart from the strategies.

Why apart: pytest loads ``tests_grad/conftest.py`` in every process of a run, the xdist controller too, and
hypothesis' plugin loads ``--hypothesis-profile NAME`` there, so the profiles must be registered in that
process; the strategies import torch, which the controller does not need (about 2.5 CPU s before the
workers start).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: the environment variable that names the profile when ``--hypothesis-profile`` is not given
PROFILE_ENV = "VRAMGUARD_HYPOTHESIS_PROFILE"


def register_profiles() -> None:
    """(The ``patch`` fixture is immutable, so the function-scoped-fixture health check is off.)
    ``ci`` (default): few examples, derandomized, no database -- same examples on every run.
    ``nightly``: many more random examples, for a scheduled job that explores."""
    common = {
        "deadline": None,
        "suppress_health_check": [
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    }
    settings.register_profile(
        "ci", max_examples=40, derandomize=True, database=None, print_blob=False, **common
    )
    settings.register_profile("nightly", max_examples=1000, derandomize=False, print_blob=True, **common)


def load_profile(name: str | None = None) -> str:
    """Load ``name`` (else ``$VRAMGUARD_HYPOTHESIS_PROFILE``, else ``ci``); returns the loaded name."""
    register_profiles()
    chosen = name or os.environ.get(PROFILE_ENV) or "ci"
    settings.load_profile(chosen)
    return chosen
