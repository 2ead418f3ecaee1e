"""Embedders: one interface over local models and any LiteLLM embedding model.

    Embedder (Protocol)     base.py
    ├── LocalEmbedder       local.py: `local/...` ids on onnxruntime (CPU) or torch (CUDA);
    │                       engine.py, selection.py, cpu.py, processes.py, onnx_export.py
    └── LiteLLMEmbedder     remote.py: OpenAI, Cohere, Ollama, TEI/vLLM via api_base
    Batcher                 batching.py: chunks of concurrent documents share model calls
    EmbedderPool            pool.py: one instance per (model, api_base); a query-vector LRU

Vectors are always L2-normalised, so dot product and cosine agree whatever the provider does.
Model calls never run on the event loop.
"""

from services.common.embedders.base import (
    LOCAL_PREFIX,
    MODEL_FIELD,
    QUERY_MAX_TEXTS,
    Embedder,
    is_local,
)
from services.common.embedders.batching import Batcher
from services.common.embedders.local import LOCAL_MODELS, LocalEmbedder, default_cache_dir
from services.common.embedders.pool import CachedQueryEmbedder, EmbedderPool, model_limits
from services.common.embedders.remote import DEFAULT_REMOTE_MAX_TOKENS, LiteLLMEmbedder

__all__ = [
    "DEFAULT_REMOTE_MAX_TOKENS",
    "LOCAL_MODELS",
    "LOCAL_PREFIX",
    "MODEL_FIELD",
    "QUERY_MAX_TEXTS",
    "Batcher",
    "CachedQueryEmbedder",
    "Embedder",
    "EmbedderPool",
    "LiteLLMEmbedder",
    "LocalEmbedder",
    "default_cache_dir",
    "is_local",
    "model_limits",
]
