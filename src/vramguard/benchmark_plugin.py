"""The ``pytest11`` entry point ``vramguard_benchmark`` (a public name kept for ``-p``); the plugin is
:mod:`vramguard.pytest.benchmark`."""

from vramguard.pytest.benchmark import *
