"""The embedder interface and what every provider shares: the model-id vocabulary and
L2 normalisation."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

LOCAL_PREFIX = "local/"
MODEL_FIELD = "embedding_model"
# Query requests of at most this many texts take the short lane, never waiting behind a
# document batch.
QUERY_MAX_TEXTS = 4
# Texts per local model run (each run sorted by length, padded to its longest), and chunks of
# concurrent documents embedded in one call at most: 16, 32 and 128 ingested no faster
# (docs/benchmarks.md, "Figures behind the code").
EMBED_BATCH_SIZE = 32
EMBED_MAX_BATCH = 64


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

    async def embed(self, texts: list[str], *, query: bool = False) -> list[list[float]]:
        """One L2-normalised vector per text, in order. Document texts of concurrent calls
        are batched together; `query=True` (a few short texts) takes the short lane."""

    def count_tokens(self, text: str) -> int:
        """Tokens in `text` as the model counts them, special tokens excluded."""

    def tokenizer(self) -> object:
        """A tokenizer chonkie 1.7 chunkers accept as `tokenizer=`."""


def is_local(model: str) -> bool:
    return model.startswith(LOCAL_PREFIX)


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length as float32; a zero row stays zero rather than NaN."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return vectors / norms
