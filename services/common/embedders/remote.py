"""LiteLLM embedders: any hosted or self-hosted model LiteLLM speaks to (OpenAI, Cohere,
Ollama, TEI/vLLM via `api_base`), with our own retry policy and cross-document batching."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.domain.errors import InvalidInput, Transient
from services.common.embedders.base import EMBED_MAX_BATCH, MODEL_FIELD, QUERY_MAX_TEXTS, normalise
from services.common.embedders.batching import Batcher
from services.common.embedders.tokenizing import tiktoken_tokenizer
from services.common.ops import metrics
from services.common.outbound.egress import EgressPolicy, egress_scope
from services.common.outbound.modelcalls import (
    MODEL_BACKOFF_SECONDS,
    MODEL_TIMEOUT_SECONDS,
    MODEL_TRIES,
    NO_SDK_RETRIES,
    call_model,
    check_destination,
    http_client,
    import_litellm,
    import_litellm_off_loop,
)

_WHAT = "call the embedding model at"
# LiteLLM's usual limit for OpenAI embedding models; used when the model is not in its map.
DEFAULT_REMOTE_MAX_TOKENS = 8191


def remote_max_tokens(model: str) -> int:
    litellm = import_litellm()
    try:
        info = litellm.get_model_info(model)
    except Exception:
        # Unmapped models (self-hosted, custom names) are normal: fall back to the default.
        return DEFAULT_REMOTE_MAX_TOKENS
    limit = info.get("max_input_tokens") or info.get("max_tokens")
    return int(limit) if limit else DEFAULT_REMOTE_MAX_TOKENS


class LiteLLMEmbedder:
    """Any LiteLLM embedding model; dimension learnt from the first response."""

    def __init__(
        self,
        model: str,
        api_base: str | None = None,
        api_key: str | None = None,
        *,
        batch_size: int = EMBED_MAX_BATCH,
        tries: int = MODEL_TRIES,
        backoff_seconds: float = MODEL_BACKOFF_SECONDS,
        timeout_seconds: float = MODEL_TIMEOUT_SECONDS,
        egress: EgressPolicy | None = None,
    ) -> None:
        self.model = model
        self.api_base = api_base
        self._egress = egress
        self._api_key = api_key
        self._batch_size = batch_size
        self._tries = max(1, tries)
        self._backoff = backoff_seconds
        self._timeout = timeout_seconds
        self._dim: int | None = None
        self._max_tokens: int | None = None
        self._tokenizer: object | None = None
        self.embed_count = 0  # texts embedded, probes excluded
        # Chunks of concurrently indexed documents share requests of up to `batch_size`.
        self.documents = Batcher(
            self._embed_batch,
            max_texts=batch_size,
            linger_seconds=0.005,
            observe=metrics.EMBED_BATCH_SECONDS.observe,
        )

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise RuntimeError(f"dimension of {self.model} unknown until probe() or embed()")
        return self._dim

    @property
    def max_tokens(self) -> int:
        if self._max_tokens is None:
            self._max_tokens = remote_max_tokens(self.model)
        return self._max_tokens

    async def probe(self) -> int:
        """Embed a probe text to learn (and check) the dimension."""
        await self._embed_batch(["ping"])
        return self.dim

    async def embed(self, texts: list[str], *, query: bool = False) -> list[list[float]]:
        if query and len(texts) <= QUERY_MAX_TEXTS:
            # Queries go straight out: HTTP calls run concurrently, nothing to wait behind.
            vectors = await self._embed_batch(texts) if texts else []
        else:
            vectors = await self.documents.submit(texts)
        self.embed_count += len(texts)
        return vectors

    async def _embed_batch(self, batch: list[str]) -> list[list[float]]:
        litellm = await import_litellm_off_loop()
        # None: unrestricted (tools and tests with their own model servers); the services
        # always pass the operator's policy.
        policy = self._egress or EgressPolicy(allow_private=True)
        # Checked at every call, not only when the KB was saved: a name can be re-pointed at
        # an internal address later, and KBs saved before the policy existed remain.
        await check_destination(
            policy, self.model, self.api_base, model_field=MODEL_FIELD, what=_WHAT
        )
        field = "api_base" if self.api_base else MODEL_FIELD
        client = http_client(self.model, self.api_base)

        async def call() -> Any:
            with egress_scope(policy, field=field, what=_WHAT):
                return await litellm.aembedding(
                    model=self.model,
                    input=batch,
                    api_base=self.api_base,
                    api_key=self._api_key,
                    timeout=self._timeout,
                    max_retries=NO_SDK_RETRIES,  # one retry policy, ours
                    **client,
                )

        response = await call_model(
            call,
            model=self.model,
            tries=self._tries,
            backoff_seconds=self._backoff,
            litellm=litellm,
            kind="embed",
            rejected="the embedding request",
            field=MODEL_FIELD,
        )
        return self._vectors(response, len(batch))

    def _vectors(self, response: Any, expected: int) -> list[list[float]]:
        items = sorted(response.data, key=lambda d: d["index"] if isinstance(d, dict) else d.index)
        rows = [d["embedding"] if isinstance(d, dict) else d.embedding for d in items]
        if len(rows) != expected:
            raise Transient(
                f"{self.model} returned {len(rows)} vectors for {expected} inputs",
                field=MODEL_FIELD,
            )
        vectors = np.asarray(rows, dtype=np.float32)
        dim = vectors.shape[1] if vectors.ndim == 2 else 0
        if dim == 0:
            raise Transient(f"{self.model} returned malformed vectors", field=MODEL_FIELD)
        if self._dim is None:
            self._dim = dim
        elif dim != self._dim:
            raise InvalidInput(
                f"{self.model} changed dimension from {self._dim} to {dim}", field=MODEL_FIELD
            )
        return normalise(vectors).tolist()

    def tokenizer(self) -> object:
        if self._tokenizer is None:
            self._tokenizer = tiktoken_tokenizer(self.model)
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        tok = self.tokenizer()
        if isinstance(tok, str):  # chonkie's character tokenizer
            return len(text)
        return len(tok.encode(text))  # type: ignore[attr-defined]
