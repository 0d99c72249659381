"""The ``pytest11`` entry point ``vramguard`` (a public name kept for ``-p``); the plugin is
:mod:`vramguard.pytest.plugin`."""

from vramguard.pytest.plugin import *
