"""The estimate's techniques, as values in one registry (:class:`vramguard.step.technique.Technique`).

Each is one module of this package with a ``TECHNIQUE``; :data:`BUILT_IN` is their declared order (the order
their contexts are entered within a stage and their findings are reported). Others come from the
``vramguard.techniques`` entry-point group (each entry point loads a :class:`~vramguard.step.technique.Technique`
or a zero-argument callable returning one), after the built-ins. Adding a technique is one module plus its
entry in :data:`BUILT_IN` (or an entry point).
"""

from __future__ import annotations

import functools
import importlib.metadata

from vramguard.estimate.techniques import autocast, dora, flash, liger, offloading, padding_free, routing
from vramguard.step.technique import Technique
from vramguard.workload.models import QLoRAConfig

ENTRY_POINT_GROUP = "vramguard.techniques"

BUILT_IN: tuple[Technique, ...] = (
    offloading.TECHNIQUE,
    liger.TECHNIQUE,
    routing.TECHNIQUE,
    dora.TECHNIQUE,
    autocast.TECHNIQUE,
    flash.TECHNIQUE,
    padding_free.TECHNIQUE,
)
"""The built-in techniques, in their declared order."""


@functools.cache
def registered() -> tuple[Technique, ...]:
    """Every technique: :data:`BUILT_IN`, then the entry points' (loaded once), each name once."""
    found = list(BUILT_IN)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        loaded = entry.load()
        technique = loaded if isinstance(loaded, Technique) else loaded()
        if not isinstance(technique, Technique):
            raise TypeError(
                f"entry point {entry.name} of {ENTRY_POINT_GROUP} gave {technique!r}, not a Technique"
            )
        if technique.name in {t.name for t in found}:
            raise ValueError(
                f"entry point {entry.name} of {ENTRY_POINT_GROUP}: technique {technique.name} twice"
            )
        found.append(technique)
    return tuple(found)


def used_by(config: QLoRAConfig) -> list[Technique]:
    """The registered techniques ``config`` uses, in the registry's order."""
    return [t for t in registered() if t.applies(config)]
