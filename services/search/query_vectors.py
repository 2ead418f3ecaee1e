"""Query vectors of recent searches: a bounded LRU in front of the embedder pool, so an agent
that asks again (or pages through results) costs no model call."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict

from services.common.embedders import EmbedderPool, is_local

_Key = tuple[str, str | None, str]
# Query vectors kept: a few MB, enough for an agent's repeated and paged queries.
QUERY_CACHE_SIZE = 1024


class QueryVectors:
    """LRU of query vectors keyed by (model, api_base, text). Concurrent requests for the
    same uncached query share one embedding call (a caller that goes away leaves it to the
    others); a failure is not kept. `size=0` disables caching, not the sharing."""

    def __init__(self, pool: EmbedderPool, size: int = QUERY_CACHE_SIZE) -> None:
        self._pool = pool
        self._size = max(0, size)
        # Our own LRU, not functools.lru_cache: entries come from a call shared by concurrent
        # callers and a failure must not be kept (no cache library is a dependency).
        self._cache: OrderedDict[_Key, list[float]] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Task[list[float]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    async def embed(self, model: str, text: str, api_base: str | None = None) -> list[float]:
        # api_base means nothing to a local model (the pool keys it the same way).
        key: _Key = (model, None if is_local(model) else api_base, text)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return list(cached)
        call = self._inflight.get(key)
        if call is None:
            self.misses += 1
            call = self._inflight[key] = asyncio.create_task(self._embed(key, api_base))
            call.add_done_callback(functools.partial(self._settled, key))
        else:
            self.hits += 1
        return list(await asyncio.shield(call))

    def _settled(self, key: _Key, call: asyncio.Task[list[float]]) -> None:
        self._inflight.pop(key, None)
        if not call.cancelled():
            call.exception()  # retrieved, so asyncio never logs it as unhandled

    async def _embed(self, key: _Key, api_base: str | None) -> list[float]:
        [vector] = await self._pool.get(key[0], api_base).embed([key[2]], query=True)
        if self._size:
            self._cache[key] = vector
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return vector
