"""The pure search behind ``vramguard bisect``: no installs, no subprocesses, so it is tested exhaustively.

Versions are indices ``0..n-1`` in ascending order. Index 0 is the *old* endpoint (the ``--good`` one, or
the ``--bad`` one with ``--find-fix``) and index ``n-1`` the *new* endpoint. The search finds the first
index whose state is NEW, like ``git bisect run``: verify both endpoints, then halve the interval,
stepping around versions that cannot be tested (SKIP) without losing the ``ceil(log2 n) + 2`` bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class State(str, Enum):
    """What a probe says about one version, relative to the endpoints."""

    OLD = "old"
    NEW = "new"
    SKIP = "skip"


class EndpointError(Exception):
    """An endpoint does not have the state the user claimed (or cannot be tested)."""

    def __init__(self, index: int, expected: State, got: State) -> None:
        super().__init__(f"endpoint {index}: expected {expected.value}, got {got.value}")
        self.index, self.expected, self.got = index, expected, got


def probe_bound(n: int) -> int:
    """Most probes a search over ``n`` candidates may take when nothing is skipped."""
    return math.ceil(math.log2(n)) + 2 if n > 1 else n


@dataclass
class Bisection:
    """State machine of one search: ask :meth:`next_index`, answer with :meth:`record`."""

    n: int
    states: dict[int, State] = field(default_factory=dict)
    lo: int = 0  # highest index known OLD
    hi: int = -1  # lowest index known NEW

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError("a bisection needs at least two candidates")
        self.hi = self.n - 1

    def next_index(self) -> int | None:
        """Next index to probe, or None when the search is over (endpoints first)."""
        for end in (0, self.n - 1):
            if end not in self.states:
                return end
        open_ = [i for i in range(self.lo + 1, self.hi) if i not in self.states]
        if not open_:
            return None
        mid = (self.lo + self.hi) // 2
        # The untested index closest to the middle; ties go to the lower one, as git does.
        return min(open_, key=lambda i: (abs(i - mid), i))

    def record(self, index: int, state: State) -> None:
        """Take a probe's answer; endpoint answers that contradict the claim raise EndpointError."""
        self.states[index] = state
        if index == 0 and state is not State.OLD:
            raise EndpointError(index, State.OLD, state)
        if index == self.n - 1 and state is not State.NEW:
            raise EndpointError(index, State.NEW, state)
        if state is State.OLD:
            self.lo = max(self.lo, index)
        elif state is State.NEW:
            self.hi = min(self.hi, index)

    @property
    def done(self) -> bool:
        """Whether the search has nothing left to probe."""
        return self.next_index() is None

    def first_new(self) -> int:
        """Lowest index known NEW (exact when :meth:`candidates` has one element)."""
        return self.hi

    def last_old(self) -> int:
        """Index of the newest candidate known to be in the old state (the last good one in a regression
        hunt)."""
        return self.lo

    def candidates(self) -> list[int]:
        """Indices that could be the first NEW one: skipped ones between the bounds, then ``hi``."""
        return [i for i in range(self.lo + 1, self.hi) if self.states.get(i) is State.SKIP] + [self.hi]


def run(n: int, oracle: Callable[[int], State]) -> Bisection:
    """Drive a whole search with ``oracle(index) -> State``; for tests and simple callers."""
    search = Bisection(n)
    while (index := search.next_index()) is not None:
        search.record(index, oracle(index))
    return search
