"""Collections' BM25 term statistics for searches over several KBs, kept for a few seconds.

A search over several KBs weighs its BM25 terms with the IDF of all of them together
(`bm25.shared_idf_queries`), read from each collection by one-term probes
(`VectorStore.term_stats`): about a millisecond a KB, paid on every search otherwise. The
statistics change only as documents are written, and reading them a few seconds late
moves a term's weight as little as those seconds of writes move its document frequency.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from services.common.store import TermStats, VectorStore

# How long statistics are reused: a term's weight moves as little in ten seconds of writes
# as it would by reading them late, and a search over several KBs saves a read per KB.
TTL_SECONDS = 10.0


class TermStatsCache:
    def __init__(
        self,
        store: VectorStore,
        ttl_seconds: float = TTL_SECONDS,
        max_terms: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl = ttl_seconds
        self.max_terms = max_terms
        self.clock = clock
        # (collection, term) → (read at, document frequency); collection → (read at, points).
        # Our own bounded dict, not functools: entries expire by age and one probe fills many
        # (and no cache library, cachetools or other, is a dependency).
        self._df: OrderedDict[tuple[str, int], tuple[float, int]] = OrderedDict()
        self._points: dict[str, tuple[float, int]] = {}

    async def get(self, collection: str, terms: list[int]) -> TermStats:
        now = self.clock()
        fresh = now - self.ttl
        df = {t: self._df[(collection, t)] for t in terms if (collection, t) in self._df}
        stale = [t for t in terms if t not in df or df[t][0] <= fresh]
        points = self._points.get(collection)
        if stale or points is None or points[0] <= fresh:
            read = await self.store.term_stats(collection, stale)
            points = self._points[collection] = (now, read.points)
            for t in stale:
                df[t] = self._df[(collection, t)] = (now, read.df.get(t, 0))
                self._df.move_to_end((collection, t))
            while len(self._df) > self.max_terms:
                self._df.popitem(last=False)
        # Counts read at different times can disagree (a term counted before documents
        # were deleted): never more holders than points, or an IDF would turn negative.
        return TermStats(points[1], {t: min(n, points[1]) for t, (_, n) in df.items() if n})
