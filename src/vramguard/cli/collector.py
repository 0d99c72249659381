"""Python's cyclic garbage collector during a command's imports.

``vramguard estimate`` imports torch, transformers, TRL, PEFT and bitsandbytes as it runs: about 500,000 objects,
none of them garbage. The collector's full passes over them while they grow (a full collection whenever the
long-lived objects grew by a quarter) took 1.6-2.3 s of a 70B estimate's 12-15 CPU s, measured with
``gc.callbacks``. :func:`imports_uncollected` turns the collector off for the imports and then freezes what they
made (``gc.freeze``: full collections skip it) before the collector runs again for what the estimate makes.

What the estimate measures does not move with the collector: its storages are freed by reference counts, not by
collections (the estimates' JSON is the same with the collector off for the whole run and with it collecting
every 50 allocations: docs/measurements/2026-11-29-estimate-speed, Session 19).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def imports_uncollected() -> Iterator[Callable[[], None]]:
    """The collector off within the block until the call it yields (the imports are done): that call freezes
    the objects made so far and turns the collector back on. When the block ends, however it ends, the frozen
    objects are collectable again and the collector is on or off as before (an in-process caller: the tests).
    A caller that froze objects itself keeps its own policy: nothing is done."""
    if gc.get_freeze_count():
        yield lambda: None
        return
    enabled = gc.isenabled()
    gc.disable()

    def imported() -> None:
        gc.freeze()
        if enabled:
            gc.enable()

    try:
        yield imported
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
