"""Embedders: one interface over local models and any LiteLLM embedding model.

    Embedder (Protocol)     base.py
    ├── LocalEmbedder       local.py: `local/...` ids on onnxruntime (CPU) or torch (CUDA);
    │                       engine.py, selection.py, cpu.py, processes.py, onnx_export.py
    └── LiteLLMEmbedder     remote.py: OpenAI, Cohere, Ollama, TEI/vLLM via api_base
    Batcher                 batching.py: chunks of concurrent documents share model calls
    EmbedderPool            pool.py: one instance per (model, api_base)

Vectors are always L2-normalised, so dot product and cosine agree whatever the provider does.
Model calls never run on the event loop.
"""

from services.common.embedders.base import Embedder, is_local
from services.common.embedders.batching import Batcher
from services.common.embedders.local import LocalEmbedder, default_cache_dir
from services.common.embedders.pool import EmbedderPool, model_limits
from services.common.embedders.remote import LiteLLMEmbedder

__all__ = [
    "Batcher",
    "Embedder",
    "EmbedderPool",
    "LiteLLMEmbedder",
    "LocalEmbedder",
    "default_cache_dir",
    "is_local",
    "model_limits",
]
