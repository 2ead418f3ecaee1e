"""The term-statistics cache: only terms not read within the TTL go to the store."""

from __future__ import annotations

from typing import Any

from services.common.store import TermStats
from services.search.termstats import TermStatsCache


class Recorder:
    """Answers term_stats from a table, recording what was asked."""

    def __init__(self) -> None:
        self.points = 10
        self.df = {1: 4, 2: 1}
        self.asked: list[list[int]] = []

    async def term_stats(self, name: str, terms: list[int]) -> TermStats:
        self.asked.append(list(terms))
        return TermStats(self.points, {t: self.df[t] for t in terms if t in self.df})


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_terms_read_within_the_ttl_are_not_read_again() -> None:
    store, clock = Recorder(), Clock()
    cache = TermStatsCache(store, ttl_seconds=10, clock=clock)  # type: ignore[arg-type]
    assert await cache.get("c", [1, 3]) == TermStats(10, {1: 4})
    store.df[1] = 5
    store.points = 11
    clock.now += 5
    # 1 and 3 (held by none) are known; only 2 is read, and the points with it.
    assert await cache.get("c", [1, 2, 3]) == TermStats(11, {1: 4, 2: 1})
    assert await cache.get("c", [3, 1]) == TermStats(11, {1: 4})
    assert store.asked == [[1, 3], [2]]
    clock.now += 6  # 1 and 3 are 11 s old, 2 is 6 s old
    assert await cache.get("c", [1, 2, 3]) == TermStats(11, {1: 5, 2: 1})
    assert store.asked[-1] == [1, 3]


async def test_collections_are_kept_apart_and_the_size_is_bounded() -> None:
    store, clock = Recorder(), Clock()
    cache = TermStatsCache(store, ttl_seconds=10, max_terms=2, clock=clock)  # type: ignore[arg-type]
    await cache.get("a", [1])
    await cache.get("b", [1])
    await cache.get("b", [2])  # evicts ("a", 1), the least recently read
    assert store.asked == [[1], [1], [2]]
    await cache.get("a", [1])
    assert store.asked[-1] == [1]


async def test_a_ttl_of_zero_reads_every_time() -> None:
    store: Any = Recorder()
    cache = TermStatsCache(store, ttl_seconds=0, clock=Clock())
    await cache.get("c", [1])
    await cache.get("c", [1])
    assert store.asked == [[1], [1]]


async def test_counts_read_before_deletions_never_exceed_the_points() -> None:
    store, clock = Recorder(), Clock()
    cache = TermStatsCache(store, ttl_seconds=10, clock=clock)  # type: ignore[arg-type]
    await cache.get("c", [1])  # 4 of 10 points hold term 1
    store.points = 2
    await cache.get("c", [2])  # the points are read again with term 2; term 1 is not
    assert await cache.get("c", [1]) == TermStats(2, {1: 2})
