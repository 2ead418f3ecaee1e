"""The embedder factory: one embedder per (model, api_base), created on first use."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.embedders.base import EMBED_BATCH_SIZE, EMBED_MAX_BATCH, Embedder, is_local
from services.common.embedders.local import LocalEmbedder, local_spec
from services.common.embedders.remote import LiteLLMEmbedder, remote_max_tokens
from services.common.embedders.selection import Backend, Device, Precision
from services.common.settings import LOCAL_BACKEND

if TYPE_CHECKING:
    from services.common.outbound.egress import EgressPolicy


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
        local_backend: Backend = LOCAL_BACKEND,
        local_device: Device = "auto",
        local_precision: Precision = "auto",
        document_processes: int = 0,
        cache_dir: Path | None = None,
        egress: EgressPolicy | None = None,
    ) -> None:
        # The operator's policy from the composition root; None (tests) checks nothing.
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
