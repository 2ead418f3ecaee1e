"""The embedder factory: one embedder per (model, api_base), created on first use, and a
bounded cache of query vectors in front of it."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.embedders.base import Embedder, is_local
from services.common.embedders.local import LocalEmbedder, local_spec
from services.common.embedders.remote import LiteLLMEmbedder, remote_max_tokens
from services.common.embedders.selection import Backend, Device, Precision
from services.common.settings import (
    EMBED_BATCH_SIZE,
    EMBED_MAX_BATCH,
    LOCAL_BACKEND,
    QUERY_CACHE_SIZE,
)

if TYPE_CHECKING:
    from services.common.infra.egress import EgressPolicy


def model_limits(model: str) -> int:
    """Usable input tokens for `model`, without loading it. InvalidInput for unknown local
    models; remote models not in LiteLLM's map get DEFAULT_REMOTE_MAX_TOKENS."""
    if is_local(model):
        return local_spec(model).max_tokens
    return remote_max_tokens(model)


class EmbedderPool:
    """Hands out one embedder per (model, api_base), created on first use."""

    def __init__(
        self,
        *,
        batch_size: int = EMBED_BATCH_SIZE,
        max_batch: int = EMBED_MAX_BATCH,
        api_key: str | None = None,
        query_cache_size: int = QUERY_CACHE_SIZE,
        local_backend: Backend = LOCAL_BACKEND,
        local_device: Device = "auto",
        local_precision: Precision = "auto",
        document_processes: int = 0,
        cache_dir: Path | None = None,
        egress: EgressPolicy | None = None,
    ) -> None:
        # The composition root passes the operator's policy; None checks nothing (tests that
        # build embedders on their own local servers).
        self._egress = egress
        self._api_key = api_key
        self._local: dict[str, Any] = dict(
            backend=local_backend,
            device=local_device,
            precision=local_precision,
            cache_dir=cache_dir,
            batch_size=batch_size,
            max_batch=max_batch,
            document_processes=document_processes,
        )
        self._embedders: dict[tuple[str, str | None], Embedder] = {}
        self._lock = threading.Lock()
        self.queries = CachedQueryEmbedder(self, size=query_cache_size)

    def get(self, model: str, api_base: str | None = None) -> Embedder:
        # api_base means nothing to an in-process model; one instance serves every KB.
        key = (model, None if is_local(model) else api_base)
        with self._lock:
            embedder = self._embedders.get(key)
            if embedder is None:
                if is_local(model):
                    embedder = LocalEmbedder(model, **self._local)
                else:
                    embedder = LiteLLMEmbedder(
                        model, api_base=api_base, api_key=self._api_key, egress=self._egress
                    )
                self._embedders[key] = embedder
            return embedder

    def loaded(self) -> list[Embedder]:
        with self._lock:
            return list(self._embedders.values())

    async def embed_query(self, model: str, text: str, api_base: str | None = None) -> list[float]:
        return await self.queries.embed(model, text, api_base)


_Key = tuple[str, str | None, str]


class CachedQueryEmbedder:
    """Bounded LRU of query vectors keyed by (model, api_base, text). Concurrent requests for
    the same uncached query share one embedding call (a caller that goes away leaves it to
    the others); a failure is not kept. `size=0` disables caching, not the sharing."""

    def __init__(self, pool: EmbedderPool, size: int = 1024) -> None:
        self._pool = pool
        self._size = max(0, size)
        self._cache: OrderedDict[_Key, list[float]] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Task[list[float]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    async def embed(self, model: str, text: str, api_base: str | None = None) -> list[float]:
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
