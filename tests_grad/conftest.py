"""Hypothesis profiles and the ``--vram-patch`` option for the gradient-equivalence suite.

Profiles: ``ci`` (default; 40 derandomized examples per property) and ``nightly`` (1000 random ones),
chosen with ``--hypothesis-profile NAME`` (hypothesis' own option) or ``VRAMGUARD_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import pytest

from vramguard.grad import patches, profiles

profiles.load_profile()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vram-patch",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="also run every gradient property under this user patch (a vramguard Patch or a factory)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for spec in config.getoption("--vram-patch", default=[]) or []:
        patches.register(patches.load_spec(spec), replace=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "patch_name" in metafunc.fixturenames:
        metafunc.parametrize("patch_name", ["unpatched", *patches.names()])


@pytest.fixture
def patch(patch_name: str) -> patches.Patch | None:
    """The patch under test (None for the unpatched library); skips, with the reason, when it does not
    apply to the installed version."""
    if patch_name == "unpatched":
        return None
    p = patches.get(patch_name)
    can = p.applies()
    if not can:
        pytest.skip(f"patch {patch_name!r} does not apply: {can.reason}")
    return p
