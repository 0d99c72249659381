"""The pure bisection, exhaustive over small sizes: the probe bound and skips are proven, not sampled."""

from __future__ import annotations

import random

import pytest

from vramguard.bisect.search import Bisection, EndpointError, State, probe_bound, run


def monotone(first_new: int, skipped: frozenset[int] = frozenset()):
    def oracle(i: int) -> State:
        if i in skipped:
            return State.SKIP
        return State.NEW if i >= first_new else State.OLD

    return oracle


@pytest.mark.parametrize("n", range(2, 66))
def test_finds_every_transition_within_the_bound(n: int) -> None:
    for first in range(1, n):
        calls: list[int] = []

        def oracle(i: int, _first: int = first, calls: list[int] = calls) -> State:
            calls.append(i)
            return monotone(_first)(i)

        search = run(n, oracle)
        assert search.first_new() == first and search.candidates() == [first]
        assert search.last_old() == first - 1
        assert len(calls) == len(set(calls)), "a version was probed twice"
        assert len(calls) <= probe_bound(n), (n, first, calls)
        assert calls[:2] == [0, n - 1], "endpoints are verified first"


def test_bound_formula() -> None:
    assert [probe_bound(n) for n in (2, 3, 4, 5, 9, 10, 16, 17, 60)] == [3, 4, 4, 5, 6, 6, 6, 7, 8]


def test_skips_never_hide_the_answer_and_cost_little() -> None:
    rnd = random.Random(1234)
    for _ in range(3000):
        n = rnd.randint(3, 40)
        first = rnd.randint(1, n - 1)
        skipped = frozenset(i for i in range(1, n - 1) if rnd.random() < 0.3)
        search = run(n, monotone(first, skipped))
        cands = search.candidates()
        assert first in cands
        # Everything before the last candidate is a skipped version: the ambiguity is only what skips cause.
        assert all(i in skipped for i in cands[:-1])
        assert cands[-1] == search.first_new() and search.first_new() not in skipped
        n_skips = sum(1 for s in search.states.values() if s is State.SKIP)
        # Stepping around a skipped midpoint can unbalance one split: at most one extra real probe.
        assert len(search.states) - n_skips <= probe_bound(n) + (1 if n_skips else 0)
        if {first - 1, first}.isdisjoint(skipped):  # both sides of the change are testable: exact answer
            assert cands == [first]


def test_skipped_neighbour_makes_the_result_ambiguous_not_wrong() -> None:
    # 10 versions, change at 5, version 4 cannot be tested: first new is 4 or 5.
    search = run(10, monotone(5, frozenset({4})))
    assert search.candidates() == [4, 5]
    assert search.first_new() == 5 and search.last_old() == 3


@pytest.mark.parametrize(
    ("index", "state"), [(0, State.NEW), (0, State.SKIP), (9, State.OLD), (9, State.SKIP)]
)
def test_endpoint_contradictions_raise(index: int, state: State) -> None:
    search = Bisection(10)
    if index == 9:
        search.record(0, State.OLD)
    with pytest.raises(EndpointError) as info:
        search.record(index, state)
    assert info.value.index == index and info.value.got is state


def test_needs_two_candidates() -> None:
    with pytest.raises(ValueError):
        Bisection(1)
